"""FCLayer against a float64 numpy matmul, its costs and its errors."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import linear


def _fc(**kwargs):
  p = linear.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=3)
  return p.Set(**kwargs).Instantiate()


@pytest.mark.parametrize('shape', [[5, 4], [2, 3, 4], [2, 2, 3, 4]])
def test_matches_numpy_on_any_rank(shape):
  layer = _fc(activation='RELU',
              bias_init=base_layer.WeightInit.Gaussian(1.0))
  x = np.random.randn(*shape)
  w, b = (v.numpy().astype(np.float64) for v in (layer.theta.w,
                                                  layer.theta.b))
  want = np.maximum(x @ w + b, 0)
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32))
  assert got.shape == tuple(shape[:-1]) + (3,)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_without_bias():
  layer = _fc(has_bias=False)
  assert 'b' not in layer.theta
  x = np.random.randn(2, 4)
  np.testing.assert_allclose(
      layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy(),
      x @ layer.theta.w.numpy().astype(np.float64), rtol=1e-5, atol=1e-6)


def test_fprop_dtype_casts_weights_not_variables():
  layer = _fc(fprop_dtype=tf.float16)
  y = layer.FProp(layer.theta, tf.ones([2, 4]))
  assert y.dtype == tf.float16 and layer.theta.w.dtype == tf.float32


def test_fpropmeta_costs():
  p = linear.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=3,
                                  activation='TANH')
  meta = linear.FCLayer.FPropMeta(p, tf.TensorShape([2, 5, 4]))
  rows = 2 * 5
  assert meta.flops == 2 * rows * 4 * 3 + rows * 3 + rows * 3
  assert meta.out_shapes == (tf.TensorShape([2, 5, 3]),)
  assert meta.param_bytes == (4 * 3 + 3) * 4
  assert meta.out_bytes == rows * 3 * 4


def test_errors_name_the_layer_param_and_fix():
  layer = _fc()
  with pytest.raises(base_layer.LayerError,
                     match=r'fc: input last dim is 5 .* input_dim is 4; set '
                     r'p.input_dim = 5'):
    layer.FProp(layer.theta, tf.ones([2, 5]))
  with pytest.raises(base_layer.LayerError, match='rank ≥ 2'):
    layer.FProp(layer.theta, tf.ones([4]))
  with pytest.raises(base_layer.LayerError,
                     match='fc: input_dim must be a positive int, got 0'):
    _fc(input_dim=0)
  with pytest.raises(base_layer.LayerError, match="Did you mean 'TANH'"):
    _fc(activation='TANHH')
  p = linear.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=3)
  with pytest.raises(base_layer.LayerError, match=r'\[B, ..., 4\]'):
    linear.FCLayer.FPropMeta(p, tf.TensorShape([2, 6]))
