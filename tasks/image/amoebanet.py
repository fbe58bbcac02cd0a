"""AmoebaNet-D(L, D) as a flat list of pipeline layers, cut-able between cells.

GPipe's image model is AmoebaNet-D(L, D): a stem, then L normal cells in
three groups of L/3, with a reduction cell (stride 2, twice the filters)
before the second and the third group, then a classifier. A cell reads the
outputs of the two cells before it, h[i−1] and h[i−2], so a pipeline cut
between two cells must carry both across the boundary. Every layer here
therefore passes a pair along:

    stem:   image      → (x, x)
    cell:   (x, prev)  → (cell(x, prev), x)   # x = h[i−1], prev = h[i−2]
    head:   (x, prev)  → logits                 # ReLU, mean, dropout, FC

and `network_layers(p)` returns [stem, (stem cells), cells..., head] for
`PipeliningLayer`, which may cut before any of them.

A cell (TF's reference AmoebaNet-D, tensorflow/tpu models/official/
amoeba_net, the model GPipe trained) first brings its inputs to F filters:
state 0 = ReLU-1×1-BN(x); state 1 = prev, through a 1×1 if its depth
differs or a factorized reduction if it has twice x's resolution. Then five
times two ops (`amoebanet_ops`) read two earlier states and their sum is a
new state; the output concatenates the listed states. In a reduction cell
the ops reading state 0 or 1 have stride 2. The genotypes, as (state, op):

    normal:    (1 conv_1x1, 1 max_pool_3x3) (1 none, 0 conv_1x7_7x1)
               (0 conv_1x1, 0 conv_1x7_7x1) (2 max_pool_3x3, 2 none)
               (1 avg_pool_3x3, 5 conv_1x1)              concat [0, 3, 4, 6]
    reduction: (0 max_pool_2x2, 0 max_pool_3x3) (2 none, 1 conv_3x3)
               (2 conv_1x7_7x1, 2 max_pool_3x3) (3 none, 1 max_pool_2x2)
               (2 avg_pool_3x3, 3 conv_1x1)              concat [4, 5, 6]

The reference AmoebaNet-D uses no separable convs (AmoebaNet-A/B/C do); the
`sep_KxK` ops exist so those genotypes can be written in Params. Simplified
against the reference: no drop-path, no auxiliary head, BatchNorm has a
learned scale, the small-image stem is a SAME 3×3 conv (the reference's is
VALID), and the first cell projects its prev (= x) to F filters.

How (L, D) is read (as torchgpipe reads the GPipe paper; it reports the
paper's parameter counts): L = normal cells in total (the reference's
`num_cells`), D = filters of every state of a first-group cell (the
reference's `reduction_size`), so a normal cell outputs 4·D channels; each
reduction cell doubles the filters, and ImageNet stem cells use D/4,
D/2. Reduction cells go before normal cells ⌊L/3⌋ and ⌊2L/3⌋, as in the
reference.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import shape as shape_lib
from lingvo_pipe.tasks.image import amoebanet_ops
from lingvo_pipe.tasks.image.amoebanet_ops import BN_DOC, batch_norm_template, child_meta
from lingvo_pipe.tasks.image.amoebanet_ops import rcb, shared, sum_metas

LayerError = base_layer.LayerError
LayerMeta = base_layer.LayerMeta

# (input state, op) pairs; see the module docstring.
AMOEBANET_D_NORMAL = [
    (1, 'conv_1x1'), (1, 'max_pool_3x3'), (1, 'none'), (0, 'conv_1x7_7x1'),
    (0, 'conv_1x1'), (0, 'conv_1x7_7x1'), (2, 'max_pool_3x3'), (2, 'none'),
    (1, 'avg_pool_3x3'), (5, 'conv_1x1')]
AMOEBANET_D_NORMAL_CONCAT = [0, 3, 4, 6]
AMOEBANET_D_REDUCTION = [
    (0, 'max_pool_2x2'), (0, 'max_pool_3x3'), (2, 'none'), (1, 'conv_3x3'),
    (2, 'conv_1x7_7x1'), (2, 'max_pool_3x3'), (3, 'none'),
    (1, 'max_pool_2x2'), (2, 'avg_pool_3x3'), (3, 'conv_1x1')]
AMOEBANET_D_REDUCTION_CONCAT = [4, 5, 6]


# ---- The cell ---------------------------------------------------------------
class AmoebaCellLayer(base_layer.BaseLayer):
  """A normal or reduction cell: (x, prev) → (cell output, x).

  Output depth = len(concat) × filters; a reduction cell halves H and W.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of x = h[i−1].')
    p.Define('prev_dim', 0, 'Depth of prev = h[i−2].')
    p.Define('prev_stride', 1, '2 if prev has twice x\'s resolution (the '
             'cell after a reduction cell), else 1.')
    p.Define('filters', 0, 'F: depth of every state in the cell.')
    p.Define('reduction', False, 'Stride 2 on the ops reading states 0, 1.')
    p.Define('ops', list(AMOEBANET_D_NORMAL), 'Pairs (input state, op), two '
             'per combination; state j ≥ 2 is the sum of pair j − 2.')
    p.Define('concat', list(AMOEBANET_D_NORMAL_CONCAT), 'States '
             'concatenated into the output.')
    p.Define('bn', batch_norm_template(), BN_DOC)
    return p

  @classmethod
  def _Validate(cls, p: Params) -> None:
    ops, n = list(p.ops), len(p.ops) // 2
    if not ops or len(ops) % 2:
      raise LayerError(f'{p.name}: ops must be a non-empty, even-length list '
                       f'of (state, op) pairs, got {len(ops)} entries.')
    for i, entry in enumerate(ops):
      if (not isinstance(entry, (list, tuple)) or len(entry) != 2 or
          not isinstance(entry[0], int) or not 0 <= entry[0] < 2 + i // 2):
        raise LayerError(
            f'{p.name}: ops[{i}] = {entry!r}; it must be (state, op) with '
            f'0 ≤ state < {2 + i // 2} (states 0, 1 and the sums before it).')
    lowest = 2 if p.reduction else 0
    bad = [c for c in p.concat if not lowest <= c < 2 + n]
    if not p.concat or bad:
      why = ('a reduction cell cannot concatenate its full-resolution inputs'
             if p.reduction else 'states that exist')
      raise LayerError(f'{p.name}: concat {list(p.concat)} must list states '
                       f'in [{lowest}, {2 + n}) ({why}).')
    if p.prev_stride not in (1, 2):
      raise LayerError(f'{p.name}: prev_stride must be 1 or 2, got '
                       f'{p.prev_stride}.')

  @classmethod
  def _Plan(cls, p: Params) -> tuple[Params, Params | None, list[Params]]:
    """(base, prev adjustment or None, ops) child Params."""
    cls._Validate(p)
    f = p.filters
    base = rcb(p, 'base', (1, 1, p.input_dim, f))
    prev = None
    if p.prev_stride == 2:
      prev = amoebanet_ops.FactorizedReduceLayer.Params().Set(**shared(
          p, 'prev', input_dim=p.prev_dim, output_dim=f, bn=p.bn.Copy()))
    elif p.prev_dim != f:
      prev = rcb(p, 'prev', (1, 1, p.prev_dim, f))
    ops = [amoebanet_ops.CellOpLayer.Params().Set(**shared(
        p, f'op{i}', op=op, input_dim=f, filters=f, bn=p.bn.Copy(),
        stride=2 if p.reduction and state < 2 else 1))
           for i, (state, op) in enumerate(p.ops)]
    return base, prev, ops

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    base, prev, ops = self._Plan(self.params.Copy().Set(name=self.path))
    self.CreateChild('base', base)
    self._has_prev = prev is not None
    if prev is not None:
      self.CreateChild('prev', prev)
    self.CreateChildren('ops', ops)

  def FProp(self, theta: NestedMap, x: tf.Tensor,
            prev: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    p = self.params
    x = tf.cast(x, self.fprop_dtype)
    states = [self.children.base.FProp(theta.base, x),
              self.children.prev.FProp(theta.prev, prev)
              if self._has_prev else tf.cast(prev, self.fprop_dtype)]
    ops, thetas = self.children.ops, theta.ops
    for j in range(len(p.ops) // 2):
      (ia, _), (ib, _) = p.ops[2 * j], p.ops[2 * j + 1]
      a = ops[2 * j].FProp(thetas[2 * j], states[ia])
      b = ops[2 * j + 1].FProp(thetas[2 * j + 1], states[ib])
      states.append(a + b)
    return tf.concat([states[c] for c in p.concat], axis=-1), x

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape,
                prev: tf.TensorShape) -> LayerMeta:
    base, prev_p, ops = cls._Plan(p)
    x, prev = tf.TensorShape(x), tf.TensorShape(prev)
    metas = [child_meta(base.cls, base, x)]
    metas.append(child_meta(prev_p.cls, prev_p, prev) if prev_p is not None else
                 LayerMeta.build(p, 0, (prev,), 0))
    states = [metas[0].out_shapes[0], metas[1].out_shapes[0]]
    if not states[0].is_compatible_with(states[1]):
      raise LayerError(
          f'{p.name}: x {x} and prev {prev} do not line up (after the '
          f'1×1 and prev adjustment: {states[0]} vs {states[1]}); check '
          'input_dim, prev_dim and prev_stride.')
    adds = 0
    for j in range(len(ops) // 2):
      pair = [child_meta(o.cls, o, states[p.ops[2 * j + k][0]])
              for k, o in enumerate(ops[2 * j:2 * j + 2])]
      if pair[0].out_shapes[0] != pair[1].out_shapes[0]:
        raise LayerError(f'{p.name}: ops {2 * j} and {2 * j + 1} give '
                         f'{pair[0].out_shapes[0]} and {pair[1].out_shapes[0]}'
                         '; the sum needs equal shapes.')
      metas += pair
      states.append(pair[0].out_shapes[0])
      adds += shape_lib.num_elements(states[-1])
    out = states[p.concat[0]][:-1].concatenate([len(p.concat) * p.filters])
    total = sum_metas(metas)
    dtype = p.fprop_dtype or p.dtype
    return LayerMeta(
        flops=total.flops + adds, out_shapes=(out, x),
        param_bytes=total.param_bytes,
        out_bytes=total.out_bytes - metas[1].out_bytes * int(prev_p is None) +
        (adds + shape_lib.num_elements(out)) * dtype.size,
        out_dtypes=(dtype, dtype))


# ---- Stem and head ----------------------------------------------------------
class StemLayer(base_layer.BaseLayer):
  """image → 3×3 conv (SAME, no bias) → BN, returned twice: (x, x)."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 1, 'Image channels.')
    p.Define('filters', 32, 'Output depth.')
    p.Define('stride', 1, '1 for small images, 2 for ImageNet-sized ones.')
    p.Define('bn', batch_norm_template(), BN_DOC)
    return p

  @classmethod
  def _Plan(cls, p: Params) -> Params:
    return rcb(p, 'conv', (3, 3, p.input_dim, p.filters),
               (p.stride, p.stride), relu_first=False)

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('conv', self._Plan(self.params))

  def FProp(self, theta: NestedMap,
            images: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    x = self.children.conv.FProp(theta.conv, images)
    return x, x

  @classmethod
  def FPropMeta(cls, p: Params, images: tf.TensorShape) -> LayerMeta:
    sub = cls._Plan(p).Set(name=f'{p.name}.conv')
    meta = child_meta(amoebanet_ops.ReluConvBnLayer, sub, images)
    return dataclasses.replace(meta, out_shapes=meta.out_shapes * 2,
                               out_dtypes=meta.out_dtypes * 2)


class HeadLayer(base_layer.BaseLayer):
  """(x, prev) → ReLU → global average pool → dropout → FC logits."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the last cell\'s output.')
    p.Define('num_classes', 10, 'Number of classes.')
    p.Define('dropout_rate', 0.0, 'Dropout on the pooled features, in [0, '
             '1) (the reference: 1 − dense_dropout_keep_prob).')
    return p

  @classmethod
  def _Plan(cls, p: Params) -> Params:
    if not 0 <= p.dropout_rate < 1:
      raise LayerError(f'{p.name}: dropout_rate must be in [0, 1), got '
                       f'{p.dropout_rate}.')
    return linear.FCLayer.Params().Set(**shared(
        p, 'logits', input_dim=p.input_dim, output_dim=p.num_classes))

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('logits', self._Plan(self.params))

  def FProp(self, theta: NestedMap, x: tf.Tensor,
            prev: tf.Tensor) -> tf.Tensor:
    del prev  # Only the last cell's output is classified.
    x = tf.nn.relu(tf.cast(x, self.fprop_dtype))
    pooled = tf.reduce_mean(x, axis=[1, 2])  # [B, C]
    pooled = dropout.apply_dropout(pooled, self.params.dropout_rate,
                                   f'{self.path}/dropout')
    return self.children.logits.FProp(theta.logits, pooled)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape,
                prev: tf.TensorShape) -> LayerMeta:
    del prev
    x = tf.TensorShape(x)
    if x.rank != 4:
      raise LayerError(f'{p.name}: expects NHWC features, got {x}.')
    pooled = tf.TensorShape([x[0], x[3]])
    fc = child_meta(linear.FCLayer, cls._Plan(p).Set(name=f'{p.name}.logits'),
               pooled)
    flops = 2 * shape_lib.num_elements(x) + shape_lib.num_elements(pooled) * (
        int(p.dropout_rate > 0))
    return dataclasses.replace(fc, flops=fc.flops + flops)


# ---- The network as a layer list --------------------------------------------
class AmoebaNetError(ValueError):
  """Network Params that cannot make an AmoebaNet; names the key and fix."""


def amoebanet_params() -> Params:
  """Describes AmoebaNet-D(L, D) on one image size (`task.network`)."""
  p = Params()
  p.Define('num_cells', 6, 'L: normal cells in total, L/3 per resolution.')
  p.Define('filters', 16, 'D: filters of each state of a first-group cell '
           '(a normal cell outputs 4·D), doubled per reduction cell.')
  p.Define('num_reduction_cells', 2, 'Reduction cells between the normal '
           'cells (the paper: 2, so 3 resolutions).')
  p.Define('num_stem_cells', 0, 'Reduction cells right after the stem (the '
           'reference\'s ImageNet stem: 2, with stem_stride 2); 0 for small '
           'images.')
  p.Define('stem_filters', 32, 'Depth of the stem conv (reference: 32).')
  p.Define('stem_stride', 1, 'Stride of the stem conv.')
  p.Define('image_shape', (28, 28, 1), 'Input (height, width, channels).')
  p.Define('num_classes', 10, 'Classes of the classifier.')
  p.Define('dropout_rate', 0.0, 'Dropout before the classifier.')
  p.Define('batch_norm', batch_norm_template(), 'Every BatchNorm of the '
           'network: decay, epsilon, stats_dtype (dim is set per use).')
  p.Define('normal_ops', list(AMOEBANET_D_NORMAL), 'Normal cell genotype: '
           '(input state, op) pairs.')
  p.Define('normal_concat', list(AMOEBANET_D_NORMAL_CONCAT), 'States a '
           'normal cell concatenates.')
  p.Define('reduction_ops', list(AMOEBANET_D_REDUCTION), 'Reduction cell '
           'genotype.')
  p.Define('reduction_concat', list(AMOEBANET_D_REDUCTION_CONCAT), 'States '
           'a reduction cell concatenates.')
  return p


def reduction_indices(num_cells: int, num_reductions: int) -> list[int]:
  """Normal-cell indices that a reduction cell precedes (the reference's)."""
  return [int(k / (num_reductions + 1) * num_cells)
          for k in range(1, num_reductions + 1)]


def _check(p: Params) -> int:
  """Validates `p`; returns D, the per-state filters of the first group."""
  n = p.num_stem_cells
  step = 2 ** max(n, 1)  # Stem cell i has D/2^(n−i) filters, and a cell
  if not isinstance(p.filters, int) or p.filters < step or p.filters % step:
    raise AmoebaNetError(  # after a reduction needs an even count.
        f'network.filters (D) = {p.filters!r} with num_stem_cells = {n}: '
        f'must be a positive multiple of {step} (stem cells use D/2^k '
        'filters, a factorized reduction an even count); e.g. 16.')
  if not isinstance(p.num_cells, int) or p.num_cells < (
      p.num_reduction_cells + 1):
    raise AmoebaNetError(
        f'network.num_cells (L) = {p.num_cells!r}: needs ≥ '
        f'num_reduction_cells + 1 = {p.num_reduction_cells + 1} so every '
        'resolution has a normal cell; the paper uses multiples of 3.')
  if len(p.image_shape) != 3:
    raise AmoebaNetError(f'network.image_shape = {p.image_shape!r}: give '
                         '(height, width, channels).')
  return p.filters


def network_layers(p: Params) -> list[InstantiableParams]:
  """[stem, stem cells..., cells..., head]: the pipeline's layer list."""
  f = _check(p)
  layers = [StemLayer.Params().Set(
      name='stem', input_dim=p.image_shape[2], filters=p.stem_filters,
      stride=p.stem_stride, bn=p.batch_norm.Copy())]
  # (depth, stride relative to the next cell's x) of x and prev.
  x_dim, prev_dim, prev_stride = p.stem_filters, p.stem_filters, 1

  def _add(name: str, filters: int, reduction: bool) -> None:
    nonlocal x_dim, prev_dim, prev_stride
    ops = p.reduction_ops if reduction else p.normal_ops
    concat = p.reduction_concat if reduction else p.normal_concat
    layers.append(AmoebaCellLayer.Params().Set(
        name=name, input_dim=x_dim, prev_dim=prev_dim,
        prev_stride=prev_stride, filters=filters, reduction=reduction,
        ops=list(ops), concat=list(concat), bn=p.batch_norm.Copy()))
    prev_dim, x_dim = x_dim, len(concat) * filters
    prev_stride = 2 if reduction else 1

  for i in range(p.num_stem_cells):
    _add(f'stem_cell{i}', f // 2 ** (p.num_stem_cells - i), True)
  reductions = reduction_indices(p.num_cells, p.num_reduction_cells)
  scale = 1
  for i in range(p.num_cells):
    if i in reductions:
      scale *= 2
      _add(f'reduction{reductions.index(i)}', f * scale, True)
    _add(f'cell{i}', f * scale, False)
  layers.append(HeadLayer.Params().Set(
      name='head', input_dim=x_dim, num_classes=p.num_classes,
      dropout_rate=p.dropout_rate))
  return layers
