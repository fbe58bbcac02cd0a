"""EmbeddingLayer and sinusoidal positions: lookup, scaling, offsets, errors."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import embedding


def _emb(**kwargs):
  p = embedding.EmbeddingLayer.Params().Set(
      name='emb', vocab_size=7, embedding_dim=6, **kwargs)
  return p.Instantiate()


def test_lookup_returns_table_rows():
  layer = _emb()
  ids = np.array([[0, 3, 6], [2, 2, 1]], np.int32)
  out = layer.FProp(layer.theta, ids)
  np.testing.assert_array_equal(out.numpy(), layer.theta.emb.numpy()[ids])


def test_scale_sqrt_depth_multiplies_by_sqrt_d():
  plain, scaled = _emb(), _emb(scale_sqrt_depth=True)
  ids = tf.constant([[1, 4]])
  np.testing.assert_allclose(
      scaled.FProp(scaled.theta, ids).numpy(),
      plain.FProp(plain.theta, ids).numpy() * math.sqrt(6), rtol=1e-6)


@pytest.mark.parametrize('bad_id', [7, -1])
def test_out_of_range_ids_fail_clearly(bad_id):
  layer = _emb()
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'emb: ids must be in \[0, vocab_size=7\)'):
    layer.FProp(layer.theta, tf.constant([[1, bad_id]]))
  traced = tf.function(lambda ids: layer.FProp(layer.theta, ids))
  with pytest.raises(tf.errors.InvalidArgumentError, match='vocab_size=7'):
    traced(tf.constant([[bad_id, 1]]))


def test_float_ids_and_bad_params_are_rejected():
  with pytest.raises(base_layer.LayerError, match='emb: ids must be an int'):
    _emb().FProp(_emb().theta, tf.zeros([1, 2]))
  p = embedding.EmbeddingLayer.Params().Set(name='emb', vocab_size=0,
                                            embedding_dim=4)
  with pytest.raises(base_layer.LayerError, match='emb: vocab_size .* got 0'):
    p.Instantiate()


def _numpy_positions(length, depth, offset):
  """The Transformer paper's formula, float64."""
  half = depth // 2
  pos = np.arange(offset, offset + length, dtype=np.float64)[:, None]
  inv = 1e4 ** (-np.arange(half) / (half - 1))
  return np.concatenate([np.sin(pos * inv), np.cos(pos * inv)], axis=1)


def test_positions_match_formula_and_offsets():
  layer = embedding.PositionalEmbeddingLayer.Params().Set(
      name='pos', embedding_dim=8).Instantiate()
  x = np.random.normal(size=[2, 5, 8]).astype(np.float32)
  full = layer.FProp(layer.theta, x).numpy()
  np.testing.assert_allclose(full, x + _numpy_positions(5, 8, 0), atol=1e-5)
  for t in range(5):  # Incremental decoding: one position at a time.
    step = layer.FProp(layer.theta, x[:, t:t + 1], tf.constant(t))
    np.testing.assert_allclose(step.numpy(), full[:, t:t + 1], atol=1e-6)


def test_positional_meta_and_odd_depth():
  p = embedding.PositionalEmbeddingLayer.Params().Set(name='pos',
                                                      embedding_dim=8)
  meta = embedding.PositionalEmbeddingLayer.FPropMeta(p, tf.TensorShape(
      [2, 5, 8]))
  assert meta.out_shapes == (tf.TensorShape([2, 5, 8]),)
  assert meta.param_bytes == 0 and meta.flops == 80
  with pytest.raises(base_layer.LayerError, match='pos: embedding_dim .*even'):
    p.Copy().Set(embedding_dim=5).Instantiate()
