"""Activation functions named by strings, so Params stay text-serialisable.

A Params tree must print as text and parse back (the trainer stores it and
refuses to resume under a different one), so layers hold an activation's
*name* ('RELU'), never the function. `get_activation` turns the name into the
function and answers a typo with the closest real names.

Cost convention: every activation but 'NONE' counts 1 flop per element
(`activation_flops`); they are memory-bound and tiny next to matmuls, and the
partitioner only needs relative costs.
"""

from __future__ import annotations

import difflib
from typing import Callable

import tensorflow as tf

from lingvo_pipe.core import base_layer

Activation = Callable[[tf.Tensor], tf.Tensor]

_ACTIVATIONS: dict[str, Activation] = {
    'NONE': lambda x: x,
    'RELU': tf.nn.relu,
    'RELU6': tf.nn.relu6,
    'GELU': lambda x: tf.nn.gelu(x, approximate=False),  # erf form
    'SIGMOID': tf.sigmoid,
    'TANH': tf.tanh,
    'SWISH': tf.nn.silu,  # x·sigmoid(x)
}

NAMES = tuple(_ACTIVATIONS)


def get_activation(name: str, where: str = 'activation') -> Activation:
  """The function named `name` (one of `NAMES`, upper case).

  Args:
    name: e.g. 'RELU'.
    where: what to name in the error, e.g. 'model.fc1: activation'.

  Returns:
    A function from a tensor to a tensor of the same shape and dtype.

  Raises:
    LayerError: for an unknown name, with the closest known names.
  """
  if isinstance(name, str) and name in _ACTIVATIONS:
    return _ACTIVATIONS[name]
  close = difflib.get_close_matches(str(name).upper(), NAMES, n=2,
                                    cutoff=0.5)
  hint = (f' Did you mean {" or ".join(repr(c) for c in close)}?'
          if close else '')
  raise base_layer.LayerError(
      f'{where}: unknown activation {name!r}.{hint} Known: {", ".join(NAMES)}.')


def activation_flops(name: str, num_elements: int) -> int:
  """Flops of applying activation `name` to `num_elements` elements."""
  return 0 if name == 'NONE' else int(num_elements)
