"""Window and global pooling against numpy."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import pooling
from test_conv import window_patches  # Sibling test module.


def _ref_pool(x, kind, window, stride, padding):
  """Max, or average over the real (unpadded) pixels of each window."""
  if kind == 'MAX':
    patches = window_patches(x, window, stride, (1, 1), padding, -np.inf)
    return np.max([patch for _, _, patch in patches], axis=0)
  total = sum(p for _, _, p in window_patches(x, window, stride, (1, 1),
                                               padding))
  count = sum(p for _, _, p in window_patches(np.ones_like(x), window, stride,
                                               (1, 1), padding))
  return total / count


@pytest.mark.parametrize('kind', ['MAX', 'AVG'])
@pytest.mark.parametrize('window, stride, padding', [
    ((2, 2), (2, 2), 'SAME'), ((3, 3), (2, 2), 'SAME'),
    ((3, 2), (1, 2), 'VALID'), ((3, 3), (2, 2), 'VALID')])
def test_pooling_matches_reference(kind, window, stride, padding):
  p = pooling.PoolingLayer.Params().Set(
      name='pool', pooling_type=kind, window_shape=window,
      window_stride=stride, padding=padding)
  layer = p.Instantiate()
  x = np.random.randn(2, 7, 6, 3)
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  want = _ref_pool(x, kind, window, stride, padding)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  meta = pooling.PoolingLayer.FPropMeta(p, tf.TensorShape(x.shape))
  assert meta.out_shapes == (tf.TensorShape(want.shape),)
  assert meta.flops == want.size * window[0] * window[1]


@pytest.mark.parametrize('kind, ref', [('AVG', np.mean), ('MAX', np.max)])
def test_global_pooling(kind, ref):
  p = pooling.GlobalPoolingLayer.Params().Set(name='gp', pooling_type=kind)
  layer = p.Instantiate()
  x = np.random.randn(2, 4, 3, 5)
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  np.testing.assert_allclose(got, ref(x, axis=(1, 2)), rtol=1e-5, atol=1e-6)
  meta = pooling.GlobalPoolingLayer.FPropMeta(p, tf.TensorShape(x.shape))
  assert meta.out_shapes == (tf.TensorShape([2, 5]),)
  assert meta.flops == x.size


def test_errors():
  with pytest.raises(base_layer.LayerError, match="pool: pooling_type .*'MIN'"):
    pooling.PoolingLayer.Params().Set(name='pool',
                                      pooling_type='MIN').Instantiate()
  layer = pooling.GlobalPoolingLayer.Params().Set(name='gp').Instantiate()
  with pytest.raises(base_layer.LayerError, match=r'gp: expects an NHWC'):
    layer.FProp(layer.theta, tf.ones([2, 3]))
