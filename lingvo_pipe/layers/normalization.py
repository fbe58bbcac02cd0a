"""Batch and layer normalisation, with BatchNorm built for micro-batching.

BatchNorm keeps moving averages of the batch mean and variance. Under GPipe a
mini-batch of N examples runs as M micro-batches of N/M, possibly on
different devices, and every stage's forward pass runs again in the backward
pass (recomputation). Updating the moving averages inside FProp would update
them M times per step — or 2M times with recomputation — each from a
fraction of the batch. So FProp only *reports* sufficient statistics
(count, Σx, Σx²) to the context's `StatsCollector` (the recompute pass has
none); the pipeline sums them over micro-batches and the trainer calls
`FoldStats` once per step, which turns the sums into the statistics of the
whole mini-batch and moves the averages once:

    mean = Σx / count;  var = Σx² / count − mean²      (population variance)
    moving = decay · moving + (1 − decay) · batch

`var = E[x²] − E[x]²` cancels catastrophically in float32 when |mean| ≫ std
and the sums run over many micro-batches, so the sums are accumulated in
`p.stats_dtype` (float64 by default; set float32 on hardware without
float64). Only the reported sums use it: normalisation itself uses the
micro-batch's moments in the compute dtype, and the sums are computed only
when a collector listens (never in the recompute) and carry no gradient.

In training each micro-batch is normalised by its *own* statistics (as in
GPipe); only the moving averages see the whole mini-batch.

Cost convention (FPropMeta): normalisation counts 1 flop per element.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import shape as shape_lib

_ONES = base_layer.WeightInit.Constant(1.0)
_ZEROS = base_layer.WeightInit.Constant(0.0)


def _check_input(where: str, x_shape: tf.TensorShape, dim: int,
                 key: str) -> None:
  if x_shape.rank is not None and (x_shape.rank < 1 or
                                   x_shape[-1] not in (None, dim)):
    raise base_layer.LayerError(
        f'{where}: input last dim must equal {key}={dim}, got input shape '
        f'{x_shape}; set p.{key} to the number of channels of the input.')


def _check_positive(where: str, p: Params, key: str) -> None:
  value = getattr(p, key)
  if not isinstance(value, (int, float)) or value <= 0:
    raise base_layer.LayerError(
        f'{where}: {key} must be > 0, got {value!r}; set p.{key}.')


class BatchNormLayer(base_layer.BaseLayer):
  """BatchNorm over all dims but the last, with once-per-step stat folding.

  Training step, in pseudo-code:

      with fprop_context.scope(training=True, stats=collector):
        for each micro-batch: y = bn.FProp(bn.theta, x)  # adds count/sum/sum_sq
      bn.FoldStats(collector.stats[bn.path])              # moves the averages
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('dim', 0, 'Number of channels (the last dimension of the input).')
    p.Define('decay', 0.99, 'Moving-average decay per training step, in '
             '[0, 1); 0.99 averages over roughly the last 100 steps.')
    p.Define('epsilon', 1e-3, 'Added to the variance before the rsqrt.')
    p.Define('stats_dtype', tf.float64, 'Dtype of the summed statistics; '
             'float64 keeps E[x²]−E[x]² accurate (see module docstring).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_batch_norm_params(self.path, self.params)
    dim = self.params.dim
    self.CreateVariable('beta', base_layer.WeightParams([dim], _ZEROS))
    self.CreateVariable('gamma', base_layer.WeightParams([dim], _ONES))
    self.CreateVariable('moving_mean', base_layer.WeightParams(
        [dim], _ZEROS, trainable=False))
    self.CreateVariable('moving_variance', base_layer.WeightParams(
        [dim], _ONES, trainable=False))

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    """[..., dim] → [..., dim]; in training also adds sufficient stats."""
    p = self.params
    dtype = self.fprop_dtype
    x = tf.cast(x, dtype)
    _check_input(self.path, x.shape, p.dim, 'dim')
    ctx = fprop_context.current()
    if ctx.training:
      # Normalise by this micro-batch's moments in the compute dtype (the
      # gradient flows through them); report the sums for the moving
      # averages in stats_dtype, off the gradient path and only when a
      # collector listens (not during the pipeline's recompute).
      axes = list(range(x.shape.rank - 1))
      mean, variance = tf.nn.moments(x, axes)
      if ctx.stats is not None:
        self.AddStats(tf.nest.map_structure(
            tf.stop_gradient, sufficient_stats(x, p.stats_dtype)))
    else:
      mean, variance = theta.moving_mean, theta.moving_variance
    mean, variance = tf.cast(mean, dtype), tf.cast(variance, dtype)
    scale = tf.math.rsqrt(variance + p.epsilon) * tf.cast(theta.gamma, dtype)
    return (x - mean) * scale + tf.cast(theta.beta, dtype)

  def FoldStats(self, stats: NestedMap) -> list[tf.Operation]:
    """Moves the averages once towards the statistics summed in `stats`.

    Args:
      stats: NestedMap(count, sum, sum_sq) summed over the step's
        micro-batches (what FProp added to the StatsCollector).

    Returns:
      The two assign ops (the updated variables in eager mode).
    """
    return move_averages(stats, self.vars.moving_mean,
                         self.vars.moving_variance, self.params.decay)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_batch_norm_params(p.name, p)
    x = tf.TensorShape(x)
    _check_input(p.name, x, p.dim, 'dim')
    return base_layer.LayerMeta.build(
        p, flops=shape_lib.num_elements(x), out_shapes=(x,),
        num_params=4 * p.dim)


def _check_batch_norm_params(where: str, p: Params) -> None:
  _check_positive(where, p, 'dim')
  _check_positive(where, p, 'epsilon')
  if not 0 <= p.decay < 1:
    raise base_layer.LayerError(
        f'{where}: decay must be in [0, 1), got {p.decay}; e.g. 0.99.')


def sufficient_stats(x: tf.Tensor, dtype: tf.DType,
                     axis: int = -1) -> NestedMap:
  """count (scalar), Σx and Σx² ([C]) over all dims but `axis` (the
  channels)."""
  xs = tf.cast(x, dtype)
  axis %= x.shape.rank
  axes = [i for i in range(x.shape.rank) if i != axis]
  count = tf.cast(tf.size(x, out_type=tf.int64) //
                  tf.shape(x, out_type=tf.int64)[axis], dtype)
  return NestedMap(count=count, sum=tf.reduce_sum(xs, axes),
                   sum_sq=tf.reduce_sum(tf.square(xs), axes))


def mean_variance(count: tf.Tensor, total: tf.Tensor,
                  total_sq: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """Mean and population variance from count, Σx and Σx²."""
  mean = total / count
  return mean, tf.maximum(total_sq / count - tf.square(mean), 0.0)


def move_averages(stats: NestedMap, moving_mean: tf.Variable,
                  moving_variance: tf.Variable,
                  decay: float) -> list[tf.Operation]:
  """moving = decay · moving + (1 − decay) · batch, for the mean and the
  variance of the step's summed `stats` (count, sum, sum_sq); the two
  assign ops (the updated variables in eager mode)."""
  mean, variance = mean_variance(stats.count, stats.sum, stats.sum_sq)
  ops = []
  for var, batch in ((moving_mean, mean), (moving_variance, variance)):
    batch = tf.cast(batch, var.dtype)
    ops.append(var.assign(decay * var + (1.0 - decay) * batch))
  return ops


class LayerNormLayer(base_layer.BaseLayer):
  """Normalises each position over its last dim: (x − μ)/σ · scale + bias.

  Statistics are per example, so micro-batching changes nothing. Inputs in
  bfloat16/float16 are normalised in float32.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (its last dimension).')
    p.Define('epsilon', 1e-6, 'Added to the variance before the rsqrt.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_positive(self.path, self.params, 'input_dim')
    _check_positive(self.path, self.params, 'epsilon')
    dim = self.params.input_dim
    self.CreateVariable('scale', base_layer.WeightParams([dim], _ONES))
    self.CreateVariable('bias', base_layer.WeightParams([dim], _ZEROS))

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    """[..., input_dim] → [..., input_dim]."""
    dtype = self.fprop_dtype
    compute = tf.float32 if dtype in (tf.bfloat16, tf.float16) else dtype
    x = tf.cast(x, compute)
    _check_input(self.path, x.shape, self.params.input_dim, 'input_dim')
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    y = (x - mean) * tf.math.rsqrt(variance + self.params.epsilon)
    y = y * tf.cast(theta.scale, compute) + tf.cast(theta.bias, compute)
    return tf.cast(y, dtype)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_positive(p.name, p, 'input_dim')
    x = tf.TensorShape(x)
    _check_input(p.name, x, p.input_dim, 'input_dim')
    return base_layer.LayerMeta.build(
        p, flops=shape_lib.num_elements(x), out_shapes=(x,),
        num_params=2 * p.input_dim)
