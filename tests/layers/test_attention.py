"""MultiHeadAttention: numpy float64 reference, masks, dropout, decoding."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import attention

D, N, HD = 8, 2, 12


def _layer(**kwargs):
  p = attention.MultiHeadAttention.Params().Set(
      name='atten', input_dim=D, num_heads=N, hidden_dim=HD, **kwargs)
  layer = p.Instantiate()
  # Non-zero biases so the reference checks them too.
  for name, var in layer.vars.items():
    if name.endswith('_b'):
      var.assign(np.random.uniform(-0.5, 0.5, var.shape))
  return layer


def _reference(theta, query, key_value, paddings, causal):
  """float64 numpy multi-head attention."""
  t = {k: v.numpy().astype(np.float64) for k, v in theta.items()}
  q = np.einsum('btd,dnh->btnh', query, t['query_w']) + t['query_b']
  k = np.einsum('btd,dnh->btnh', key_value, t['key_w']) + t['key_b']
  v = np.einsum('btd,dnh->btnh', key_value, t['value_w']) + t['value_b']
  logits = np.einsum('bqnh,bknh->bnqk', q, k) / np.sqrt(q.shape[-1])
  blocked = np.broadcast_to(paddings[:, None, None, :] > 0.5, logits.shape)
  if causal:
    tq, tk = logits.shape[-2:]
    blocked = blocked | (np.arange(tk)[None, :] > np.arange(tq)[:, None])
  logits = np.where(blocked, -1e30, logits)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ctx = np.einsum('bnqk,bknh->bqnh', probs, v)
  return np.einsum('bqnh,nhd->bqd', ctx, t['post_w']) + t['post_b']


def _inputs(b=3, tq=5, tk=5):
  query = np.random.normal(size=[b, tq, D])
  key_value = np.random.normal(size=[b, tk, D])
  paddings = np.zeros([b, tk])
  paddings[0, -2:] = 1.0  # Right padding.
  paddings[1, 0] = 1.0  # A padded key in the middle of the causal window.
  return query, key_value, paddings


@pytest.mark.parametrize('causal', [False, True])
def test_matches_float64_reference(causal):
  layer = _layer(causal=causal)
  query, key_value, paddings = _inputs()
  if causal:
    key_value = query  # Self-attention.
  out = layer.FProp(layer.theta, tf.constant(query, tf.float32),
                    tf.constant(key_value, tf.float32),
                    tf.constant(paddings, tf.float32))
  want = _reference(layer.theta, query, key_value, paddings, causal)
  np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


def test_cross_attention_with_other_key_length():
  layer = _layer()
  query, key_value, paddings = _inputs(tq=3, tk=7)
  out = layer.FProp(layer.theta, query.astype(np.float32),
                    key_value.astype(np.float32), paddings)
  want = _reference(layer.theta, query, key_value, paddings, False)
  np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


def test_causal_output_ignores_the_future():
  layer = _layer(causal=True)
  x = np.random.normal(size=[2, 6, D]).astype(np.float32)
  base = layer.FProp(layer.theta, x, x).numpy()
  for t in range(5):
    changed = x.copy()
    changed[:, t + 1:] = np.random.normal(size=changed[:, t + 1:].shape)
    out = layer.FProp(layer.theta, changed, changed).numpy()
    np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-6)
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_padded_keys_do_not_influence_outputs():
  layer = _layer()
  query, key_value, paddings = _inputs(tk=6)
  paddings[:] = 0.0
  paddings[:, 3:] = 1.0
  base = layer.FProp(layer.theta, query, key_value, paddings).numpy()
  key_value[:, 3:] = 100.0 * np.random.normal(size=key_value[:, 3:].shape)
  out = layer.FProp(layer.theta, query, key_value, paddings).numpy()
  np.testing.assert_allclose(out, base, atol=1e-6)


@pytest.mark.parametrize('dtype', [tf.float32, tf.bfloat16])
def test_fully_padded_rows_give_no_nan(dtype):
  layer = _layer(causal=True, fprop_dtype=dtype)
  x = tf.random.normal([2, 4, D])
  paddings = tf.constant([[1.0] * 4, [0.0, 0.0, 1.0, 1.0]])
  out = layer.FProp(layer.theta, x, x, paddings)
  assert out.dtype == dtype
  assert np.all(np.isfinite(tf.cast(out, tf.float32).numpy()))


def test_atten_dropout_is_deterministic_per_step_and_off_in_eval():
  layer = _layer(atten_dropout_prob=0.5)
  query, key_value, paddings = _inputs()
  run = lambda: layer.FProp(layer.theta, query, key_value, paddings).numpy()
  evaluated = run()
  with fprop_context.scope(training=True, step=3, num_micro_batches=1):
    first, second = run(), run()
  with fprop_context.scope(training=True, step=4, num_micro_batches=1):
    other_step = run()
  np.testing.assert_array_equal(first, second)
  assert not np.allclose(first, evaluated)
  assert not np.allclose(first, other_step)
  want = _reference(layer.theta, query, key_value, paddings, False)
  np.testing.assert_allclose(evaluated, want, atol=1e-5, rtol=1e-5)


def test_extend_step_equals_full_causal_fprop():
  layer = _layer(causal=True)
  x = tf.random.normal([2, 5, D])
  full = layer.FProp(layer.theta, x, x)

  @tf.function
  def step(x_t, cache, t):
    return layer.ExtendStep(layer.theta, x_t, cache, t)

  cache = layer.InitCache(2, 7)  # Longer than needed: the tail stays unused.
  outs = []
  for t in range(5):
    out, cache = step(x[:, t:t + 1], cache, tf.constant(t))
    outs.append(out)
  np.testing.assert_allclose(tf.concat(outs, 1).numpy(), full.numpy(),
                             atol=1e-5)
  assert cache.key.shape == (2, 7, N, HD // N)


def test_attend_to_cached_memory_equals_fprop():
  layer = _layer()
  query, key_value, paddings = _inputs(tq=2, tk=6)
  kv = layer.ProjectKeyValue(layer.theta, key_value)
  np.testing.assert_allclose(
      layer.AttendTo(layer.theta, query, kv, paddings).numpy(),
      layer.FProp(layer.theta, query, key_value, paddings).numpy(),
      atol=1e-6)


def test_fprop_meta_counts_the_matmuls():
  p = attention.MultiHeadAttention.Params().Set(
      name='atten', input_dim=D, num_heads=N, hidden_dim=HD, use_bias=False)
  meta = attention.MultiHeadAttention.FPropMeta(
      p, tf.TensorShape([3, 5, D]), tf.TensorShape([3, 7, D]),
      tf.TensorShape([3, 7]))
  matmuls = 2 * 3 * (5 * D * HD + 2 * 7 * D * HD + 2 * 5 * 7 * HD +
                     5 * HD * D)
  assert matmuls <= meta.flops <= matmuls * 1.2
  assert meta.out_shapes == (tf.TensorShape([3, 5, D]),)
  assert meta.param_bytes == 4 * D * HD * 4


def test_errors_name_the_layer_and_the_fix():
  p = attention.MultiHeadAttention.Params().Set(
      name='enc', input_dim=8, num_heads=3)
  with pytest.raises(base_layer.LayerError, match=r'enc.*num_heads 3'):
    p.Instantiate()
  layer = _layer(causal=True)
  with pytest.raises(base_layer.LayerError, match=r'atten: query .*\[B, T, 8'):
    layer.FProp(layer.theta, tf.zeros([1, 2, 4]), tf.zeros([1, 2, 8]))
  with pytest.raises(base_layer.LayerError, match='Tq=2, Tk=3'):
    layer.FProp(layer.theta, tf.zeros([1, 2, 8]), tf.zeros([1, 3, 8]))
