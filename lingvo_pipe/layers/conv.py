"""2-D convolutions on NHWC images: full, depthwise and separable.

These are the building blocks of AmoebaNet, GPipe's image model, whose cells
are mostly ReLU → separable conv → BatchNorm. The partitioner balances stages
by FPropMeta's flops, and the stage boundaries carry activations whose size
comes from FPropMeta's output shapes, so the spatial arithmetic
(`spatial_output_size`) must match TensorFlow's exactly:

    SAME:  out = ceil(in / stride)
    VALID: out = ceil((in − (k − 1)·dilation) / stride)

Cost convention (FPropMeta): 2 flops per multiply-add; bias add and
activation 1 flop per output element each.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import activations
from lingvo_pipe.layers import shape as shape_lib

PADDINGS = ('SAME', 'VALID')


def spatial_output_size(size: int | None, window: int, stride: int,
                        dilation: int, padding: str) -> int | None:
  """Output length of a conv/pool along one spatial dim (None if unknown)."""
  if size is None:
    return None
  if padding == 'SAME':
    return math.ceil(size / stride)
  return math.ceil((size - (window - 1) * dilation) / stride)


def check_window_params(where: str, p: Params, window_key: str,
                        stride_key: str) -> None:
  """Validates a 2-entry window, stride and the padding of conv/pool params."""
  for key in (window_key, stride_key):
    value = getattr(p, key)
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or
        not all(isinstance(d, int) and d > 0 for d in value)):
      raise base_layer.LayerError(
          f'{where}: {key} must be 2 positive ints (height, width), got '
          f'{value!r}; e.g. p.{key} = (2, 2).')
  if p.padding not in PADDINGS:
    raise base_layer.LayerError(
        f'{where}: padding must be one of {PADDINGS}, got {p.padding!r}.')


def image_output_shape(where: str, x: tf.TensorShape, window: Sequence[int],
                       stride: Sequence[int], dilation: Sequence[int],
                       padding: str, channels: int) -> tf.TensorShape:
  """[B, H', W', channels] for NHWC input `x`; raises if it would be empty."""
  x = tf.TensorShape(x)
  if x.rank != 4:
    raise base_layer.LayerError(
        f'{where}: expects an NHWC input [B, H, W, C], got shape {x}.')
  out = [spatial_output_size(x[i], window[i - 1], stride[i - 1],
                             dilation[i - 1], padding) for i in (1, 2)]
  if any(d is not None and d < 1 for d in out):
    raise base_layer.LayerError(
        f'{where}: a {tuple(window)} window (dilation {tuple(dilation)}) '
        f'does not fit input {x} with padding VALID; use padding SAME or a '
        'larger input.')
  return tf.TensorShape([x[0]] + out + [channels])


def _check_channels(where: str, x: tf.TensorShape, channels: int) -> None:
  if x.rank is not None and (x.rank != 4 or x[-1] not in (None, channels)):
    raise base_layer.LayerError(
        f'{where}: expects NHWC input [B, H, W, {channels}] (filter_shape[2] '
        f'= {channels}), got shape {x}; set p.filter_shape[2] to the input '
        'channels.')


class _ConvBase(base_layer.BaseLayer):
  """Shared params, checks and costs of Conv2DLayer and DepthwiseConv2DLayer."""

  _FILTER_DOC = ''

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('filter_shape', (0, 0, 0, 0), cls._FILTER_DOC)
    p.Define('filter_stride', (1, 1), 'Stride (height, width) in pixels.')
    p.Define('dilation_rate', (1, 1), 'Dilation (height, width); > 1 needs '
             'stride 1 (TensorFlow\'s restriction).')
    p.Define('padding', 'SAME', f'One of {PADDINGS}.')
    p.Define('has_bias', True, 'Whether to add a bias per output channel.')
    p.Define('bias_init', base_layer.WeightInit.Constant(0.0),
             'Initialiser of the bias; the filter uses params_init.')
    p.Define('activation', 'NONE', f'One of {activations.NAMES}.')
    return p

  @classmethod
  def _OutChannels(cls, p: Params) -> int:
    raise NotImplementedError

  @classmethod
  def _MacsPerOutput(cls, p: Params) -> int:
    raise NotImplementedError

  @classmethod
  def _Validate(cls, where: str, p: Params) -> None:
    fs = p.filter_shape
    if (not isinstance(fs, (list, tuple)) or len(fs) != 4 or
        not all(isinstance(d, int) and d > 0 for d in fs)):
      raise base_layer.LayerError(
          f'{where}: filter_shape must be 4 positive ints, got {fs!r}; '
          f'{cls._FILTER_DOC}')
    check_window_params(where, p, 'filter_stride', 'dilation_rate')
    if max(p.filter_stride) > 1 and max(p.dilation_rate) > 1:
      raise base_layer.LayerError(
          f'{where}: filter_stride {tuple(p.filter_stride)} and dilation_rate '
          f'{tuple(p.dilation_rate)} are both > 1, which TensorFlow does not '
          'support; use one of them.')
    activations.get_activation(p.activation, f'{where}: activation')

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    self._Validate(self.path, p)
    self._act = activations.get_activation(p.activation)
    self.CreateVariable('w', base_layer.WeightParams(list(p.filter_shape)))
    if p.has_bias:
      self.CreateVariable('b', base_layer.WeightParams(
          [self._OutChannels(p)], p.bias_init))

  def _Finish(self, theta: NestedMap, y: tf.Tensor) -> tf.Tensor:
    if self.params.has_bias:
      y += tf.cast(theta.b, y.dtype)
    return self._act(y)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    cls._Validate(p.name, p)
    x = tf.TensorShape(x)
    _check_channels(p.name, x, p.filter_shape[2])
    kh, kw = p.filter_shape[:2]
    out = image_output_shape(p.name, x, (kh, kw), p.filter_stride,
                             p.dilation_rate, p.padding, cls._OutChannels(p))
    outputs = shape_lib.num_elements(out)
    flops = 2 * outputs * cls._MacsPerOutput(p) + outputs * int(p.has_bias)
    flops += activations.activation_flops(p.activation, outputs)
    num_params = math.prod(p.filter_shape)
    num_params += cls._OutChannels(p) * int(p.has_bias)
    return base_layer.LayerMeta.build(p, flops=flops, out_shapes=(out,),
                                      num_params=num_params)


class Conv2DLayer(_ConvBase):
  """Conv2D on NHWC: [B, H, W, in] → [B, H', W', out], then bias, act.

  >>> p = Conv2DLayer.Params().Set(name='conv', filter_shape=(3, 3, 3, 8),
  ...                              filter_stride=(2, 2))
  >>> conv = p.Instantiate()
  >>> conv.FProp(conv.theta, tf.ones([1, 5, 5, 3])).shape
  TensorShape([1, 3, 3, 8])
  """

  _FILTER_DOC = ('Filter (height, width, in_channels, out_channels), e.g. '
                 '(3, 3, 64, 128).')

  @classmethod
  def _OutChannels(cls, p: Params) -> int:
    return p.filter_shape[3]

  @classmethod
  def _MacsPerOutput(cls, p: Params) -> int:
    return p.filter_shape[0] * p.filter_shape[1] * p.filter_shape[2]

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    p = self.params
    dtype = self.fprop_dtype
    x = tf.cast(x, dtype)
    _check_channels(self.path, x.shape, p.filter_shape[2])
    y = tf.nn.convolution(x, tf.cast(theta.w, dtype),
                          strides=list(p.filter_stride), padding=p.padding,
                          dilations=list(p.dilation_rate))
    return self._Finish(theta, y)


class DepthwiseConv2DLayer(_ConvBase):
  """Per-channel conv: [B, H, W, C] → [B, H', W', C·channel_multiplier]."""

  _FILTER_DOC = ('Filter (height, width, in_channels, channel_multiplier); '
                 'output channels = in_channels × channel_multiplier.')

  @classmethod
  def _OutChannels(cls, p: Params) -> int:
    return p.filter_shape[2] * p.filter_shape[3]

  @classmethod
  def _MacsPerOutput(cls, p: Params) -> int:
    return p.filter_shape[0] * p.filter_shape[1]  # One input channel each.

  @classmethod
  def _Validate(cls, where: str, p: Params) -> None:
    super()._Validate(where, p)
    if p.filter_stride[0] != p.filter_stride[1]:
      raise base_layer.LayerError(
          f'{where}: depthwise conv needs equal strides in height and width '
          f'(TensorFlow\'s restriction), got filter_stride '
          f'{tuple(p.filter_stride)}.')

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    p = self.params
    dtype = self.fprop_dtype
    x = tf.cast(x, dtype)
    _check_channels(self.path, x.shape, p.filter_shape[2])
    sh, sw = p.filter_stride
    y = tf.nn.depthwise_conv2d(
        x, tf.cast(theta.w, dtype), strides=[1, sh, sw, 1],
        padding=p.padding, dilations=list(p.dilation_rate))
    return self._Finish(theta, y)


class SeparableConv2DLayer(base_layer.BaseLayer):
  """[ReLU →] depthwise k×k conv → pointwise 1×1 conv [+ bias, act].

  AmoebaNet's separable convs put the ReLU first (`relu_first=True`); the
  depthwise step has no bias, the pointwise step carries bias and activation.
  Children: `depthwise` (DepthwiseConv2DLayer), `pointwise` (Conv2DLayer).
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('filter_shape', (0, 0, 0, 0), 'Filter (height, width, '
             'in_channels, out_channels) of the whole separable conv.')
    p.Define('channel_multiplier', 1, 'Depthwise outputs per input channel.')
    p.Define('filter_stride', (1, 1), 'Stride of the depthwise step.')
    p.Define('dilation_rate', (1, 1), 'Dilation of the depthwise step.')
    p.Define('padding', 'SAME', f'One of {PADDINGS}.')
    p.Define('relu_first', False, 'Apply ReLU to the input first (AmoebaNet).')
    p.Define('has_bias', True, 'Bias on the pointwise output.')
    p.Define('bias_init', base_layer.WeightInit.Constant(0.0),
             'Initialiser of the pointwise bias.')
    p.Define('activation', 'NONE', 'Activation after the pointwise conv.')
    return p

  @classmethod
  def _SubParams(cls, p: Params) -> tuple[Params, Params]:
    fs = p.filter_shape
    if (not isinstance(fs, (list, tuple)) or len(fs) != 4 or
        not all(isinstance(d, int) and d > 0 for d in fs)):
      raise base_layer.LayerError(
          f'{p.name}: filter_shape must be 4 positive ints (height, width, '
          f'in, out), got {fs!r}.')
    if not isinstance(p.channel_multiplier, int) or p.channel_multiplier < 1:
      raise base_layer.LayerError(
          f'{p.name}: channel_multiplier must be a positive int, got '
          f'{p.channel_multiplier!r}.')
    shared = dict(dtype=p.dtype, fprop_dtype=p.fprop_dtype,
                  params_init=p.params_init.Copy())
    dw = DepthwiseConv2DLayer.Params().Set(
        name='depthwise', filter_shape=(fs[0], fs[1], fs[2],
                                        p.channel_multiplier),
        filter_stride=p.filter_stride, dilation_rate=p.dilation_rate,
        padding=p.padding, has_bias=False, **shared)
    pw = Conv2DLayer.Params().Set(
        name='pointwise',
        filter_shape=(1, 1, fs[2] * p.channel_multiplier, fs[3]),
        has_bias=p.has_bias, bias_init=p.bias_init.Copy(),
        activation=p.activation, **shared)
    return dw, pw

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    dw, pw = self._SubParams(self.params.Copy().Set(name=self.path))
    self.CreateChild('depthwise', dw)
    self.CreateChild('pointwise', pw)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    x = tf.cast(x, self.fprop_dtype)
    if self.params.relu_first:
      x = tf.nn.relu(x)
    y = self.children.depthwise.FProp(theta.depthwise, x)
    return self.children.pointwise.FProp(theta.pointwise, y)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    dw, pw = cls._SubParams(p)
    dw.name, pw.name = f'{p.name}.depthwise', f'{p.name}.pointwise'
    dw_meta = DepthwiseConv2DLayer.FPropMeta(dw, x)
    meta = dw_meta + Conv2DLayer.FPropMeta(pw, *dw_meta.out_shapes)
    relu = shape_lib.num_elements(x) * int(p.relu_first)
    return dataclasses.replace(meta, flops=meta.flops + relu)
