"""The ops of AmoebaNet cells, each a layer with an exact FPropMeta.

An AmoebaNet cell is ten small ops wired by a genotype (`amoebanet.py`).
Each op here is a layer so that the cell's FPropMeta is the sum of its ops'
and the partitioner sees real costs; every conv is the reference's unit,
ReLU → conv (SAME, no bias) → BatchNorm (`ReluConvBnLayer`). Op names and
what they compute, for F output filters and stride s (1, or 2 in a
reduction cell on the cell's inputs):

    none            identity; ReLU-1×1(stride s)-BN if s > 1 or depth ≠ F
    conv_1x1        ReLU-1×1-BN
    conv_3x3        ReLU-1×1 to F/4-BN, ReLU-3×3-BN, ReLU-1×1 to F-BN
    conv_1x7_7x1    as conv_3x3, with ReLU-1×7-BN, ReLU-7×1-BN in the middle
                    (stride (1, s) then (s, 1))
    sep_KxK         ReLU-separable K×K-BN twice (K = 3, 5, 7; stride on the
                    first): AmoebaNet-A/B/C's `separable_KxK_2`
    avg_pool_3x3, max_pool_3x3, max_pool_2x2
                    SAME pooling, then 1×1-BN (no ReLU) if depth ≠ F

The F/4 bottleneck of conv_3x3 and conv_1x7_7x1 is the reference's (TF
tensorflow/tpu models/official/amoeba_net); below 4 filters it is skipped,
as there. `FactorizedReduceLayer` halves the resolution of a cell's older
input (h[i−2] after a reduction) without discarding 3 pixels in 4.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import conv
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import pooling
from lingvo_pipe.layers import shape as shape_lib

LayerError = base_layer.LayerError
LayerMeta = base_layer.LayerMeta

OPS = ('none', 'conv_1x1', 'conv_3x3', 'conv_1x7_7x1', 'sep_3x3', 'sep_5x5',
       'sep_7x7', 'avg_pool_3x3', 'max_pool_3x3', 'max_pool_2x2')


def shared(p: Params, name: str, **kwargs: Any) -> dict[str, Any]:
  """Keys a child inherits from its parent, plus `kwargs`."""
  return dict(name=name, dtype=p.dtype, fprop_dtype=p.fprop_dtype,
              params_init=p.params_init.Copy(), **kwargs)


BN_DOC = ('BatchNorm after each conv, as a template: decay, epsilon, '
          'stats_dtype (dim and name are set where it is used).')


def batch_norm_template() -> InstantiableParams:
  """The default `bn` template of AmoebaNet layers."""
  return normalization.BatchNormLayer.Params()


def batch_norm(p: Params, name: str, dim: int) -> Params:
  """Params of a BatchNorm over `dim` channels from layer `p`'s template."""
  return p.bn.Copy().Set(**shared(p, name, dim=dim))


def sum_metas(metas: list[LayerMeta]) -> LayerMeta:
  """Children run in order: flops, parameter and activation bytes add up."""
  return functools.reduce(lambda a, b: a + b, metas)


def child_meta(cls: type, p: Params, *shapes: Any) -> LayerMeta:
  """`cls.FPropMeta(p, *shapes)`, for a child built from `p`."""
  return cls.FPropMeta(p, *shapes)


