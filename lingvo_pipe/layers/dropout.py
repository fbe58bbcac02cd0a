"""Dropout whose mask survives pipelining: one helper and one layer.

GPipe runs each stage's forward pass twice — once per micro-batch in the
forward sweep, and again (recomputation) just before that micro-batch's
gradient arrives. A dropout mask drawn from a stateful RNG would differ
between the two passes and the gradient would belong to a different function
than the loss. So the mask here is a *pure function* of

  * `seed_key` (callers pass their layer path plus a suffix),
  * the training step `ctx.step`, and
  * the example's global index in the mini-batch.

`apply_dropout` draws one stateless uniform mask for the whole mini-batch
(`ctx.batch_dim × ctx.num_micro_batches` examples) and slices out rows
`[i·b, (i+1)·b)` of micro-batch i. An example therefore gets the same mask
however the batch is cut into micro-batches and however many stages there
are, and the recompute pass reproduces the forward mask exactly.

Cost convention (FPropMeta): 1 flop per element (compare and scale).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import shape as shape_lib

NoiseShapeFn = Callable[[Sequence[Any]], Sequence[Any]]


def _dim_list(x: tf.Tensor) -> list[Any]:
  """x's shape as a list: static ints where known, scalar tensors elsewhere."""
  dynamic = tf.shape(x)
  return [d if d is not None else dynamic[i]
          for i, d in enumerate(x.shape.as_list())]


def mask_seed(seed_key: str, step: Any) -> tf.Tensor:
  """The [2] int64 stateless seed of (seed_key, step).

  `step` may be a Python int or a scalar int tensor of any int dtype; it is
  cast to int64 first so both give the same seed.
  """
  step = tf.cast(tf.convert_to_tensor(step), tf.int64)
  return tf.random.experimental.stateless_fold_in(
      base_layer.stable_seed(seed_key), step)


def apply_dropout(x: tf.Tensor, rate: float, seed_key: str,
                  noise_shape_fn: NoiseShapeFn | None = None) -> tf.Tensor:
  """Drops elements of `x` with probability `rate` in a training context.

  Args:
    x: [B, ...] activations of this micro-batch (batch dim first).
    rate: probability of dropping an element, in [0, 1).
    seed_key: stable name of the call site, e.g. `f'{self.path}/attention'`.
      Different keys give independent masks.
    noise_shape_fn: optional `fn(shape) -> noise_shape` mapping x's shape (a
      list of ints, or scalar tensors for unknown dims) to the mask's shape
      for this micro-batch, e.g. `lambda s: [s[0], 1, s[2]]` to share the
      mask over time. Its first entry must be the batch dim or 1.

  Returns:
    `x` unchanged outside training or when rate is 0; otherwise `x` with
    dropped elements zeroed and kept ones scaled by 1 / (1 - rate).

  Raises:
    LayerError: if rate is outside [0, 1).
  """
  ctx = fprop_context.current()
  if not ctx.training or rate == 0:
    return x
  if not 0 <= rate < 1:
    raise base_layer.LayerError(
        f'{seed_key}: dropout rate must be in [0, 1), got {rate}; set the '
        'layer\'s dropout rate param to the fraction of units to drop.')
  x = tf.convert_to_tensor(x)
  shape = _dim_list(x)
  noise_shape = list(noise_shape_fn(shape) if noise_shape_fn else shape)
  seed = mask_seed(seed_key, ctx.step)
  if not _shared_over_batch(shape[0], noise_shape[0]):
    micro = ctx.batch_dim or noise_shape[0]
    if (isinstance(shape[0], int) and ctx.batch_dim and
        ctx.batch_dim != shape[0]):
      raise base_layer.LayerError(
          f'{seed_key}: the context says micro-batches have batch_dim='
          f'{ctx.batch_dim} examples but x has {shape[0]} (shape {shape}); '
          'open the fprop_context.scope with batch_dim = x.shape[0].')
    total = micro * ctx.num_micro_batches
    # [B_total, ...]: one mask row per example of the mini-batch.
    uniform = tf.random.stateless_uniform([total] + noise_shape[1:],
                                          seed)
    start = tf.cast(ctx.micro_batch_index, tf.int32) * micro
    uniform = uniform[start:start + micro]  # [b, ...]: this micro-batch.
  else:
    uniform = tf.random.stateless_uniform(noise_shape, seed)
  # Drawn in float32 whatever x's dtype, so the mask is the same in bfloat16.
  keep = tf.cast(uniform >= rate, x.dtype)
  return x * keep * tf.cast(1.0 / (1.0 - rate), x.dtype)


def _shared_over_batch(batch: Any, noise_batch: Any) -> bool:
  """True if noise_shape_fn asked for one mask shared by every example."""
  def _is_one(d: Any) -> bool:
    return isinstance(d, int) and d == 1

  # With a batch of 1 a leading 1 is ambiguous; per-example is the safe
  # reading (the mask still depends on the example's global index).
  return _is_one(noise_batch) and not _is_one(batch)


class DropoutLayer(base_layer.BaseLayer):
  """Dropout as a layer; the mask is keyed by the layer's path.

  >>> p = DropoutLayer.Params().Set(name='drop', dropout_rate=0.1)
  >>> layer = p.Instantiate()
  >>> y = layer.FProp(layer.theta, tf.ones([2, 3]))  # identity in eval
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('dropout_rate', 0.0, 'Fraction of elements dropped in training, '
             'in [0, 1); 0 disables dropout.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_rate(self.path, self.params.dropout_rate)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    """Returns x with dropout applied in a training context."""
    del theta  # No variables.
    x = tf.cast(x, self.fprop_dtype)
    return apply_dropout(x, self.params.dropout_rate, self.path)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_rate(p.name, p.dropout_rate)
    return base_layer.LayerMeta.build(
        p, flops=shape_lib.num_elements(x), out_shapes=(x,), num_params=0)


def _check_rate(where: str, rate: float) -> None:
  if not 0 <= rate < 1:
    raise base_layer.LayerError(
        f'{where}: dropout_rate must be in [0, 1), got {rate}; set '
        'p.dropout_rate to the fraction of elements to drop (e.g. 0.1).')
