"""BatchNorm (train/eval, stat folding over micro-batches) and LayerNorm."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import sequential

_EPS = 1e-3


def _bn(dim=3, **kwargs):
  p = normalization.BatchNormLayer.Params().Set(name='bn', dim=dim,
                                                epsilon=_EPS, **kwargs)
  layer = p.Instantiate()
  layer.vars.gamma.assign(np.linspace(0.5, 2.0, dim))
  layer.vars.beta.assign(np.linspace(-1.0, 1.0, dim))
  return layer


def _normalise(x, mean, var, layer):
  gamma, beta = (v.numpy().astype(np.float64) for v in (layer.vars.gamma,
                                                         layer.vars.beta))
  return (x - mean) / np.sqrt(var + _EPS) * gamma + beta


def _train(layer, x, collector=None):
  with fprop_context.scope(training=True, stats=collector):
    return layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()


def test_training_normalises_by_batch_statistics_and_reports_them():
  layer = _bn()
  x = np.random.randn(4, 5, 6, 3) * 3 + 2
  collector = fprop_context.StatsCollector()
  got = _train(layer, x, collector)
  axes = (0, 1, 2)
  want = _normalise(x, x.mean(axes), x.var(axes), layer)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  stats = collector.stats['bn']
  assert stats.count.numpy() == 4 * 5 * 6
  np.testing.assert_allclose(stats.sum.numpy(), x.astype(np.float32).astype(
      np.float64).sum(axes), rtol=1e-10)
  np.testing.assert_allclose(stats.sum_sq.numpy(), (x.astype(
      np.float32).astype(np.float64) ** 2).sum(axes), rtol=1e-10)


def test_eval_uses_moving_statistics_and_adds_no_stats():
  layer = _bn()
  layer.vars.moving_mean.assign([1.0, -2.0, 0.5])
  layer.vars.moving_variance.assign([4.0, 0.25, 1.0])
  x = np.random.randn(6, 3)
  collector = fprop_context.StatsCollector()
  with fprop_context.scope(stats=collector):
    got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  want = _normalise(x, np.array([1.0, -2.0, 0.5]), np.array([4.0, 0.25, 1.0]),
                    layer)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not collector.stats


def test_fold_stats_moves_the_averages_once():
  layer = _bn(decay=0.9)
  x = np.random.randn(8, 3) + 5
  collector = fprop_context.StatsCollector()
  _train(layer, x, collector)
  layer.FoldStats(collector.stats['bn'])
  x32 = x.astype(np.float32).astype(np.float64)
  np.testing.assert_allclose(layer.vars.moving_mean.numpy(),
                             0.1 * x32.mean(0), rtol=1e-6)
  np.testing.assert_allclose(layer.vars.moving_variance.numpy(),
                             0.9 + 0.1 * x32.var(0), rtol=1e-6)


@pytest.mark.parametrize('k', [2, 4])
def test_k_micro_batches_fold_like_one_batch_of_their_union(k):
  # Far-from-zero mean and small spread: E[x²] − E[x]² in float32 would lose
  # most digits here; the float64 sums must not.
  x = (np.random.randn(16, 2, 3) * 0.1 + 1000.0).astype(np.float32)
  whole, micro = _bn(decay=0.5), _bn(decay=0.5)
  collector = fprop_context.StatsCollector()
  _train(whole, x, collector)
  whole.FoldStats(collector.stats['bn'])
  collector = fprop_context.StatsCollector()
  for part in np.split(x, k):
    _train(micro, part, collector)
  assert collector.stats['bn'].count.numpy() == 32
  micro.FoldStats(collector.stats['bn'])
  x64 = x.astype(np.float64)
  for name, want in (('moving_mean', 0.5 * x64.mean((0, 1))),
                     ('moving_variance', 0.5 + 0.5 * x64.var((0, 1)))):
    np.testing.assert_allclose(micro.vars[name].numpy(),
                               whole.vars[name].numpy(), rtol=1e-6)
    np.testing.assert_allclose(micro.vars[name].numpy(), want, rtol=1e-5)


def test_update_stats_reaches_a_nested_batch_norm():
  bn = normalization.BatchNormLayer.Params().Set(dim=2, decay=0.0)
  stack = sequential.SequentialLayer.Params().Set(
      name='model', sub=[bn]).Instantiate()
  x = np.random.randn(5, 2)
  collector = fprop_context.StatsCollector()
  with fprop_context.scope(training=True, stats=collector):
    stack.FProp(stack.theta, tf.constant(x, tf.float32))
  assert list(collector.stats) == ['model.sub[0]']
  stack.UpdateStats(collector.stats)
  np.testing.assert_allclose(
      stack.children.sub[0].vars.moving_mean.numpy(), x.mean(0), rtol=1e-5)


def test_batch_norm_gradients_flow_to_gamma_beta_and_input():
  layer = _bn()
  x = tf.constant(np.random.randn(4, 3), tf.float32)
  with tf.GradientTape() as tape:
    tape.watch(x)
    with fprop_context.scope(training=True):
      y = layer.FProp(layer.theta, x)
    loss = tf.reduce_sum(y * tf.range(12.0, dtype=tf.float32)[:, None][:4])
  grads = tape.gradient(loss, [x, layer.vars.gamma, layer.vars.beta])
  assert all(g is not None and np.isfinite(g.numpy()).all() for g in grads)


def test_layer_norm_matches_numpy():
  p = normalization.LayerNormLayer.Params().Set(name='ln', input_dim=6)
  layer = p.Instantiate()
  layer.vars.scale.assign(np.linspace(0.5, 1.5, 6))
  layer.vars.bias.assign(np.linspace(-1, 1, 6))
  x = np.random.randn(2, 3, 6) * 4 + 1
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  want = (x - mean) / np.sqrt(var + 1e-6) * np.linspace(0.5, 1.5, 6) + \
      np.linspace(-1, 1, 6)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  half = p.Copy().Set(fprop_dtype=tf.bfloat16).Instantiate()
  assert half.FProp(half.theta, tf.ones([2, 6])).dtype == tf.bfloat16


def test_errors_name_the_layer_and_param():
  with pytest.raises(base_layer.LayerError,
                     match=r'bn: input last dim must equal dim=3'):
    layer = _bn()
    layer.FProp(layer.theta, tf.ones([2, 4]))
  with pytest.raises(base_layer.LayerError, match='bn: decay must be in'):
    _bn(decay=1.5)
  with pytest.raises(base_layer.LayerError, match='ln: input_dim must be > 0'):
    normalization.LayerNormLayer.Params().Set(name='ln').Instantiate()
  p = normalization.LayerNormLayer.Params().Set(name='ln', input_dim=4)
  with pytest.raises(base_layer.LayerError, match='input_dim=4'):
    normalization.LayerNormLayer.FPropMeta(p, tf.TensorShape([2, 5]))
