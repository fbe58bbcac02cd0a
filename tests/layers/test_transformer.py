"""Transformer layers: float64 reference, masks, NaN-safety, decoding."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import transformer

D, N, F = 8, 2, 16


def _params(cls, **kwargs):
  values = dict(name='tr', input_dim=D, num_heads=N, hidden_dim=F)
  values.update(kwargs)
  return cls.Params().Set(**values)


def _randomise(layer):
  """Random values everywhere (biases and norms too) so references see them."""
  for var in layer.trainable_variables:
    var.assign(np.random.normal(scale=0.3, size=var.shape))
  return layer


def _np(theta):
  return tf.nest.map_structure(lambda v: v.numpy().astype(np.float64), theta)


def _np_layer_norm(t, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + 1e-6) * t['scale'] + t['bias']


def _np_attention(t, q_in, kv_in, key_paddings, causal):
  proj = lambda x, n: np.einsum('btd,dnh->btnh', x, t[n + '_w']) + t[n + '_b']
  q, k, v = proj(q_in, 'query'), proj(kv_in, 'key'), proj(kv_in, 'value')
  logits = np.einsum('bqnh,bknh->bnqk', q, k) / np.sqrt(q.shape[-1])
  blocked = np.broadcast_to(key_paddings[:, None, None, :] > 0.5,
                            logits.shape)
  if causal:
    tq, tk = logits.shape[-2:]
    blocked = blocked | (np.arange(tk)[None] > np.arange(tq)[:, None])
  logits = np.where(blocked, -1e30, logits)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ctx = np.einsum('bnqk,bknh->bqnh', probs, v)
  return np.einsum('bqnh,nhd->bqd', ctx, t['post_w']) + t['post_b']


def _np_residual(t, x, fn, pre):
  if pre:
    return x + fn(_np_layer_norm(t['ln'], x))
  return _np_layer_norm(t['ln'], x + fn(x))


def _np_ffn(t, x, pre):
  fn = lambda y: (np.maximum(y @ t['fc_in']['w'] + t['fc_in']['b'], 0) @
                  t['fc_out']['w'] + t['fc_out']['b'])
  return _np_residual(t, x, fn, pre)


def _np_encoder(t, x, paddings, pre):
  a = t['self_atten']
  x = _np_residual(a, x, lambda y: _np_attention(a['atten'], y, y, paddings,
                                                 False), pre)
  return _np_ffn(t['ffn'], x, pre)


def _np_decoder(t, x, paddings, memory, memory_paddings, pre):
  s, c = t['self_atten'], t['cross_atten']
  x = _np_residual(s, x, lambda y: _np_attention(s['atten'], y, y, paddings,
                                                 True), pre)
  x = _np_residual(c, x, lambda y: _np_attention(c['atten'], y, memory,
                                                 memory_paddings, False), pre)
  return _np_ffn(t['ffn'], x, pre)


def _inputs(b=3, t=5, s=4):
  x = np.random.normal(size=[b, t, D])
  paddings = np.zeros([b, t])
  paddings[0, -2:] = 1.0
  paddings[2, :] = 1.0  # A fully padded row.
  memory = np.random.normal(size=[b, s, D])
  memory_paddings = np.zeros([b, s])
  memory_paddings[1, -1:] = 1.0
  memory_paddings[2, :] = 1.0
  return x, paddings, memory, memory_paddings


@pytest.mark.parametrize('pre', [True, False])
def test_encoder_matches_float64_reference(pre):
  layer = _randomise(_params(transformer.TransformerEncoderLayer,
                             pre_layer_norm=pre).Instantiate())
  x, paddings, _, _ = _inputs()
  out, out_paddings = layer.FProp(layer.theta, x.astype(np.float32),
                                  paddings.astype(np.float32))
  want = _np_encoder(_np(layer.theta), x, paddings, pre)
  np.testing.assert_allclose(out.numpy(), want, atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(out_paddings.numpy(), paddings)


@pytest.mark.parametrize('pre', [True, False])
def test_decoder_matches_float64_reference(pre):
  layer = _randomise(_params(transformer.TransformerDecoderLayer,
                             pre_layer_norm=pre).Instantiate())
  inputs = _inputs()
  outs = layer.FProp(layer.theta, *[i.astype(np.float32) for i in inputs])
  assert len(outs) == 4
  want = _np_decoder(_np(layer.theta), *inputs, pre)
  np.testing.assert_allclose(outs[0].numpy(), want, atol=1e-4, rtol=1e-4)
  for got, given in zip(outs[1:], inputs[1:]):
    np.testing.assert_array_equal(got.numpy(), given.astype(np.float32))


@pytest.mark.parametrize('cls', [transformer.TransformerEncoderLayer,
                                 transformer.TransformerDecoderLayer])
@pytest.mark.parametrize('pre', [True, False])
def test_fully_padded_rows_give_no_nan_with_dropout(cls, pre):
  layer = _params(cls, pre_layer_norm=pre, atten_dropout_prob=0.1,
                  residual_dropout_prob=0.1,
                  relu_dropout_prob=0.1).Instantiate()
  x, paddings, memory, memory_paddings = _inputs()
  args = [x, paddings] if cls is transformer.TransformerEncoderLayer else [
      x, paddings, memory, memory_paddings]
  args = [tf.constant(a, tf.float32) for a in args]
  with fprop_context.scope(training=True, step=1, num_micro_batches=1):
    with tf.GradientTape() as tape:
      out = layer.FProp(layer.theta, *args)[0]
      loss = tf.reduce_sum(out ** 2)
  grads = tape.gradient(loss, layer.trainable_variables)
  assert out.shape == (3, 5, D)
  assert np.all(np.isfinite(out.numpy()))
  assert all(np.all(np.isfinite(g.numpy())) for g in grads)


def test_encoder_ignores_padded_positions():
  layer = _randomise(_params(transformer.TransformerEncoderLayer).Instantiate())
  x, paddings, _, _ = _inputs()
  base = layer.FProp(layer.theta, x, paddings)[0].numpy()
  x[0, -2:] = 50.0 * np.random.normal(size=x[0, -2:].shape)
  out = layer.FProp(layer.theta, x, paddings)[0].numpy()
  np.testing.assert_allclose(out[:2, :3], base[:2, :3], atol=1e-5)
  np.testing.assert_allclose(out[1], base[1], atol=1e-5)


@pytest.mark.parametrize('pre', [True, False])
def test_decoder_extend_step_equals_fprop(pre):
  layer = _randomise(_params(transformer.TransformerDecoderLayer,
                             pre_layer_norm=pre).Instantiate())
  x, paddings, memory, memory_paddings = [
      tf.constant(a, tf.float32) for a in _inputs(t=6)]
  full = layer.FProp(layer.theta, x, paddings, memory, memory_paddings)[0]

  @tf.function
  def step(x_t, cache, t):
    return layer.ExtendStep(layer.theta, x_t, memory_paddings, cache, t)

  cache = layer.InitDecodeCache(layer.theta, memory, max_len=6)
  steps = []
  for t in range(6):
    y_t, cache = step(x[:, t:t + 1], cache, tf.constant(t))
    steps.append(y_t)
  steps = tf.concat(steps, axis=1).numpy()
  # Right padding: real positions never see padded (later) ones, so decoding
  # (which knows no target paddings) matches FProp wherever paddings are 0.
  real = paddings.numpy() == 0
  np.testing.assert_allclose(steps[real], full.numpy()[real], atol=1e-5)
  no_pad = layer.FProp(layer.theta, x, tf.zeros_like(paddings), memory,
                       memory_paddings)[0]
  np.testing.assert_allclose(steps, no_pad.numpy(), atol=1e-5)


def test_ffn_init_scale_scales_feed_forward_weights():
  base = _params(transformer.TransformerEncoderLayer).Instantiate()
  small = _params(transformer.TransformerEncoderLayer,
                  ffn_init_scale=0.25).Instantiate()
  for name in ('fc_in', 'fc_out'):
    np.testing.assert_allclose(small.theta.ffn[name].w.numpy(),
                               0.25 * base.theta.ffn[name].w.numpy(),
                               rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(small.theta.self_atten.atten.query_w.numpy(),
                                base.theta.self_atten.atten.query_w.numpy())


@pytest.mark.parametrize('cls,shapes', [
    (transformer.TransformerEncoderLayer, ([2, 5, D], [2, 5])),
    (transformer.TransformerDecoderLayer, ([2, 5, D], [2, 5], [2, 3, D],
                                           [2, 3])),
])
def test_meta_matches_the_layer(cls, shapes):
  p = _params(cls, relu_dropout_prob=0.1)
  layer = p.Instantiate()
  shapes = [tf.TensorShape(s) for s in shapes]
  meta = cls.FPropMeta(p, *shapes)
  outs = layer.FProp(layer.theta, *[tf.zeros(s) for s in shapes])
  assert meta.out_shapes == tuple(o.shape for o in outs)
  assert meta.param_bytes == sum(v.numpy().nbytes
                                 for v in layer.trainable_variables)
  # The matmuls alone: 4·D·D per position per attention, 2·D·F for the FFN.
  num_atten = 1 if cls is transformer.TransformerEncoderLayer else 2
  assert meta.flops > 2 * 2 * 5 * (num_atten * 4 * D * D + 2 * D * F)
  doubled = [tf.TensorShape([2 * s[0]] + s[1:].as_list()) for s in shapes]
  assert cls.FPropMeta(p, *doubled).flops == 2 * meta.flops


def test_errors_name_the_path():
  p = _params(transformer.TransformerEncoderLayer, num_heads=3).Set(
      name='enc')
  with pytest.raises(base_layer.LayerError,
                     match=r'enc\.self_atten\.atten: hidden_dim 8 .* 3'):
    p.Instantiate()
  with pytest.raises(base_layer.LayerError,
                     match=r'enc\.self_atten\.atten: hidden_dim 8 .* 3'):
    transformer.TransformerEncoderLayer.FPropMeta(
        p, tf.TensorShape([2, 5, D]), tf.TensorShape([2, 5]))
  layer = _params(transformer.TransformerEncoderLayer).Instantiate()
  with pytest.raises(base_layer.LayerError, match=r'tr: paddings must be'):
    layer.FProp(layer.theta, tf.zeros([2, 5, D]), tf.zeros([2, 4]))
  with pytest.raises(base_layer.LayerError, match='tr.ffn: hidden_dim'):
    _params(transformer.TransformerEncoderLayer, hidden_dim=0).Instantiate()


def test_causal_layer_does_not_look_ahead():
  """Changing position 3 leaves positions 0..2 of every output unchanged,
  and changes position 3 (the encoder layer, by contrast, looks ahead)."""
  x = tf.constant(np.random.RandomState(0).randn(2, 5, 8), tf.float32)
  y = tf.tensor_scatter_nd_update(x, [[0, 3], [1, 3]], tf.ones([2, 8]))
  paddings = tf.zeros([2, 5])
  for cls, looks_ahead in ((transformer.TransformerCausalLayer, False),
                           (transformer.TransformerEncoderLayer, True)):
    layer = cls.Params().Set(name='l', input_dim=8, num_heads=2,
                             hidden_dim=16).Instantiate()
    a = layer.FProp(layer.theta, x, paddings)[0].numpy()
    b = layer.FProp(layer.theta, y, paddings)[0].numpy()
    assert np.array_equal(a[:, :3], b[:, :3]) != looks_ahead, cls
    assert not np.allclose(a[:, 3], b[:, 3])
