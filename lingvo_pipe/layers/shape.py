"""Shape plumbing for layer lists: identity, flatten, reshape.

A pipeline is a flat list of layers, so the glue between a conv tower and a
classifier head (flattening [B, H, W, C] to [B, H·W·C]) has to be a layer too
for the partitioner to place it. These layers have no variables and cost 0
flops (a reshape moves no data). `num_elements` is the shared helper the other
layer modules use to count elements of a possibly partly unknown shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap


def num_elements(shape: tf.TensorShape) -> int:
  """Elements of `shape`, counting unknown dims as 1 (like LayerMeta)."""
  return int(np.prod([d if d is not None else 1 for d in
                      tf.TensorShape(shape).as_list()]))


class IdentityLayer(base_layer.BaseLayer):
  """Returns its inputs: one input as is, several as a tuple."""

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    del theta  # No variables.
    return inputs[0] if len(inputs) == 1 else tuple(inputs)

  @classmethod
  def FPropMeta(cls, p: Params, *input_shapes: Any) -> base_layer.LayerMeta:
    return base_layer.LayerMeta.build(p, flops=0, out_shapes=input_shapes,
                                      num_params=0)


class FlattenLayer(base_layer.BaseLayer):
  """[B, d1, d2, ...] → [B, d1·d2·...]: e.g. conv features to an FC head."""

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    del theta  # No variables.
    x = tf.convert_to_tensor(x)
    if x.shape.rank is not None and x.shape.rank < 2:
      raise base_layer.LayerError(
          f'{self.path}: FlattenLayer needs an input of rank ≥ 2 ([B, ...]), '
          f'got shape {x.shape}; it keeps the batch dim and flattens the rest.')
    rest = x.shape[1:].num_elements()
    # [B, d1·d2·...]
    return tf.reshape(x, [tf.shape(x)[0], -1 if rest is None else rest])

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    x = tf.TensorShape(x)
    if x.rank is None or x.rank < 2:
      raise base_layer.LayerError(
          f'{p.name}: FlattenLayer needs an input of rank ≥ 2, got {x}.')
    rest = x[1:].num_elements()
    return base_layer.LayerMeta.build(
        p, flops=0, out_shapes=(tf.TensorShape([x[0], rest]),), num_params=0)


class ReshapeLayer(base_layer.BaseLayer):
  """Reshapes each example: [B, ...] → [B] + p.shape (one entry may be -1)."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('shape', [], 'Per-example output shape (without the batch '
             'dim); at most one entry may be -1 (inferred).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_shape(self.path, self.params.shape)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    del theta  # No variables.
    return tf.reshape(x, [tf.shape(x)[0]] + list(self.params.shape))

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_shape(p.name, p.shape)
    x = tf.TensorShape(x)
    out = list(p.shape)
    if -1 in out:
      known = int(np.prod([d for d in out if d != -1]))
      rest = x[1:].num_elements()
      if rest is not None and rest % known:
        raise base_layer.LayerError(
            f'{p.name}: cannot reshape per-example shape {x[1:]} ({rest} '
            f'elements) to {out}; fix p.shape.')
      out[out.index(-1)] = rest // known if rest is not None else None
    return base_layer.LayerMeta.build(
        p, flops=0, out_shapes=(tf.TensorShape([x[0]] + out),), num_params=0)


def _check_shape(where: str, shape: list[int]) -> None:
  bad = [d for d in shape if not isinstance(d, int) or (d < 1 and d != -1)]
  if not shape or bad or list(shape).count(-1) > 1:
    raise base_layer.LayerError(
        f'{where}: shape must be a non-empty list of positive ints with at '
        f'most one -1, got {shape!r}; set p.shape to the per-example output '
        'shape, e.g. [7, 7, 64].')