# ---- ReLU → conv → BatchNorm ------------------------------------------------
class ReluConvBnLayer(base_layer.BaseLayer):
  """[ReLU →] conv or separable conv (SAME, no bias) → BatchNorm."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('separable', False, 'Depthwise-separable conv instead of a full '
             'one (AmoebaNet-A/B/C\'s sep_KxK ops).')
    p.Define('filter_shape', (1, 1, 0, 0), '(height, width, in, out).')
    p.Define('filter_stride', (1, 1), 'Stride (height, width).')
    p.Define('relu_first', True, 'ReLU the input first (every AmoebaNet '
             'conv but a pool\'s depth projection).')
    p.Define('bn', batch_norm_template(), BN_DOC)
    return p

  @classmethod
  def _SubParams(cls, p: Params) -> tuple[Params, Params]:
    conv_cls = conv.SeparableConv2DLayer if p.separable else conv.Conv2DLayer
    conv_p = conv_cls.Params().Set(**shared(
        p, f'{p.name}.conv', filter_shape=tuple(p.filter_shape),
        filter_stride=tuple(p.filter_stride), padding='SAME',
        has_bias=False))
    bn_p = batch_norm(p, f'{p.name}.bn', p.filter_shape[3])
    return conv_p, bn_p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    conv_p, bn_p = self._SubParams(self.params.Copy().Set(name=self.path))
    self.CreateChild('conv', conv_p.Set(name='conv'))
    self.CreateChild('bn', bn_p.Set(name='bn'))

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    x = tf.cast(x, self.fprop_dtype)
    if self.params.relu_first:
      x = tf.nn.relu(x)
    y = self.children.conv.FProp(theta.conv, x)
    return self.children.bn.FProp(theta.bn, y)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> LayerMeta:
    conv_p, bn_p = cls._SubParams(p)
    conv_meta = child_meta(conv_p.cls, conv_p, x)
    meta = conv_meta + child_meta(bn_p.cls, bn_p, *conv_meta.out_shapes)
    relu = shape_lib.num_elements(x) * int(p.relu_first)
    return dataclasses.replace(meta, flops=meta.flops + relu)


def rcb(p: Params, name: str, filter_shape: tuple[int, ...],
        stride: tuple[int, int] = (1, 1), separable: bool = False,
        relu_first: bool = True) -> Params:
  """ReluConvBnLayer Params named `name`, inheriting `p`'s dtypes and bn."""
  return ReluConvBnLayer.Params().Set(**shared(
      p, name, filter_shape=filter_shape, filter_stride=stride,
      separable=separable, relu_first=relu_first, bn=p.bn.Copy()))


