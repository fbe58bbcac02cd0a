"""SoftmaxLayer and label-smoothed cross-entropy against float64 numpy."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import softmax


def _numpy_xent(logits, ids, eps):
  """-Σ target·log_softmax with target 1-ε on the label, ε/(V-1) elsewhere."""
  logits = logits.astype(np.float64)
  v = logits.shape[-1]
  shifted = logits - logits.max(-1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  target = np.full(logits.shape, eps / (v - 1))
  np.put_along_axis(target, ids[..., None], 1.0 - eps, axis=-1)
  return -(target * log_p).sum(-1)


@pytest.mark.parametrize('eps', [0.0, 0.1, 0.4])
def test_xent_matches_numpy(eps):
  logits = np.random.normal(scale=3.0, size=[3, 4, 11]).astype(np.float32)
  ids = np.random.randint(0, 11, size=[3, 4])
  got = softmax.softmax_cross_entropy(logits, ids, label_smoothing=eps)
  assert got.dtype == tf.float32
  np.testing.assert_allclose(got.numpy(), _numpy_xent(logits, ids, eps),
                             rtol=1e-5, atol=1e-5)


def test_weights_and_mean_helper():
  logits = np.random.normal(size=[2, 5, 6]).astype(np.float32)
  ids = np.random.randint(0, 6, size=[2, 5])
  weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
  per_pos = _numpy_xent(logits, ids, 0.1)
  got = softmax.softmax_cross_entropy(logits, ids, 0.1, weights)
  np.testing.assert_allclose(got.numpy(), per_pos * weights, rtol=1e-5)
  mean, total = softmax.mean_softmax_cross_entropy(logits, ids, weights, 0.1)
  np.testing.assert_allclose(mean.numpy(),
                             (per_pos * weights).sum() / weights.sum(),
                             rtol=1e-5)
  assert total.numpy() == 8.0
  mean, total = softmax.mean_softmax_cross_entropy(logits, ids,
                                                   np.zeros_like(weights))
  assert mean.numpy() == 0.0 and total.numpy() == 0.0  # No NaN.


def test_bfloat16_logits_give_float32_loss():
  logits = tf.cast(tf.random.normal([2, 3, 5]), tf.bfloat16)
  got = softmax.softmax_cross_entropy(logits, tf.zeros([2, 3], tf.int32), 0.1)
  assert got.dtype == tf.float32 and np.all(np.isfinite(got.numpy()))


def test_bad_smoothing_is_rejected():
  with pytest.raises(base_layer.LayerError, match='label_smoothing .* 1.0'):
    softmax.softmax_cross_entropy(tf.zeros([1, 3]), tf.zeros([1], tf.int32),
                                  label_smoothing=1.0)


def _layer(**kwargs):
  p = softmax.SoftmaxLayer.Params().Set(name='softmax', input_dim=4,
                                        num_classes=9, **kwargs)
  layer = p.Instantiate()
  if 'b' in layer.vars:
    layer.vars.b.assign(np.random.normal(size=[9]))
  return layer


def test_logits_match_numpy():
  layer = _layer()
  x = np.random.normal(size=[2, 3, 4])
  want = x @ layer.theta.w.numpy() + layer.theta.b.numpy()
  np.testing.assert_allclose(layer.FProp(layer.theta, x).numpy(), want,
                             rtol=1e-5, atol=1e-5)


def test_logit_clipping_caps_values():
  layer = _layer(logits_abs_max=0.5)
  x = 10.0 * np.random.normal(size=[4, 4])
  logits = layer.FProp(layer.theta, x).numpy()
  unclipped = x @ layer.theta.w.numpy() + layer.theta.b.numpy()
  assert np.abs(unclipped).max() > 0.5  # The test exercises clipping.
  np.testing.assert_allclose(logits, np.clip(unclipped, -0.5, 0.5),
                             rtol=1e-5, atol=1e-5)


def test_meta_and_errors():
  p = _layer(has_bias=False).params.Copy()
  meta = softmax.SoftmaxLayer.FPropMeta(p, tf.TensorShape([2, 3, 4]))
  assert meta.out_shapes == (tf.TensorShape([2, 3, 9]),)
  assert meta.flops == 2 * 6 * 4 * 9
  assert meta.param_bytes == 4 * 9 * 4
  with pytest.raises(base_layer.LayerError, match='softmax: input last dim 5'):
    _layer().FProp(_layer().theta, tf.zeros([2, 5]))
  with pytest.raises(base_layer.LayerError, match='softmax: num_classes'):
    p.Copy().Set(num_classes=0).Instantiate()
