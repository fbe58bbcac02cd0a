"""Transparency: the pipelined model trains exactly like the unpipelined one.

The reference runs the very same layer objects one after another under a
plain `tf.GradientTape`, one micro-batch at a time, with gradients summed —
no partitioner, no custom gradient, no recompute. Pipelined loss, outputs,
gradients and BatchNorm statistics must match it for every K, M and
recompute policy: 1e-5 relative, or, where this CPU's float32 kernels round
the reference itself further from a float64 run of it, as close to float64
as the reference is (`transparency.Discrepancy.ok`).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import timeline
from lingvo_pipe.pipeline import transparency
from lingvo_pipe.layers import embedding
from lingvo_pipe.layers import linear

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order


# Every (model, K, M) runs eagerly (the same builder code, stage functions
# and custom gradient; cheap to run), the recompute policy rotating so that
# each policy meets every model and K (LINGVO_PIPE_FULL_MATRIX=1: every
# policy everywhere; the whole product took 4 of CI's 30 minutes); a subset
# also runs under tf.function, where Grappler and the dataflow executor get
# their say.
_FULL = os.environ.get('LINGVO_PIPE_FULL_MATRIX') == '1'
CASES = [(model, k, m, r, 'eager')
         for i, model in enumerate(stacks.MODELS)
         for j, (k, m) in enumerate(itertools.product((1, 2, 4), (1, 2, 4, 8)))
         for r in (stacks.POLICIES if _FULL else
                   [stacks.POLICIES[(i + j) % len(stacks.POLICIES)]])]
CASES += [(model, k, m, r, 'graph') for model in stacks.MODELS
          for k, m, r in ((2, 4, 'except_last'), (2, 2, 'never'),
                          (4, 8, 'always'), (2, 4, 'needed'))]
# Stage bodies inlined at run time (stage processes do it by default).
CASES += [(model, k, m, r, 'graph-inlined') for model in stacks.MODELS
          for k, m, r in ((2, 4, 'always'), (4, 8, 'needed'))]


@pytest.mark.parametrize(
    'model,num_stages,num_micro_batches,recompute,mode', CASES)
def test_pipelined_equals_unpipelined(model, num_stages, num_micro_batches,
                                      recompute, mode):
  net, inputs = stacks.net(model, num_stages=num_stages,
                     num_micro_batches=num_micro_batches, recompute=recompute,
                     inline_stage_calls=mode == 'graph-inlined')
  twin = stacks.float64_twin(net).children.layers
  run = lambda: stacks.pipelined(net, inputs)
  ref = lambda: stacks.reference(net, inputs, num_micro_batches)
  exact = lambda: stacks.reference(net, inputs, num_micro_batches, layers=twin)
  if mode.startswith('graph'):
    run = tf.function(run)
    if model == 'conv_bn':
      # BatchNorm over micro-batches of 1–2 examples amplifies the rounding
      # difference between Grappler-rewritten and eager arithmetic to ~3e-5;
      # a graph reference sees the same rewrites.
      ref = tf.function(ref)
  got, want, want64 = run(), ref(), exact()
  assert sorted(got[3]) == sorted(want[3]) == sorted(want64[3])
  for name, i in (('loss', 0), ('outputs', 1), ('gradients', 2),
                  ('statistics', 3)):
    pick = ((lambda r: [r[3][k] for k in sorted(r[3])]) if i == 3 else
            (lambda r, i=i: r[i]))
    d = transparency.discrepancy(pick(got), pick(want), pick(want64))
    assert d.ok(), f'{name}: {d}'


def test_batch_norm_counts_every_example_once():
  net, inputs = stacks.net('conv_bn', num_stages=4, num_micro_batches=4)
  stats = tf.function(lambda: stacks.pipelined(net, inputs)[3])()
  assert sorted(stats) == ['net.bn0', 'net.bn1']
  # bn0 sees 8×8 positions of every example, bn1 4×4 (after stride 2).
  assert float(stats['net.bn0'].count) == stacks.BATCH * 8 * 8
  assert float(stats['net.bn1'].count) == stacks.BATCH * 4 * 4


def test_dropout_mask_is_the_same_in_forward_and_recompute():
  # With rate 0.3 in front of the FC, a recompute that redrew the mask would
  # give the FC weight a gradient of a different function than the loss.
  net, inputs = stacks.net('conv_bn', num_stages=2, num_micro_batches=2,
                     recompute='always')
  got = stacks.pipelined(net, inputs, step=3)
  want = stacks.reference(net, inputs, 2, step=3)
  assert stacks.max_rel_diff(got[2], want[2]) < 1e-5
  other_step = stacks.reference(net, inputs, 2, step=4)
  assert stacks.max_rel_diff(got[1], other_step[1]) > 1e-3  # Masks do change by step.


def test_initial_weights_do_not_depend_on_stages_or_micro_batches():
  nets = [stacks.net('transformer', num_stages=k, num_micro_batches=m)[0]
          for k, m in ((1, 1), (2, 4), (4, 8))]
  for other in nets[1:]:
    assert stacks.max_rel_diff(other.theta, nets[0].theta) == 0.0


def test_explicit_split_points_and_auto_partition():
  net, _ = stacks.net('nested', num_stages=3, split_points=[1, 5])
  assert net.boundaries == [0, 1, 5, 6]
  auto, _ = stacks.net('nested', num_stages=3)
  assert auto.boundaries[0] == 0 and auto.boundaries[-1] == 6
  assert len(auto.report.stages) == 3
  # Variables live on their stage's device.
  assert 'CPU:1' in net.theta.layers[1].fc.w.device
  assert 'CPU:2' in net.theta.layers[5].fc.w.device


def test_inference_runs_whole_batch_stage_by_stage():
  net, inputs = stacks.net('transformer', num_stages=2, num_micro_batches=4)
  out = net.FProp(net.theta, *inputs)
  x = inputs
  for layer, theta in zip(net.children.layers, net.theta.layers):
    x = layer.FProp(theta, *x)
  assert stacks.max_rel_diff(out, x) == 0.0


@pytest.mark.parametrize('value', ['yes', 1])
def test_bad_inline_stage_calls_is_named(value):
  with pytest.raises(ValueError, match=rf'net: inline_stage_calls={value!r}; '
                     'use None'):
    stacks.net('nested', num_stages=2, inline_stage_calls=value)


@pytest.mark.parametrize('kw,match', [
    (dict(num_stages=2, num_micro_batches=3), 'not divisible by'),
    (dict(num_stages=2, num_micro_batches=16), 'exceeds the batch size'),
])
def test_bad_micro_batching_is_named(kw, match):
  net, inputs = stacks.net('nested', **kw)
  with pytest.raises(ValueError, match=match):
    stacks.pipelined(net, inputs)


def test_bad_stage_and_device_counts_are_named():
  with pytest.raises(ValueError, match='num_stages=7 but there are 6 layers'):
    stacks.net('nested', num_stages=7)
  layers, shapes, _ = stacks.nested_stack()
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, input_shapes=shapes, num_stages=3,
      devices=stacks.DEVICES[:2])
  with pytest.raises(ValueError, match='3 stages but only 2 devices'):
    p.Instantiate()
  # Soft placement would silently run a missing device's stage elsewhere.
  p.devices = stacks.DEVICES[:2] + ['/device:CPU:9']
  with pytest.raises(RuntimeError, match=r"devices\[2\]='/device:CPU:9' "
                     'does not exist'):
    p.Instantiate()


def test_shape_mismatch_between_layers_is_named():
  layers = [linear.FCLayer.Params().Set(name='fc0', input_dim=4,
                                        output_dim=4),
            linear.FCLayer.Params().Set(name='fc1', input_dim=5,
                                        output_dim=3)]
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, input_shapes=[[stacks.BATCH, 4]], num_stages=2,
      devices=stacks.DEVICES)
  with pytest.raises(ValueError, match=r'net.layers\[1\] \(FCLayer'):
    p.Instantiate()


def test_fprop_meta_of_whole_pipeline_sums_layers():
  layers, shapes, _ = stacks.conv_bn_stack()
  p = gpipe.PipeliningLayer.Params().Set(name='net', layers=layers)
  meta = gpipe.PipeliningLayer.FPropMeta(p, *base_layer.as_shape(shapes))
  metas = gpipe.layer_metas(layers, shapes)
  assert meta.flops == sum(m.flops for m in metas)
  assert meta.out_shapes == metas[-1].out_shapes
  assert meta.out_shapes[0].as_list() == [stacks.BATCH, 3]


@pytest.mark.parametrize('loop', [False, True])
def test_timeline_does_not_serialise_the_stages(loop):
  # Regression: tf.timestamp() made the stage calls stateful, and
  # tf.function's automatic control dependencies then chained every call in
  # program order — stage 1 could not start before stage 0 had finished.
  # Recorded steps loop over their steady state too: the same holds inside
  # each loop body.
  net, inputs = stacks.net('nested', num_stages=2, num_micro_batches=8,
                           loop_steady_state=loop)

  @tf.function
  def _step():
    sink = []
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=1, timeline=sink):
        loss = stacks.square_loss(net.FProp(net.theta, *inputs))
    tape.gradient(loss, net.theta)
    return timeline.stamps(sink)[1]

  graph = _step.get_concrete_function().graph
  graphs = [graph] + [
      graph._get_function(op.get_attr('body').name).graph  # pylint: disable=protected-access
      for op in graph.get_operations() if op.type in ('While',
                                                      'StatelessWhile')]
  assert (len(graphs) > 1) == loop
  calls = [op for g in graphs for op in g.get_operations()
           if 'PartitionedCall' in op.type and '/stage' in '/' + op.name]
  if not loop:  # (forward, backward) per stage, micro-batch.
    assert len(calls) == 2 * 8 * 2, [op.name for op in calls]
  for op in calls:
    for dep in op.control_inputs:
      assert 'PartitionedCall' not in dep.type, (op.name, dep.name)


def test_integer_inputs_and_sparse_gradients():
  # Regression: the gradient of an int input is None, which the micro-batch
  # concat choked on; an embedding's gradient is IndexedSlices.
  layers = [embedding.EmbeddingLayer.Params().Set(
                name='emb', vocab_size=11, embedding_dim=4),
            linear.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=3)]
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=2, num_micro_batches=4,
      input_shapes=[[stacks.BATCH, 3]], devices=stacks.DEVICES)
  ids = tf.constant(np.random.RandomState(2).randint(0, 11, [stacks.BATCH, 3]),
                    tf.int32)
  report = transparency.check_transparency(p, (ids,), step=1)
  assert report.ok(), report


def _matmuls_by_device(graph: tf.Graph) -> dict[str, int]:
  """MatMuls in `graph` and the functions it calls, by effective device
  (an op's own device, else the device of the call that runs it)."""
  graph_def = graph.as_graph_def()
  library = {f.signature.name: f for f in graph_def.library.function}
  counts: dict[str, int] = {}

  def _walk(nodes, device: str) -> None:
    for node in nodes:
      placed = node.device or device
      if node.op == 'MatMul':
        counts[placed] = counts.get(placed, 0) + 1
      callee = (node.attr['f'].func.name if 'f' in node.attr else
                node.op if node.op in library else '')
      if callee:
        _walk(library[callee].node_def, placed)

  _walk(graph_def.node, '')
  return counts


@pytest.mark.parametrize('recompute', stacks.POLICIES)
def test_forward_recompute_and_backward_run_on_the_stage_device(recompute):
  # The trap: one tape over every stage puts all backward matmuls on the
  # first device. Each stage's 2 layers × M=2 micro-batches must have their
  # forward (1 MatMul), recompute (1, if any) and backward (2: dx, dw) on
  # that stage's device, and nothing anywhere else.
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
                                        output_dim=8, activation='RELU')
            for i in range(4)]
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=2, split_points=[2],
      num_micro_batches=2, recompute=recompute, devices=stacks.DEVICES[:2])
  net = p.Instantiate()
  x = tf.ones([4, 8])

  @tf.function
  def _step():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        loss = tf.reduce_sum(tf.square(net.FProp(net.theta, x)))
    return tape.gradient(loss, net.trainable_variables)

  counts = _matmuls_by_device(_step.get_concrete_function().graph)
  # Per stage, the micro-batches that recompute: 'needed' keeps the last
  # one's forward (its recompute would directly follow it).
  recomputes = {'always': (2, 2), 'needed': (1, 1), 'except_last': (2, 0),
                'never': (0, 0)}
  expected = {stacks.DEVICES[k]: 2 * (2 * 3 + recomputes[recompute][k])
              for k in range(2)}
  assert counts == expected


