"""The translator's layer list: exact FPropMeta, and pipelining is exact.

The partitioner trusts FPropMeta without building a layer, so every layer of
the list (and the whole net) must predict the real output shapes and its
real parameter count; and pipelining (K stages, M micro-batches, dropout on,
padded sequences) must give the unpipelined model's loss and gradients.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import transparency
from lingvo_pipe.layers import softmax
from lingvo_pipe.tasks.mt import decoder
from lingvo_pipe.tasks.mt import layers as mt_layers
from lingvo_pipe.tasks.mt import model

B, S, T, V = 4, 7, 5, 37


def _paddings(rng, batch, length):
  lengths = rng.integers(1, length + 1, size=batch)
  lengths[0] = length
  return (np.arange(length)[None] >= lengths[:, None]).astype(np.float32)


def _inputs(rng, batch=B, src_len=S, tgt_len=T, vocab_size=V):
  """(src_ids, src_paddings, tgt_ids, tgt_paddings): int32 ids."""
  ids = lambda n: tf.constant(rng.integers(4, vocab_size, size=(batch, n)),
                              tf.int32)
  pad = lambda n: tf.constant(_paddings(rng, batch, n), tf.float32)
  return ids(src_len), pad(src_len), ids(tgt_len), pad(tgt_len)


def _layers(**kwargs):
  values = dict(vocab_size=V, model_dim=8, num_heads=2, hidden_dim=16,
                num_encoder_layers=2, num_decoder_layers=2,
                dropout_prob=0.1, atten_dropout_prob=0.1)
  values.update(kwargs)
  return model.transformer_layers(**values)


def _shapes(nest):
  return [tuple(s.as_list()) for s in tf.nest.flatten(nest)]


@pytest.mark.parametrize('pre_layer_norm', [True, False])
@pytest.mark.parametrize('training', [False, True])
def test_fprop_meta_matches_every_layer(pre_layer_norm, training):
  rng = np.random.default_rng(0)
  x = _inputs(rng)
  shapes = tuple(t.shape for t in x)
  layer_params = _layers(pre_layer_norm=pre_layer_norm)
  assert len(layer_params) == 2 + 2 + 2 + int(pre_layer_norm)
  for lp in layer_params:
    meta = lp.cls.FPropMeta(lp, *shapes)
    layer = lp.Instantiate()
    with fprop_context.scope(training=training, step=3):
      out = layer.FProp(layer.theta, *x)
    out = out if isinstance(out, tuple) else (out,)
    assert _shapes(meta.out_shapes) == _shapes([t.shape for t in out]), (
        lp.name)
    num_params = sum(int(np.prod(v.shape)) for v in layer.variables)
    assert meta.param_bytes == 4 * num_params, lp.name
    assert meta.flops > 0, lp.name
    x, shapes = out, meta.out_shapes
  assert _shapes(shapes) == [(B, T, V)]


def test_fprop_meta_of_the_whole_net():
  rng = np.random.default_rng(1)
  x = _inputs(rng)
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=_layers(), num_stages=2, num_micro_batches=2,
      input_shapes=[t.shape.as_list() for t in x])
  meta = p.cls.FPropMeta(p, *[t.shape for t in x])
  net = p.Instantiate()
  for training in (False, True):
    with fprop_context.scope(training=training, step=1):
      logits = net.FProp(net.theta, *x)  # The pipeline checks each layer.
    assert _shapes(meta.out_shapes) == _shapes([logits.shape])
  assert meta.param_bytes == 4 * sum(int(np.prod(v.shape))
                                     for v in net.variables)
  assert sum(m.flops for m in net.metas) == meta.flops


def test_separate_embeddings_count_both_tables():
  p = mt_layers.SourceTargetEmbedding.Params().Set(
      name='emb', vocab_size=V, model_dim=8, share_embedding=False)
  meta = p.cls.FPropMeta(p, [B, S], [B, S], [B, T], [B, T])
  assert meta.param_bytes == 4 * 2 * V * 8
  layer = p.Instantiate()
  assert sorted(layer.theta) == ['pos', 'src_emb', 'tgt_emb']
  x = _inputs(np.random.default_rng(2))
  src_x, _, tgt_x, _ = layer.FProp(layer.theta, *x)
  same = layer.EmbedSource(layer.theta, x[2])  # Target ids, source table.
  assert not np.allclose(tgt_x.numpy(), same.numpy())
  assert src_x.shape == (B, S, 8)


def test_int_and_float_ids_embed_alike():
  p = mt_layers.SourceTargetEmbedding.Params().Set(name='emb', vocab_size=V,
                                                   model_dim=8)
  layer = p.Instantiate()
  ids = np.array([[4, 9, 36]])
  got = layer.EmbedTarget(layer.theta, tf.constant(ids, tf.float32), 2)
  want = layer.EmbedTarget(layer.theta, tf.constant(ids, tf.int32), 2)
  np.testing.assert_array_equal(got.numpy(), want.numpy())


def _smoothed_loss(logits, tgt_paddings, labels):
  weights = 1.0 - tgt_paddings
  return softmax.mean_softmax_cross_entropy(logits, labels, weights, 0.1)[0]


@pytest.mark.parametrize('num_stages,num_micro_batches', [(2, 2), (3, 4)])
def test_pipelined_equals_unpipelined(num_stages, num_micro_batches):
  """Loss and gradients with dropout and padding, K stages × M micro."""
  rng = np.random.default_rng(3)
  x = _inputs(rng)
  labels = tf.constant(rng.integers(0, V, size=(B, T)), tf.int32)
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=_layers(), num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      input_shapes=[t.shape.as_list() for t in x])
  report = transparency.check_transparency(
      p, x, loss_fn=lambda logits: _smoothed_loss(logits, x[3], labels),
      step=5)
  assert report.ok(), str(report)


def test_dropout_is_on_in_training_only():
  rng = np.random.default_rng(4)
  x = _inputs(rng)
  p = gpipe.PipeliningLayer.Params().Set(name='net', layers=_layers(),
                                         num_stages=1)
  net = p.Instantiate()
  eval_a = net.FProp(net.theta, *x)
  eval_b = net.FProp(net.theta, *x)
  with fprop_context.scope(training=True, step=0):
    train_0 = net.FProp(net.theta, *x)
  with fprop_context.scope(training=True, step=1):
    train_1 = net.FProp(net.theta, *x)
  np.testing.assert_array_equal(eval_a.numpy(), eval_b.numpy())
  assert not np.allclose(train_0.numpy(), eval_a.numpy())
  assert not np.allclose(train_0.numpy(), train_1.numpy())


def test_decoder_rejects_a_foreign_layer_list():
  from lingvo_pipe.layers import linear  # pylint: disable=g-import-not-at-top
  p = gpipe.PipeliningLayer.Params().Set(
      name='mlp', layers=[linear.FCLayer.Params().Set(name='fc', input_dim=2,
                                                      output_dim=2)])
  with pytest.raises(decoder.DecodeError, match='SourceTargetEmbedding'):
    decoder.PipelineDecoder(p.Instantiate())


def test_bad_dropout_names_the_layer():
  p = mt_layers.SourceTargetEmbedding.Params().Set(
      name='emb', vocab_size=V, model_dim=8, dropout_prob=1.5)
  with pytest.raises(base_layer.LayerError, match=r'emb: dropout_prob'):
    p.Instantiate()
