"""The three test networks every transparency test runs, and their references.

conv+BN (BatchNorm statistics, dropout), a Transformer stack carrying
(x, paddings) across stages, and a NestedMap skip connection carried past
several stages; `reference` runs the same layer objects one after another
under a plain tape, micro-batch by micro-batch.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import conv
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import pooling
from lingvo_pipe.layers import shape
from lingvo_pipe.layers import transformer
from lingvo_pipe.pipeline import transparency

DEVICES = [f'/device:CPU:{k}' for k in range(4)]
BATCH = 8
POLICIES = ('always', 'needed', 'except_last', 'never')


def conv_bn_stack() -> tuple[list, list, callable]:
  """Conv → BN → Conv → BN → pool → flatten → FC (with dropout)."""
  layers = [
      conv.Conv2DLayer.Params().Set(name='c0', filter_shape=(3, 3, 2, 4),
                                    activation='RELU'),
      normalization.BatchNormLayer.Params().Set(name='bn0', dim=4),
      conv.Conv2DLayer.Params().Set(name='c1', filter_shape=(3, 3, 4, 4),
                                    filter_stride=(2, 2)),
      normalization.BatchNormLayer.Params().Set(name='bn1', dim=4),
      pooling.PoolingLayer.Params().Set(name='pool'),
      shape.FlattenLayer.Params().Set(name='flat'),
      dropout.DropoutLayer.Params().Set(name='drop', dropout_rate=0.3),
      linear.FCLayer.Params().Set(name='fc', input_dim=16, output_dim=3),
  ]
  shapes = [[BATCH, 8, 8, 2]]

  def _inputs(rng):
    return (tf.constant(rng.randn(BATCH, 8, 8, 2).astype(np.float32)),)
  return layers, shapes, _inputs


def transformer_stack() -> tuple[list, list, callable]:
  """Four pre-LN encoder layers carrying (x, paddings) between stages."""
  layers = [transformer.TransformerEncoderLayer.Params().Set(
      name=f'enc{i}', input_dim=8, num_heads=2, hidden_dim=16,
      residual_dropout_prob=0.1) for i in range(4)]
  shapes = [[BATCH, 5, 8], [BATCH, 5]]

  def _inputs(rng):
    x = tf.constant(rng.randn(BATCH, 5, 8).astype(np.float32))
    lengths = rng.randint(1, 6, size=BATCH)
    paddings = (np.arange(5)[None, :] >= lengths[:, None]).astype(np.float32)
    return x, tf.constant(paddings)
  return layers, shapes, _inputs


class _Fork(base_layer.BaseLayer):
  """x → NestedMap(x=fc(x), skip=x): a skip tensor that crosses stages."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Depth.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('fc', linear.FCLayer.Params().Set(
        input_dim=self.params.dim, output_dim=self.params.dim,
        activation='TANH'))

  def FProp(self, theta, x):
    x = tf.cast(x, self.fprop_dtype)  # As library layers do.
    return NestedMap(x=self.children.fc.FProp(theta.fc, x), skip=x)

  @classmethod
  def FPropMeta(cls, p, x):
    return base_layer.LayerMeta.build(
        p, flops=2 * x.num_elements() * p.dim, out_shapes=(
            NestedMap(x=x, skip=x),), num_params=p.dim * p.dim + p.dim)


class _Carry(_Fork):
  """NestedMap(x, skip) → NestedMap(fc(x), skip): passes the skip on."""

  def FProp(self, theta, m):
    return NestedMap(x=self.children.fc.FProp(theta.fc, m.x), skip=m.skip)

  @classmethod
  def FPropMeta(cls, p, m):
    return base_layer.LayerMeta.build(
        p, flops=2 * m.x.num_elements() * p.dim, out_shapes=(m,),
        num_params=p.dim * p.dim + p.dim)


class _Join(_Fork):
  """NestedMap(x, skip) → fc(x) + skip."""

  def FProp(self, theta, m):
    return self.children.fc.FProp(theta.fc, m.x) + m.skip

  @classmethod
  def FPropMeta(cls, p, m):
    return base_layer.LayerMeta.build(
        p, flops=2 * m.x.num_elements() * p.dim, out_shapes=(m.x,),
        num_params=p.dim * p.dim + p.dim)


def nested_stack() -> tuple[list, list, callable]:
  layers = ([_Fork.Params().Set(name='fork')] +
            [_Carry.Params().Set(name=f'carry{i}') for i in range(4)] +
            [_Join.Params().Set(name='join')])

  def _inputs(rng):
    return (tf.constant(rng.randn(BATCH, 4).astype(np.float32)),)
  return layers, [[BATCH, 4]], _inputs


MODELS = {'conv_bn': conv_bn_stack, 'transformer': transformer_stack,
          'nested': nested_stack}


def net(model: str, **kw) -> tuple[gpipe.PipeliningLayer, tuple]:
  layers, shapes, make_inputs = MODELS[model]()
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, input_shapes=shapes, devices=DEVICES, **kw)
  return p.Instantiate(), make_inputs(np.random.RandomState(1))