# ---- None leaves -------------------------------------------------------------
class _VecLayer(base_layer.BaseLayer):
  """NestedMap(vec, paddings=None) → NestedMap(tanh(fc(vec)), paddings)."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('fc', linear.FCLayer.Params().Set(
        input_dim=4, output_dim=4, activation='TANH'))

  def FProp(self, theta, m):
    if m.paddings is not None:  # The layer must get the None itself.
      raise TypeError(f'{self.path}: paddings={m.paddings!r}, not None')
    vec = tf.cast(m.vec, self.fprop_dtype)  # As library layers do.
    return NestedMap(vec=self.children.fc.FProp(theta.fc, vec),
                     paddings=m.paddings)

  @classmethod
  def FPropMeta(cls, p, m):
    return base_layer.LayerMeta.build(
        p, flops=2 * m.vec.num_elements() * 4, out_shapes=(m,),
        num_params=20)


def _none_leaf_loss(out, labels):
  """A weighted mean over examples; `labels` has a None leaf too."""
  assert labels.unused is None and out.paddings is None
  per = tf.reduce_sum(tf.square(out.vec) + out.vec, axis=1)
  w = tf.cast(labels.w, per.dtype)
  return {'loss': (tf.reduce_sum(per * w) / tf.reduce_sum(w),
                   tf.reduce_sum(w))}


@pytest.mark.parametrize('method, schedule', [
    ('FProp', 'gpipe'), ('FPropLoss', 'gpipe'), ('FPropLoss', '1f1b')])
def test_none_leaves_pass_through_every_stage(method, schedule):
  # Issue 29: Lingvo's gpipe_test.testDummyPipelineCnnNestedMapInput trains
  # on NestedMap(vec=x, paddings=None); here the None was taken for an input
  # tensor ("input leaf 0 has shape ()"), and a tf.custom_gradient cannot
  # take it as an argument. It must reach every layer and the loss as None.
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', num_stages=2, num_micro_batches=8, schedule=schedule,
      layers=[_VecLayer.Params().Set(name=f'v{i}') for i in range(4)],
      input_shapes=[NestedMap(vec=[stacks.BATCH, 4], paddings=None)],
      devices=stacks.DEVICES)
  net = p.Instantiate()
  twin = stacks.float64_twin(net)
  rng = np.random.RandomState(3)
  x = NestedMap(vec=tf.constant(rng.randn(stacks.BATCH, 4), tf.float32),
                paddings=None)
  labels = NestedMap(w=tf.constant(rng.uniform(0.5, 2, stacks.BATCH),
                                   tf.float32), unused=None)

  @tf.function
  def _pipelined():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=1):
        if method == 'FProp':
          out = net.FProp(net.theta, x)
          loss = _none_leaf_loss(out, labels)['loss'][0]
        else:
          loss = net.FPropLoss(net.theta, (x,), labels,
                               _none_leaf_loss)['loss'][0]
    return loss, tape.gradient(loss, net.theta)

  def _reference(layers):
    with tf.GradientTape() as tape:
      m = x
      for layer, theta in zip(layers, net.theta.layers):
        m = layer.FProp(theta, m)
      loss = _none_leaf_loss(m, labels)['loss'][0]
    return loss, tape.gradient(loss, net.theta)

  got = _pipelined()
  want, want64 = _reference(net.children.layers), _reference(
      twin.children.layers)
  for name, i in (('loss', 0), ('gradients', 1)):
    d = transparency.discrepancy(got[i], want[i], want64[i])
    assert d.ok(), f'{name}: {d}'
