"""Spatial pooling on NHWC images: windowed and global.

AmoebaNet cells mix separable convs with 3×3 max/avg pools, and every image
model ends with a global average pool before its classifier. Output shapes
follow the conv arithmetic (`conv.spatial_output_size`). With SAME padding,
average pooling divides by the number of *real* pixels in each window
(TensorFlow's behaviour), not by the window size.

Cost convention (FPropMeta): 1 flop per input element read per window
(window pooling: outputs × window area; global pooling: input elements).
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import conv
from lingvo_pipe.layers import shape as shape_lib

POOLING_TYPES = ('MAX', 'AVG')


def _check_type(where: str, pooling_type: str) -> None:
  if pooling_type not in POOLING_TYPES:
    raise base_layer.LayerError(
        f'{where}: pooling_type must be one of {POOLING_TYPES}, got '
        f'{pooling_type!r}.')


def _check_image(where: str, x: tf.TensorShape) -> None:
  if x.rank is not None and x.rank != 4:
    raise base_layer.LayerError(
        f'{where}: expects an NHWC input [B, H, W, C], got shape {x}.')


class PoolingLayer(base_layer.BaseLayer):
  """Max or average pooling: [B, H, W, C] → [B, H', W', C].

  >>> p = PoolingLayer.Params().Set(name='pool', window_shape=(3, 3),
  ...                               window_stride=(2, 2))
  >>> pool = p.Instantiate()
  >>> pool.FProp(pool.theta, tf.ones([1, 8, 8, 4])).shape
  TensorShape([1, 4, 4, 4])
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('pooling_type', 'MAX', f'One of {POOLING_TYPES}.')
    p.Define('window_shape', (2, 2), 'Window (height, width) in pixels.')
    p.Define('window_stride', (2, 2), 'Stride (height, width) in pixels.')
    p.Define('padding', 'SAME', f'One of {conv.PADDINGS}.')
    return p

  @classmethod
  def _Validate(cls, where: str, p: Params) -> None:
    _check_type(where, p.pooling_type)
    conv.check_window_params(where, p, 'window_shape', 'window_stride')

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self._Validate(self.path, self.params)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    del theta  # No variables.
    p = self.params
    x = tf.cast(x, self.fprop_dtype)
    _check_image(self.path, x.shape)
    return tf.nn.pool(x, window_shape=list(p.window_shape),
                      pooling_type=p.pooling_type, padding=p.padding,
                      strides=list(p.window_stride))

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    cls._Validate(p.name, p)
    x = tf.TensorShape(x)
    _check_image(p.name, x)
    out = conv.image_output_shape(p.name, x, p.window_shape, p.window_stride,
                                  (1, 1), p.padding, x[-1])
    window = p.window_shape[0] * p.window_shape[1]
    return base_layer.LayerMeta.build(
        p, flops=shape_lib.num_elements(out) * window, out_shapes=(out,),
        num_params=0)


class GlobalPoolingLayer(base_layer.BaseLayer):
  """Max or average over height and width: [B, H, W, C] → [B, C]."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('pooling_type', 'AVG', f'One of {POOLING_TYPES}.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_type(self.path, self.params.pooling_type)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    del theta  # No variables.
    x = tf.cast(x, self.fprop_dtype)
    _check_image(self.path, x.shape)
    if self.params.pooling_type == 'MAX':
      return tf.reduce_max(x, axis=[1, 2])
    return tf.reduce_mean(x, axis=[1, 2])

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_type(p.name, p.pooling_type)
    x = tf.TensorShape(x)
    if x.rank != 4:
      raise base_layer.LayerError(
          f'{p.name}: expects an NHWC input [B, H, W, C], got shape {x}.')
    return base_layer.LayerMeta.build(
        p, flops=shape_lib.num_elements(x),
        out_shapes=(tf.TensorShape([x[0], x[3]]),), num_params=0)