# ---- Factorized reduction ---------------------------------------------------
class FactorizedReduceLayer(base_layer.BaseLayer):
  """ReLU, then two stride-2 1×1 convs on pixel grids offset by one, concat, BN.

  Halves the resolution without dropping three pixels in four (a strided
  1×1 conv alone would): [B, H, W, in] → [B, ⌈H/2⌉, ⌈W/2⌉, out].
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Input depth.')
    p.Define('output_dim', 0, 'Output depth (even: half from each grid).')
    p.Define('bn', batch_norm_template(), BN_DOC)
    return p

  @classmethod
  def _SubParams(cls, p: Params) -> tuple[Params, Params, Params]:
    if p.output_dim < 2 or p.output_dim % 2:
      raise LayerError(f'{p.name}: output_dim must be even and ≥ 2 (half '
                       f'from each pixel grid), got {p.output_dim}; use an '
                       'even filter count.')
    half = (1, 1, p.input_dim, p.output_dim // 2)
    paths = [conv.Conv2DLayer.Params().Set(**shared(
        p, f'{p.name}.{name}', filter_shape=half, filter_stride=(2, 2),
        padding='VALID', has_bias=False)) for name in ('path1', 'path2')]
    bn_p = batch_norm(p, f'{p.name}.bn', p.output_dim)
    return paths[0], paths[1], bn_p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    subs = self._SubParams(self.params.Copy().Set(name=self.path))
    for name, sub in zip(('path1', 'path2', 'bn'), subs):
      self.CreateChild(name, sub.Set(name=name))

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    x = tf.nn.relu(tf.cast(x, self.fprop_dtype))
    a = self.children.path1.FProp(theta.path1, x)
    # Shift by one pixel: pad bottom/right, drop the first row and column.
    shifted = tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]
    b = self.children.path2.FProp(theta.path2, shifted)
    return self.children.bn.FProp(theta.bn, tf.concat([a, b], axis=-1))

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> LayerMeta:
    path1, path2, bn_p = cls._SubParams(p)
    x = tf.TensorShape(x)
    a = child_meta(conv.Conv2DLayer, path1, x)
    b = child_meta(conv.Conv2DLayer, path2, x)
    out = a.out_shapes[0][:-1].concatenate([p.output_dim])
    meta = a + b + child_meta(bn_p.cls, bn_p, out)
    return dataclasses.replace(meta, flops=meta.flops +
                               shape_lib.num_elements(x))


# ---- One op of a cell -------------------------------------------------------
class CellOpLayer(base_layer.BaseLayer):
  """One AmoebaNet op (see the module docstring): [B,H,W,in] → [B,H/s,W/s,F]."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('op', 'none', f'One of {OPS}.')
    p.Define('input_dim', 0, 'Input depth.')
    p.Define('filters', 0, 'Output depth F.')
    p.Define('stride', 1, '1, or 2 in a reduction cell on states 0 and 1.')
    p.Define('bn', batch_norm_template(), BN_DOC)
    return p

  @classmethod
  def _Plan(cls, p: Params) -> tuple[Params | None, list[Params]]:
    """(pool params or None, the ReLU-conv-BN steps) of op `p.op`."""
    if p.op not in OPS:
      raise LayerError(f'{p.name}: unknown op {p.op!r}; use one of {OPS}.')
    cin, f, s = p.input_dim, p.filters, p.stride
    if p.op.endswith('pool_3x3') or p.op == 'max_pool_2x2':
      k = int(p.op[-1])
      pool = pooling.PoolingLayer.Params().Set(**shared(
          p, f'{p.name}.pool', pooling_type=p.op[:3].upper(),
          window_shape=(k, k), window_stride=(s, s), padding='SAME'))
      steps = [] if cin == f else [rcb(p, 'proj', (1, 1, cin, f),
                                        relu_first=False)]
      return pool, steps
    if p.op == 'none':
      if s == 1 and cin == f:
        return None, []
      return None, [rcb(p, 'proj', (1, 1, cin, f), (s, s))]
    if p.op == 'conv_1x1':
      return None, [rcb(p, 'conv', (1, 1, cin, f), (s, s))]
    if p.op.startswith('sep_'):
      k = int(p.op[-1])
      return None, [rcb(p, 'sep1', (k, k, cin, f), (s, s), separable=True),
                    rcb(p, 'sep2', (k, k, f, f), separable=True)]
    mid = f // 4  # Bottleneck width, as in the reference.
    width = mid if mid >= 1 else f
    pre = [rcb(p, 'pre', (1, 1, cin, mid))] if mid >= 1 else []
    first = mid if mid >= 1 else cin
    if p.op == 'conv_3x3':
      core = [rcb(p, 'conv3x3', (3, 3, first, width), (s, s))]
    else:  # conv_1x7_7x1
      core = [rcb(p, 'conv1x7', (1, 7, first, width), (1, s)),
              rcb(p, 'conv7x1', (7, 1, width, width), (s, 1))]
    post = [rcb(p, 'post', (1, 1, mid, f))] if mid >= 1 else []
    return None, pre + core + post

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    pool, steps = self._Plan(self.params.Copy().Set(name=self.path))
    self._has_pool = pool is not None
    if pool is not None:
      self.CreateChild('pool', pool.Set(name='pool'))
    self.CreateChildren('steps', steps)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    x = tf.cast(x, self.fprop_dtype)
    if self._has_pool:
      x = self.children.pool.FProp(theta.pool, x)
    for step, step_theta in zip(self.children.steps, theta.steps):
      x = step.FProp(step_theta, x)
    return x

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> LayerMeta:
    pool, steps = cls._Plan(p)
    metas = [LayerMeta.build(p, 0, (tf.TensorShape(x),), 0)]  # Identity.
    for sub in ([pool] if pool is not None else []) + steps:
      sub = sub.Copy().Set(name=f'{p.name}.{sub.name}')
      metas.append(child_meta(sub.cls, sub, *metas[-1].out_shapes))
    total = sum_metas(metas)
    return dataclasses.replace(total, out_bytes=total.out_bytes -
                               metas[0].out_bytes)
