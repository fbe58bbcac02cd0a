"""AmoebaNet layers keep the layer contract; the network pipelines exactly.

The partitioner cuts the network by FPropMeta's flops and the pipeline checks
real shapes against FPropMeta's, so every cell-level layer goes through the
layer-library conformance checker (shapes, parameter bytes, flops linear in
the batch, stateless training FProp, Params text round trip), the whole
network's FPropMeta is compared with a real forward pass, and the pipelined
network's gradients are compared with the unpipelined ones.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import transparency
from lingvo_pipe.layers import sequential
from lingvo_pipe.tasks.image import amoebanet
from lingvo_pipe.tasks.image import amoebanet_ops

sys.path.insert(0, os.path.abspath(os.path.join(
    os.path.dirname(__file__), '..', '..', 'layers')))  # The layer suite.
from test_conformance import check_layer  # pylint: disable=g-import-not-at-top

S = tf.TensorShape


def _rcb(shape, stride=(1, 1), **kwargs):
  return amoebanet_ops.ReluConvBnLayer.Params().Set(
      name='rcb', filter_shape=shape, filter_stride=stride, **kwargs)


def _op(op, cin, f, stride):
  return amoebanet_ops.CellOpLayer.Params().Set(
      name=op, op=op, input_dim=cin, filters=f, stride=stride)


def _cell(**kwargs):
  return amoebanet.AmoebaCellLayer.Params().Set(name='cell', **kwargs)


_D = dict(ops=list(amoebanet.AMOEBANET_D_REDUCTION),
          concat=list(amoebanet.AMOEBANET_D_REDUCTION_CONCAT))
_SEP = dict(ops=[(0, 'sep_3x3'), (1, 'sep_5x5'), (2, 'sep_7x7'), (0, 'none')],
            concat=[2, 3])
_SAMPLES = [
    (amoebanet_ops.ReluConvBnLayer, _rcb((1, 1, 3, 4)), [[2, 5, 5, 3]]),
    (amoebanet_ops.ReluConvBnLayer,
     _rcb((3, 3, 4, 6), (2, 2), separable=True), [[2, 7, 7, 4]]),
    (amoebanet_ops.ReluConvBnLayer,
     _rcb((1, 7, 4, 4), (1, 2), relu_first=False), [[2, 7, 7, 4]]),
    (amoebanet_ops.FactorizedReduceLayer,
     amoebanet_ops.FactorizedReduceLayer.Params().Set(
         name='fr', input_dim=3, output_dim=4), [[2, 7, 7, 3]]),
    (amoebanet.StemLayer, amoebanet.StemLayer.Params().Set(
        name='stem', input_dim=1, filters=4, stride=2), [[2, 9, 9, 1]]),
    (amoebanet.HeadLayer, amoebanet.HeadLayer.Params().Set(
        name='head', input_dim=6, num_classes=3, dropout_rate=0.3),
     [[4, 3, 3, 6], [4, 3, 3, 2]]),
    # A normal cell right after a reduction (prev at twice the resolution).
    (amoebanet.AmoebaCellLayer, _cell(input_dim=6, prev_dim=4, prev_stride=2,
                                      filters=4), [[2, 4, 4, 6], [2, 7, 7, 4]]),
    (amoebanet.AmoebaCellLayer, _cell(input_dim=8, prev_dim=8, filters=4,
                                      reduction=True, **_D),
     [[2, 5, 5, 8], [2, 5, 5, 8]]),
    (amoebanet.AmoebaCellLayer, _cell(input_dim=4, prev_dim=4, filters=4,
                                      **_SEP), [[2, 5, 5, 4], [2, 5, 5, 4]]),
] + [(amoebanet_ops.CellOpLayer, _op(op, cin, 8, stride), [[2, 6, 6, cin]])
     for op, cin, stride in [
         ('none', 8, 1), ('none', 4, 2), ('conv_1x1', 4, 1),
         ('conv_3x3', 8, 2), ('conv_1x7_7x1', 4, 2), ('sep_3x3', 8, 1),
         ('sep_7x7', 4, 2), ('avg_pool_3x3', 8, 2), ('max_pool_3x3', 4, 1),
         ('max_pool_2x2', 8, 2)]]


@pytest.mark.parametrize(
    'cls, p, shapes', _SAMPLES,
    ids=[f'{c.__name__}-{p.name}-{i}' for i, (c, p, _) in enumerate(_SAMPLES)])
def test_layer_conforms(cls, p, shapes):
  check_layer(cls, p, shapes, has_compute=not (
      cls is amoebanet_ops.CellOpLayer and p.op == 'none' and p.stride == 1))


def test_every_op_is_sampled():
  sampled = {p.op for c, p, _ in _SAMPLES if c is amoebanet_ops.CellOpLayer}
  assert sampled | {'sep_5x5'} == set(amoebanet_ops.OPS)  # 5x5: in _SEP.


def test_relu_conv_bn_flops_match_a_hand_count():
  b, h, w, cin, cout = 2, 5, 5, 3, 4
  meta = amoebanet_ops.ReluConvBnLayer.FPropMeta(
      _rcb((1, 1, cin, cout)), S([b, h, w, cin]))
  relu, conv, bn = b * h * w * cin, 2 * b * h * w * cin * cout, b * h * w * cout
  assert meta.flops == relu + conv + bn
  assert meta.param_bytes == 4 * (cin * cout + 4 * cout)


@pytest.mark.parametrize('reduction, out', [(False, [2, 6, 6, 16]),
                                            (True, [2, 3, 3, 12])])
def test_amoebanet_d_cells_concatenate_four_and_three_states(reduction, out):
  ops = _D if reduction else {}
  p = _cell(input_dim=8, prev_dim=8, filters=4, reduction=reduction, **ops)
  meta = amoebanet.AmoebaCellLayer.FPropMeta(p, S([2, 6, 6, 8]),
                                             S([2, 6, 6, 8]))
  assert [s.as_list() for s in meta.out_shapes] == [out, [2, 6, 6, 8]]


def _net(**kwargs):
  return amoebanet.amoebanet_params().Set(**kwargs)


def test_network_layout_follows_the_reference():
  names = [p.name for p in amoebanet.network_layers(_net(num_cells=6))]
  assert names == ['stem', 'cell0', 'cell1', 'reduction0', 'cell2', 'cell3',
                   'reduction1', 'cell4', 'cell5', 'head']
  assert amoebanet.reduction_indices(18, 2) == [6, 12]


@pytest.mark.parametrize('net, image', [
    (_net(num_cells=3, filters=4, stem_filters=4, image_shape=(10, 10, 1)),
     [3, 10, 10, 1]),
    (_net(num_cells=3, filters=8, stem_filters=4, num_stem_cells=2,
          stem_stride=2, image_shape=(19, 19, 3), num_classes=5),
     [3, 19, 19, 3]),
])
def test_network_fpropmeta_matches_a_real_forward_pass(net, image):
  layers = amoebanet.network_layers(net)
  metas = gpipe.layer_metas(layers, [image])
  model = sequential.SequentialLayer.Params().Set(
      name='net', sub=layers).Instantiate()
  x = (tf.constant(np.random.default_rng(0).normal(size=image), tf.float32),)
  for layer, theta, meta in zip(model.children.sub, model.theta.sub, metas):
    x = layer.FProp(theta, *x)
    x = x if isinstance(x, tuple) else (x,)
    assert [t.shape.as_list() for t in x] == [
        s.as_list() for s in meta.out_shapes], layer.path
    real = sum(v.shape.num_elements() * 4 for v in layer.variables)
    assert meta.param_bytes == real, layer.path
  assert x[0].shape.as_list() == [image[0], net.num_classes]


@pytest.mark.parametrize('num_cells, filters, paper_params', [
    (18, 208, 82e6), (18, 416, 318e6)])
def test_l_d_reading_gives_the_gpipe_paper_parameter_counts(
    num_cells, filters, paper_params):
  # GPipe (Huang et al. 2019), Table 1: AmoebaNet-D(18, 208) has 82M and
  # (18, 416) 318M parameters (ImageNet: 224×224×3 inputs, 1000 classes).
  # Guards the reading of (L, D) in amoebanet's docstring.
  net = _net(num_cells=num_cells, filters=filters, num_stem_cells=2,
             stem_stride=2, stem_filters=filters // 4,
             image_shape=(224, 224, 3), num_classes=1000)
  metas = gpipe.layer_metas(amoebanet.network_layers(net), [[1, 224, 224, 3]])
  count = sum(m.param_bytes for m in metas) / 4
  assert abs(count / paper_params - 1) < 0.02


def test_pipelined_gradients_equal_unpipelined():
  # float64: in float32 the pipelined and the reference gradients differ by
  # rounding (~1e-4 relative on a BN scale whose gradient nearly cancels),
  # which would hide a real difference of that size.
  net = _net(num_cells=2, num_reduction_cells=1, filters=4, stem_filters=4,
             image_shape=(8, 8, 1))  # stem, cell, reduction, cell, head.
  layers = [p.Set(dtype=tf.float64) for p in amoebanet.network_layers(net)]
  p = gpipe.PipeliningLayer.Params().Set(
      name='amoebanet', layers=layers, num_stages=2, num_micro_batches=2,
      recompute='always', input_shapes=[[4, 8, 8, 1]], dtype=tf.float64)
  images = tf.constant(np.random.default_rng(1).normal(size=[4, 8, 8, 1]),
                       tf.float64)
  labels = tf.constant([0, 3, 9, 3])
  report = transparency.check_transparency(
      p, (images,), micro_batched_reference=True,
      loss_fn=lambda logits: tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)))
  assert report.ok(1e-9), str(report)


@pytest.mark.parametrize('make, match', [
    (lambda: _op('conv_9x9', 4, 4, 1).Instantiate(), "unknown op 'conv_9x9'"),
    (lambda: _cell(input_dim=4, prev_dim=4, filters=4, reduction=True,
                   ops=list(_D['ops']), concat=[0, 4]).Instantiate(),
     'cannot concatenate its full-resolution inputs'),
    (lambda: _cell(input_dim=4, prev_dim=4, filters=4,
                   ops=[(0, 'none'), (3, 'none')], concat=[2]).Instantiate(),
     r'ops\[1\] = \(3, .none.\).*0 ≤ state < 2'),
    (lambda: amoebanet.network_layers(_net(filters=6, num_stem_cells=2)),
     r'network.filters \(D\) = 6.*multiple of 4'),
    (lambda: amoebanet.network_layers(_net(num_cells=2)),
     r'network.num_cells \(L\) = 2: needs ≥ num_reduction_cells \+ 1 = 3'),
])
def test_bad_params_name_the_key_and_fix(make, match):
  with pytest.raises((base_layer.LayerError, amoebanet.AmoebaNetError),
                     match=match):
    make()