def float64_twin(net: gpipe.PipeliningLayer) -> gpipe.PipeliningLayer:
  """The same layers and paths computing in float64 (run on net.theta)."""
  p = net.params.Copy().Set(
      layers=transparency.float64_layer_params(list(net.params.layers)),
      num_stages=1, split_points=None, schedule='gpipe')
  return p.Instantiate()


def square_loss(out) -> tf.Tensor:
  x = out[0] if isinstance(out, tuple) else out
  w = tf.cast(tf.range(tf.size(x[0])) % 5 - 2, x.dtype)  # Fixed projection.
  per_example = tf.reduce_sum(tf.reshape(x, [BATCH, -1]) * w, 1) + tf.reduce_sum(
      tf.reshape(x, [BATCH, -1])**2, 1)
  return tf.reduce_sum(per_example) / BATCH


def pipelined(net, inputs, step=7):
  collector = fprop_context.StatsCollector()
  with tf.GradientTape() as tape:
    with fprop_context.scope(training=True, step=step, stats=collector):
      out = net.FProp(net.theta, *inputs)
    value = square_loss(out)
  grads = tape.gradient(value, net.theta)
  return value, out, grads, collector.stats


def reference(net, inputs, num_micro_batches, step=7, layers=None):
  """Plain autodiff over the same layers, micro-batch by micro-batch.

  `layers` (default net's) run on net.theta: a float64 twin's, say.
  """
  layers = layers or net.children.layers
  collector = fprop_context.StatsCollector()
  m = num_micro_batches
  micro = [tf.split(x, m) for x in inputs]
  outs = []
  with tf.GradientTape() as tape:
    for i in range(m):
      x = tuple(parts[i] for parts in micro)
      with fprop_context.scope(training=True, step=step, micro_batch_index=i,
                               num_micro_batches=m, stats=collector,
                               first_example=i * BATCH // m,
                               global_batch_size=BATCH):
        for layer, theta in zip(layers, net.theta.layers):
          out = layer.FProp(theta, *x)
          x = out if isinstance(out, tuple) else (out,)
      outs.append(x)
    out = tuple(tf.concat(list(parts), 0) for parts in zip(*outs))
    out = out[0] if len(out) == 1 else out
    value = square_loss(out)
  return value, out, tape.gradient(value, net.theta), collector.stats


def loss_reference(model: str, num_micro_batches: int) -> tuple:
  """(float32, float64) references of the FPropLoss step: loss, gradients,
  statistics (sorted by path) of plain autodiff, micro-batch by
  micro-batch; they do not depend on K, the schedule or the policy."""
  pipe, inputs = net(model, num_stages=1,
                     num_micro_batches=num_micro_batches)
  labels = loss_labels(model)
  out = []
  for layers in (pipe.children.layers, float64_twin(pipe).children.layers):
    with tf.GradientTape() as tape:
      _, y, _, stats = reference(pipe, inputs, num_micro_batches,
                                 layers=layers)
      loss = weighted_loss(y, labels)['loss'][0]
    grads = tape.gradient(loss, pipe.theta)
    out.append((loss, grads, [stats[k] for k in sorted(stats)]))
  return tuple(out)


def pipelined_loss(net, inputs, labels):
  """Loss, gradients and statistics (sorted by path) of one FPropLoss step."""
  collector = fprop_context.StatsCollector()
  with tf.GradientTape() as tape:
    with fprop_context.scope(training=True, step=7, stats=collector):
      metrics = net.FPropLoss(net.theta, inputs, labels, weighted_loss)
  grads = tape.gradient(metrics['loss'][0], net.theta)
  stats = collector.stats
  return metrics['loss'][0], grads, [stats[k] for k in sorted(stats)]


def max_rel_diff(a, b) -> float:
  return transparency.max_rel_diff(a, b)[0]


def loss_labels(model: str) -> NestedMap:
  """Loss weights: per example, or per token (the Transformer's paddings)."""
  rng = np.random.RandomState(5)
  if model == 'transformer':
    _, paddings = MODELS[model]()[2](np.random.RandomState(1))
    return NestedMap(w=1.0 - paddings)
  return NestedMap(w=tf.constant(rng.uniform(0.5, 2.0, BATCH), tf.float32))


def weighted_loss(outputs, labels):
  """A weighted mean over examples (or tokens); 'abs_mean' sorts first."""
  x = outputs[0] if isinstance(outputs, tuple) else outputs
  w = tf.cast(labels.w, x.dtype)
  if w.shape.rank == 2:  # [B, T] token weights of [B, T, D] outputs.
    per = tf.reduce_sum(tf.square(x) + x, axis=-1)
  else:
    per = tf.reduce_sum(tf.reshape(tf.square(x) + x, [tf.shape(x)[0], -1]),
                        axis=1)
  total = tf.reduce_sum(w)
  return {'loss': (tf.reduce_sum(per * w) / total, total),
          'abs_mean': (tf.reduce_mean(tf.abs(x)), tf.cast(tf.size(x),
                                                          x.dtype))}
