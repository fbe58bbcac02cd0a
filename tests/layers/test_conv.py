"""Conv2D, depthwise and separable convs against a float64 numpy reference."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import conv


def _pads(n, k, s, d, padding):
  """(pad_before, pad_after, out) along one dim, TensorFlow's convention."""
  eff = (k - 1) * d + 1
  if padding == 'VALID':
    return 0, 0, math.ceil((n - eff + 1) / s)
  out = math.ceil(n / s)
  total = max((out - 1) * s + eff - n, 0)
  return total // 2, total - total // 2, out


def window_patches(x, window, stride, dilation, padding, pad_value=0.0):
  """[(i, j, patch [B, H', W', C])]: the input seen by window offset (i, j)."""
  (t, b, ho), (l, r, wo) = (
      _pads(x.shape[k + 1], window[k], stride[k], dilation[k], padding)
      for k in (0, 1))
  xp = np.pad(x, [(0, 0), (t, b), (l, r), (0, 0)], constant_values=pad_value)
  out = []
  for i in range(window[0]):
    for j in range(window[1]):
      top, left = i * dilation[0], j * dilation[1]
      out.append((i, j, xp[:, top:top + (ho - 1) * stride[0] + 1:stride[0],
                           left:left + (wo - 1) * stride[1] + 1:stride[1]]))
  return out


def ref_conv(x, w, stride, dilation, padding, depthwise=False):
  """Direct NHWC convolution in float64 (filter HWIO, or H W C mult)."""
  out = 0.0
  for i, j, patch in window_patches(x, w.shape[:2], stride, dilation, padding):
    if depthwise:  # [B, H', W', C, mult] → [B, H', W', C·mult]
      out = out + (patch[..., None] * w[i, j]).reshape(patch.shape[:3] +
                                                       (-1,))
    else:
      out = out + patch @ w[i, j]
  return out


_CASES = [  # (H, W, kh, kw, stride, dilation, padding)
    (7, 6, 3, 3, (1, 1), (1, 1), 'SAME'),
    (7, 6, 3, 2, (2, 2), (1, 1), 'SAME'),
    (8, 9, 3, 3, (2, 3), (1, 1), 'VALID'),
    (9, 9, 3, 3, (1, 1), (2, 2), 'VALID'),
    (6, 7, 2, 3, (1, 1), (2, 1), 'SAME'),
    (5, 5, 1, 1, (2, 2), (1, 1), 'VALID'),
]


def _build(cls, fs, stride, dilation, padding, **kwargs):
  p = cls.Params().Set(name='conv', filter_shape=fs, filter_stride=stride,
                       dilation_rate=dilation, padding=padding,
                       bias_init=base_layer.WeightInit.Gaussian(1.0),
                       **kwargs)
  return p, p.Instantiate()


def _float64(v):
  return v.numpy().astype(np.float64)


@pytest.mark.parametrize('h, w, kh, kw, stride, dilation, padding', _CASES)
def test_conv2d_matches_reference(h, w, kh, kw, stride, dilation, padding):
  p, layer = _build(conv.Conv2DLayer, (kh, kw, 3, 4), stride, dilation,
                    padding, activation='RELU')
  x = np.random.randn(2, h, w, 3)
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  want = np.maximum(ref_conv(x, _float64(layer.theta.w), stride, dilation,
                             padding) + _float64(layer.theta.b), 0)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  meta = conv.Conv2DLayer.FPropMeta(p, tf.TensorShape(x.shape))
  assert meta.out_shapes == (tf.TensorShape(want.shape),)
  outputs = want.size
  assert meta.flops == 2 * outputs * kh * kw * 3 + 2 * outputs  # bias, relu


@pytest.mark.parametrize('h, w, kh, kw, stride, dilation, padding',
                         [c for c in _CASES if c[4][0] == c[4][1]])
def test_depthwise_matches_reference(h, w, kh, kw, stride, dilation, padding):
  p, layer = _build(conv.DepthwiseConv2DLayer, (kh, kw, 3, 2), stride,
                    dilation, padding)
  x = np.random.randn(2, h, w, 3)
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  want = ref_conv(x, _float64(layer.theta.w), stride, dilation, padding,
                  depthwise=True) + _float64(layer.theta.b)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  meta = conv.DepthwiseConv2DLayer.FPropMeta(p, tf.TensorShape(x.shape))
  assert meta.out_shapes == (tf.TensorShape(want.shape),)
  assert meta.flops == 2 * want.size * kh * kw + want.size


def test_separable_is_relu_depthwise_then_pointwise():
  p, layer = _build(conv.SeparableConv2DLayer, (3, 3, 3, 5), (2, 2), (1, 1),
                    'SAME', relu_first=True, channel_multiplier=2)
  assert layer.children.depthwise.path == 'conv.depthwise'
  x = np.random.randn(2, 7, 7, 3)
  dw, pw = layer.theta.depthwise, layer.theta.pointwise
  assert 'b' not in dw
  mid = ref_conv(np.maximum(x, 0), _float64(dw.w), (2, 2), (1, 1), 'SAME',
                 depthwise=True)
  want = mid @ _float64(pw.w)[0, 0] + _float64(pw.b)
  got = layer.FProp(layer.theta, tf.constant(x, tf.float32)).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  meta = conv.SeparableConv2DLayer.FPropMeta(p, tf.TensorShape(x.shape))
  assert meta.flops == (x.size + 2 * mid.size * 9 + 2 * want.size * 6 +
                        want.size)
  assert meta.param_bytes == 4 * (3 * 3 * 3 * 2 + 6 * 5 + 5)


def test_errors_name_the_layer_and_fix():
  p = conv.Conv2DLayer.Params().Set(name='conv', filter_shape=(3, 3, 3, 4))
  layer = p.Instantiate()
  with pytest.raises(base_layer.LayerError,
                     match=r'conv: expects NHWC input \[B, H, W, 3\]'):
    layer.FProp(layer.theta, tf.ones([1, 5, 5, 2]))
  with pytest.raises(base_layer.LayerError, match='does not fit'):
    conv.Conv2DLayer.FPropMeta(p.Copy().Set(padding='VALID'),
                               tf.TensorShape([1, 2, 2, 3]))
  bad = {'filter_shape': (3, 3, 4), 'padding': 'same',
         'filter_stride': (0, 1)}
  for key, value in bad.items():
    with pytest.raises(base_layer.LayerError, match=f'conv: {key}'):
      p.Copy().Set(**{key: value}).Instantiate()
  with pytest.raises(base_layer.LayerError, match='both > 1'):
    p.Copy().Set(filter_stride=(2, 2), dilation_rate=(2, 2)).Instantiate()
  with pytest.raises(base_layer.LayerError, match='equal strides'):
    conv.DepthwiseConv2DLayer.Params().Set(
        name='dw', filter_shape=(3, 3, 3, 1),
        filter_stride=(1, 2)).Instantiate()
