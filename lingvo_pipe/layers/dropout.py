"""Dropout whose mask survives pipelining: one helper and one layer.

GPipe runs each stage's forward pass twice — once per micro-batch in the
forward sweep, and again (recomputation) just before that micro-batch's
gradient arrives. A dropout mask drawn from a stateful RNG would differ
between the two passes and the gradient would belong to a different function
than the loss. So the mask here is a *pure function* of

  * `seed_key` (callers pass their layer path plus a suffix),
  * the training step `ctx.step`, and
  * the example's global index in the mini-batch.

`apply_dropout`'s mask is, by definition, the rows of this call's examples
(from `ctx.first_example` on, along `ctx.batch_axis`: 1 for time-major
inputs) of one stateless uniform draw for the whole global batch
(`ctx.global_batch_size` examples, every micro-batch of every data-parallel
replica). An example therefore gets the same mask however the batch is cut
into micro-batches or replicas and however many stages there are, and the
recompute pass reproduces the forward mask exactly.

Only those rows are drawn. TF's stateless draws are Philox (what its
'auto_select' algorithm is), a counter-based generator: float element e of
a draw comes from counter + e // 4. So the rows of examples start … start +
n are a draw of n rows from the counter advanced by start × (elements per
row) // 4, less the first (start × row) % 4 elements — bit for bit the
slice of the global draw (tests/layers/test_dropout.py), at 1/(M·R) of its
cost. Drawing the global batch and slicing it made each call pay for all
M·R micro-batches. In one traced step Grappler merges those identical
draws, but a step recorded op by op (--timeline_steps) paid them in every
forward: with M=8 the translation model's recorded forwards took 2–3× its
layers' own time.

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
    x: activations of this micro-batch, batch on `ctx.batch_axis`.
    rate: probability of dropping an element, in [0, 1).
    seed_key: stable name of the call site, e.g. `f'{self.path}/attention'`.
      Different keys give independent masks.
    noise_shape_fn: optional `fn(shape) -> noise_shape` mapping x's shape (a
      list of ints, or scalar tensors for unknown dims) to the mask's shape
      for this micro-batch, e.g. `lambda s: [s[0], 1, s[2]]` to share the
      mask over time. Its entry on the batch axis must be the batch or 1.

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
  uniform = example_noise(x, seed_key, tf.random.stateless_uniform,
                          noise_shape_fn)
  # Drawn in float32 whatever x's dtype, so the mask is the same in bfloat16.
  keep = tf.cast(uniform >= rate, x.dtype)
  return x * keep * tf.cast(1.0 / (1.0 - rate), x.dtype)


Sampler = Callable[[Sequence[Any], tf.Tensor], tf.Tensor]


def example_noise(x: tf.Tensor, seed_key: str, sampler: Sampler,
                  noise_shape_fn: NoiseShapeFn | None = None) -> tf.Tensor:
  """Noise for this call's examples: a pure function of (key, step, example).

  Draws `sampler(shape, seed)` (float32; e.g. `tf.random.stateless_uniform`
  or `stateless_normal`) for the whole global batch, one row per example,
  and returns the rows of this call's examples, shaped like the noise shape
  (see `apply_dropout`) with the batch on `ctx.batch_axis`. Noise layers
  other than dropout (Gaussian noise) draw through it too.
  """
  ctx = fprop_context.current()
  shape = _dim_list(x)
  noise_shape = list(noise_shape_fn(shape) if noise_shape_fn else shape)
  seed = mask_seed(seed_key, ctx.step)
  axis = ctx.batch_axis
  if not 0 <= axis < len(shape):
    raise base_layer.LayerError(
        f'{seed_key}: the context says the batch is on axis {axis} but x has '
        f'shape {shape}; set the pipeline\'s batch_dim to the batch axis.')
  if _shared_over_batch(shape[axis], noise_shape[axis]):
    return sampler(noise_shape, seed)
  # [B_global, ...]: one noise row per example of the global batch, batch
  # first (whatever the layout); then this call's rows, moved back to the
  # batch axis.
  rest = noise_shape[:axis] + noise_shape[axis + 1:]
  num_rows = noise_shape[axis]
  draw = _COUNTER_BASED.get(sampler)
  if draw is None:  # Another sampler: draw every row, keep this call's.
    total = (num_rows if ctx.global_batch_size is None else
             ctx.global_batch_size)
    start = tf.cast(ctx.first_example, tf.int32)
    noise = sampler([total] + rest, seed)[start:start + num_rows]
  else:
    noise = _rows(draw, seed, ctx.first_example, num_rows, rest)
  if axis:
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, len(shape)))
    noise = tf.transpose(noise, perm)
  return noise


# Samplers whose draws are Philox streams (the module doc), and their raw
# ops: the draw is `rnd * (max - min) + min` or `rnd * stddev + mean` with
# the defaults 1 and 0, so the raw op's values are the sampler's exactly.
_COUNTER_BASED: dict[Any, Callable[..., tf.Tensor]] = {
    tf.random.stateless_uniform: tf.raw_ops.StatelessRandomUniformV2,
    tf.random.stateless_normal: tf.raw_ops.StatelessRandomNormalV2,
}


def _rows(draw: Callable[..., tf.Tensor], seed: tf.Tensor, first: Any,
          num_rows: Any, rest: list[Any]) -> tf.Tensor:
  """Rows first … first + num_rows of `draw`'s [*, *rest] draw from `seed`,
  drawing only those (the module doc says why this is exact)."""
  key, counter, alg = tf.raw_ops.StatelessRandomGetKeyCounterAlg(seed=seed)
  row = tf.constant(1, tf.int64)
  for d in rest:
    row *= tf.cast(d, tf.int64)
  offset = tf.cast(first, tf.int64) * row  # Of this call's first element.
  counter = _advance(counter, offset // 4)
  skip = offset % 4
  size = skip + tf.cast(num_rows, tf.int64) * row
  flat = draw(shape=tf.reshape(size, [1]), key=key, counter=counter, alg=alg,
              dtype=tf.float32)
  return tf.reshape(flat[skip:], [num_rows] + rest)


def _advance(counter: tf.Tensor, groups: tf.Tensor) -> tf.Tensor:
  """A Philox counter ([2] uint64: low, high word of 128 bits) + groups."""
  low = counter[0] + tf.bitcast(tf.cast(groups, tf.int64), tf.uint64)
  carry = tf.cast(low < counter[0], tf.uint64)
  return tf.stack([low, counter[1] + carry])


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
