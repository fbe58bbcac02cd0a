"""Weight initialisers as Params, and the draws they make.

Every initial value is a stateless random draw seeded by a stable hash of
(random_seed, the layer's path, the variable's name): the same Params give
the same weights however the model is cut into stages, in any process.
`base_layer` re-exports WeightInit, WeightParams and stable_seed, the names
a layer's code uses.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from lingvo_pipe.core.hyperparams import Params


class WeightInit:
  """Initialiser specs, as Params so they print and parse with the model.

  `method` is one of 'gaussian' (stddev=scale), 'truncated_gaussian',
  'uniform' (±scale), 'xavier' (Glorot uniform × scale), 'he' (Kaiming normal
  × scale, for ReLU), 'constant' (every value = scale).
  """

  METHODS = ('gaussian', 'truncated_gaussian', 'uniform', 'xavier', 'he',
             'constant')

  @staticmethod
  def _Make(method: str, scale: float) -> Params:
    p = Params()
    p.Define('method', method, f'One of {WeightInit.METHODS}.')
    p.Define('scale', float(scale), 'Stddev, range, gain or constant value.')
    return p

  @staticmethod
  def Gaussian(scale: float = 1.0) -> Params:
    return WeightInit._Make('gaussian', scale)

  @staticmethod
  def TruncatedGaussian(scale: float = 1.0) -> Params:
    return WeightInit._Make('truncated_gaussian', scale)

  @staticmethod
  def Uniform(scale: float = 1.0) -> Params:
    return WeightInit._Make('uniform', scale)

  @staticmethod
  def Xavier(scale: float = 1.0) -> Params:
    return WeightInit._Make('xavier', scale)

  @staticmethod
  def He(scale: float = 1.0) -> Params:
    return WeightInit._Make('he', scale)

  @staticmethod
  def Constant(scale: float = 0.0) -> Params:
    return WeightInit._Make('constant', scale)


def WeightParams(shape: Sequence[int],
                 init: Params | None = None,
                 dtype: tf.DType | None = None,
                 trainable: bool = True) -> Params:
  """Describes one variable: shape, initialiser, dtype, trainable."""
  p = Params()
  p.Define('shape', list(shape), 'Variable shape.')
  p.Define('init', init, 'A WeightInit spec; None uses the layer\'s '
           'params_init.')
  p.Define('dtype', dtype, 'Variable dtype; None uses the layer\'s dtype.')
  p.Define('trainable', trainable, 'False for statistics such as BatchNorm '
           'moving averages.')
  return p


def stable_seed(*parts: Any) -> tf.Tensor:
  """A [2] int64 seed for stateless RNG ops from a stable hash of `parts`."""
  digest = hashlib.md5('/'.join(str(x) for x in parts).encode()).digest()
  a = int.from_bytes(digest[:4], 'little') & 0x7FFFFFFF
  b = int.from_bytes(digest[4:8], 'little') & 0x7FFFFFFF
  return tf.constant([a, b], dtype=tf.int64)


def fans(shape: Sequence[int]) -> tuple[int, int]:
  """(fan in, fan out) of a weight of `shape` (kernels: × receptive field)."""
  if not shape:
    return 1, 1
  if len(shape) == 1:
    return shape[0], shape[0]
  receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
  return shape[-2] * receptive, shape[-1] * receptive


def initial_value(shape: list[int], init: Params, dtype: tf.DType,
                  seed: tf.Tensor) -> tf.Tensor:
  """`init`'s draw for a variable of `shape` (a known method: see
  WeightInit.METHODS; base_layer names the layer when it is not)."""
  method, scale = init.method, init.scale
  fan_in, fan_out = fans(shape)
  if method == 'constant':
    return tf.fill(shape, tf.cast(scale, dtype))
  if method == 'gaussian':
    return tf.random.stateless_normal(shape, seed, stddev=scale, dtype=dtype)
  if method == 'truncated_gaussian':
    return tf.random.stateless_truncated_normal(
        shape, seed, stddev=scale, dtype=dtype)
  if method == 'uniform':
    return tf.random.stateless_uniform(
        shape, seed, -scale, scale, dtype=dtype)
  if method == 'xavier':
    limit = scale * math.sqrt(6.0 / (fan_in + fan_out))
    return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype=dtype)
  if method == 'he':
    stddev = scale * math.sqrt(2.0 / fan_in)
    return tf.random.stateless_normal(shape, seed, stddev=stddev, dtype=dtype)
  raise ValueError(f'Unknown WeightInit method {method!r}; use one of '
                   f'{WeightInit.METHODS}.')
