"""I then W equals the fused backward B (split_backward.py).

The reference is `stage.StageBodies`, the backward every schedule runs
today: R+B in one traced body, or a kept forward's tape. Graph mode runs
the same kernels on the same values, so there the split must agree to
rounding noise (it is bitwise on the machines we ran); eagerly B runs op by
op while the split runs traced, so kernels may round differently.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import pipeline_stacks as stacks
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import embedding
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import transformer
from lingvo_pipe.pipeline import engine
from lingvo_pipe.pipeline import split_graph
from lingvo_pipe.pipeline import stage as stage_lib
from lingvo_pipe.pipeline.split_backward import SplitError, SplitStage
from lingvo_pipe.pipeline.split_backward import layer_bytes
from lingvo_pipe.pipeline.split_backward import num_bytes
from lingvo_pipe.pipeline.stage import Stage

M = 2  # Micro-batches of stacks.BATCH examples.
STEP = 7
TOL = {'graph': 1e-6, 'eager': 1e-5}


def _scope(m, stats, step):
  return fprop_context.scope(
      training=True, step=step, micro_batch_index=m, num_micro_batches=M,
      first_example=m * (stacks.BATCH // M), global_batch_size=stacks.BATCH,
      stats=stats)


@functools.lru_cache(maxsize=None)
def _stages(model):
  """The stacks' K=2 stages (the last one with its loss) and each one's
  input, side input and output gradients for micro-batch 1."""
  net, inputs = stacks.net(model, num_stages=2, num_micro_batches=M)
  first, last = net._Stages(net.theta)  # pylint: disable=protected-access
  last = engine._loss_stage(last, stacks.weighted_loss)  # pylint: disable=protected-access
  x0 = tuple(tf.split(t, M)[1] for t in inputs)
  with _scope(1, None, STEP):
    x1 = first.fprop(first.theta, x0)
  labels = tf.nest.map_structure(lambda t: tf.split(t, M)[1],
                                 stacks.loss_labels(model))
  rng = np.random.RandomState(3)
  dy0 = [tf.constant(rng.randn(*t.shape).astype(np.float32))
         for t in stage_lib.float_leaves(x1)]
  with _scope(1, None, STEP):
    y1 = last.fprop(last.theta, x1, labels)
  dy1 = [tf.ones_like(t) if i == 0 else tf.zeros_like(t)  # d(value·weight).
         for i, t in enumerate(stage_lib.float_leaves(y1))]
  return [(first, x0, None, dy0), (last, x1, labels, dy1)]


_SPLITS = {}


def _split_stage(stage):
  """One SplitStage (one trace) per stage, for every test."""
  return _SPLITS.setdefault(id(stage), SplitStage(stage, _scope))


def _theta(stage):
  return tf.nest.map_structure(tf.convert_to_tensor, stage.theta)


def _fused(stage, theta, x, side, dys, recompute):
  """B as stage.StageBodies runs it: dx, acc + dθ (acc = 1s), y, stats."""
  ops = stage_lib.StageBodies(stage, _scope, stage_lib.Clock(False))
  acc = tf.nest.map_structure(tf.ones_like, theta)
  m, step = tf.constant(1), tf.constant(STEP, tf.int64)
  if recompute:
    y, stats, _ = ops._forward(theta, x, side, [], m, step)  # pylint: disable=protected-access
    dx, grads, _ = ops._backward(theta, x, side, dys, [], m, step, acc)  # pylint: disable=protected-access
  else:
    xk, y, stats, _, tape = ops.kept_forward(theta, x, side, [], m, step)
    dx, grads, _ = ops.kept_backward(tape, theta, xk, y, dys, [], acc)
  return dx, grads, y, stats


def _split(stage, theta, x, side, dys, recompute):
  """The same from the split: forward, I (recomputing or not), W."""
  split = _split_stage(stage)
  acc = tf.nest.map_structure(tf.ones_like, theta)
  y, stats, saved = split.forward(theta, x, side, 1, STEP)
  if recompute:
    dx, kept = split.input_grad(theta, x, side, dys, 1, STEP)
  else:
    dx, kept = split.input_grad_saved(theta, x, side, saved, dys)
  return dx, split.weight_grad(theta, kept, acc), y, stats


def _fused_and_split(stage, theta, x, side, dys):
  """(B, split) with recompute, then without: one trace in graph mode."""
  return [(_fused(stage, theta, x, side, dys, recompute),
           _split(stage, theta, x, side, dys, recompute))
          for recompute in (True, False)]


@pytest.mark.parametrize('mode', ['graph', 'eager'])
@pytest.mark.parametrize('model', sorted(stacks.MODELS))
def test_input_then_weight_equals_fused_backward(model, mode):
  stats = []
  for stage, x, side, dys in _stages(model):
    _both = functools.partial(_fused_and_split, stage, _theta(stage), x,
                              side, dys)
    if mode == 'graph':
      _both = tf.function(_both, autograph=False)
    for recompute, (want, got) in zip((True, False), _both()):
      for name, a, b in zip(('dx', 'dtheta', 'y', 'stats'), got, want):
        diff = stacks.max_rel_diff(a, b)
        assert diff <= TOL[mode], (model, side is not None, recompute, name,
                                   diff)
      stats += tf.nest.flatten(got[3])
  assert bool(stats) == (model == 'conv_bn')  # BatchNorm's sums.


def test_weight_after_other_micro_batches_inputs_in_a_loop():
  """W runs after every micro-batch's I, in reverse order, on kept values
  that crossed tf.while_loop iterations in TensorArrays (no tape can)."""
  stage, x, side, dys = _stages('transformer')[1]
  theta = _theta(stage)
  split = _split_stage(stage)
  xs = [tf.nest.map_structure(lambda t, k=k: t * (1.0 + 0.1 * k), x)
        for k in range(3)]

  @tf.function(autograph=False)
  def _looped():
    traced = split.trace(theta, x, side)
    arrays = [tf.TensorArray(s.dtype, 3, element_shape=s.shape)
              for s in traced.kept_specs]

    def _body(k, arrays):
      xk = tf.nest.map_structure(lambda t: t * (1.0 + 0.1 * tf.cast(
          k, t.dtype)), x)
      _, kept = split.input_grad(theta, xk, side, dys, k % M, STEP)
      return k + 1, [a.write(k, t) for a, t in zip(arrays, kept)]

    _, arrays = tf.while_loop(lambda k, _: k < 3, _body, (0, arrays))
    acc = None
    for k in (2, 1, 0):
      acc = split.weight_grad(theta, [a.read(k) for a in arrays], acc)
    return acc

  ops = stage_lib.StageBodies(stage, _scope, stage_lib.Clock(False))
  acc = tf.nest.map_structure(tf.zeros_like, theta)
  for k in range(3):
    _, acc, _ = ops._backward(theta, xs[k], side, dys, [], tf.constant(k % M),  # pylint: disable=protected-access
                              tf.constant(STEP, tf.int64), acc)
  assert stacks.max_rel_diff(_looped(), acc) <= 1e-5


def test_kept_tensors_are_plain_values():
  """Values, not symbolic tensors of a graph nor variables; the loop test
  above shows they cross iterations, which no tape can."""
  stage, x, side, dys = _stages('conv_bn')[0]
  split = SplitStage(stage, _scope)
  dx, kept = split.input_grad(_theta(stage), x, side, dys, 1, STEP)
  traced = split.trace(_theta(stage), x, side)
  assert len(kept) == len(traced.kept_specs) and len(dx) == 1
  for t, spec in zip(kept, traced.kept_specs):
    assert isinstance(t, tf.Tensor) and not isinstance(t, tf.Variable)
    assert spec.is_compatible_with(t) and t.numpy().size


def _fc_stack(num_layers, width, dtype=None):
  layers = [linear.FCLayer.Params().Set(
      name=f'fc{i}', input_dim=width, output_dim=width, activation='RELU',
      fprop_dtype=dtype).Instantiate() for i in range(num_layers)]

  def _fprop(theta, x):
    x = x[0]
    for layer, th in zip(layers, theta):
      x = layer.FProp(th, x)
    return (x,)
  return Stage(_fprop, [layer.theta for layer in layers], '/device:CPU:0')


def test_kept_bytes_of_an_mlp():
  """Each FC layer keeps its matmul's input and dz (its bias add reads
  dz only): 2·L·B·D floats, traced from specs alone."""
  layers, batch, width = 3, 5, 6
  stage = _fc_stack(layers, width)
  split = SplitStage(stage, _scope)
  traced = split.trace(stage.theta, (tf.TensorSpec([batch, width]),))
  assert traced.split
  assert traced.kept_bytes == 2 * layers * batch * width * 4
  # The forward saves each ReLU's output (ReluGrad) and the first input.
  assert traced.saved_bytes == (layers + 1) * batch * width * 4
  assert num_bytes(traced.kept_specs) == traced.kept_bytes
  # Two signatures traced: W finds its own by what it reads, or is told.
  x = (tf.ones([2, width]),)
  _, kept = split.input_grad(stage.theta, x, None, [tf.ones([2, width])], 0,
                             STEP)
  want = split.weight_grad(stage.theta, kept, x=x)
  assert stacks.max_rel_diff(split.weight_grad(stage.theta, kept), want) == 0
  with pytest.raises(SplitError, match='pass x'):  # Matches neither.
    split.weight_grad(stage.theta, [tf.ones([3, width])] * len(kept))


def test_kept_bytes_of_a_transformer_layer():
  """Per pre-LN encoder layer ([B, T, D] in, hidden H), W reads: each layer
  norm's normalised input and dz (2 × 2·BTD); attention's shared input,
  dz at q, k, v, the context and dz at the projection out (6·BTD); the
  feed-forward's two matmul inputs and dzs (2·BTD + 2·BTH). A bias add's
  dz is its matmul's (a reshape of one buffer counts once)."""
  b, t, d, h = 4, 5, 8, 16
  p = transformer.TransformerEncoderLayer.Params().Set(
      name='enc', input_dim=d, num_heads=2, hidden_dim=h,
      residual_dropout_prob=0.1)
  kept, _ = layer_bytes(p, [tf.TensorSpec([b, t, d]), tf.TensorSpec([b, t])])
  assert kept == (12 * b * t * d + 2 * b * t * h) * 4


def test_layer_bytes_add_up_to_the_stage():
  """What the memory model reads per layer, from Params alone."""
  net, _ = stacks.net('transformer', num_stages=2, num_micro_batches=M)
  stage, x, side, _ = _stages('transformer')[0]
  specs = [tf.TensorSpec(t.shape, t.dtype) for t in x]
  layers = net.params.layers[:len(stage.theta)]
  kept = sum(layer_bytes(p, specs)[0] for p in layers)  # Shapes stay put.
  assert kept == _split_stage(stage).trace(_theta(stage), x, side).kept_bytes


def test_bfloat16_fprop():
  stage = _fc_stack(2, 8, tf.bfloat16)
  theta = _theta(stage)
  x = (tf.random.normal([4, 8]),)
  dys = [tf.cast(tf.random.normal([4, 8]), tf.bfloat16)]
  split = SplitStage(stage, _scope)

  @tf.function(autograph=False)
  def _both():
    dx, kept = split.input_grad(theta, x, None, dys, 0, STEP)
    fused = _fused(stage, theta, x, None, dys, True)
    return (dx, split.weight_grad(theta, kept)), fused[:2]

  (dx, grads), (want_dx, want) = _both()
  assert grads[0].w.dtype == tf.float32
  assert stacks.max_rel_diff(dx, want_dx) == 0.0
  # The fused B adds to acc = 1s, in float32.
  ones = tf.nest.map_structure(tf.ones_like, grads)
  assert stacks.max_rel_diff(tf.nest.map_structure(tf.add, grads, ones),
                             want) <= 1e-6


def _embed_stage(piece):
  """(ids int32, None, weights float) → an embedding, an FC, then
  optionally a piece that runs a function and reads a weight."""
  emb = embedding.EmbeddingLayer.Params().Set(
      name='emb', vocab_size=7, embedding_dim=4).Instantiate()
  fc = linear.FCLayer.Params().Set(name='fc', input_dim=4,
                                   output_dim=4).Instantiate()
  inner = tf.function(lambda h, w: tf.tanh(tf.tensordot(h, w, 1)))

  def _fprop(theta, x):
    ids, none, w = x
    assert none is None
    h = fc.FProp(theta[1], emb.FProp(theta[0], ids)) * w[..., None]
    b, v = theta[1].b, theta[1].w
    if piece == 'cond':
      h = tf.cond(tf.reduce_sum(w) > 0, lambda: h * b, lambda: h - b)
    elif piece == 'while':
      h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (
          i + 1, tf.tanh(tf.tensordot(h, v, 1))), (0, h))[1]
    elif piece == 'call':
      h = inner(h, v)
    return (h,)
  return Stage(_fprop, [emb.theta, fc.theta], '/device:CPU:0')


def _check_against_tape(stage, split):
  theta = _theta(stage)
  x = (tf.constant([[1, 2], [3, 1]]), None, tf.constant([[1., 2.], [.5, 1.]]))
  dys = [tf.random.normal([2, 2, 4])]
  dx, kept = split.input_grad(theta, x, None, dys, 0, STEP)
  assert len(dx) == 1  # The float leaf only.
  got = split.weight_grad(theta, kept)
  with tf.GradientTape() as tape:
    tape.watch(x[2])
    with _scope(0, None, STEP):
      y = stage.fprop(stage.theta, x)[0]
  want_dx, want = tape.gradient(y, (x[2], stage.theta), dys[0])
  assert stacks.max_rel_diff(dx[0], want_dx) <= 1e-6
  assert stacks.max_rel_diff(got, want) <= 1e-6
  return split.trace(theta, x)


@pytest.mark.parametrize('piece', [None, 'cond', 'while', 'call'])
def test_int_and_none_inputs_and_pieces_that_run_a_function(piece):
  """A cond, a loop or a nested function is one op to the split: W re-runs
  that op's backward for its weights' part."""
  stage = _embed_stage(piece)
  traced = _check_against_tape(stage, SplitStage(stage, _scope))
  assert traced.split
  assert [w.split()[0] for w in traced.whole] == {
      None: [], 'cond': ['StatelessIf'], 'while': ['StatelessWhile'],
      'call': ['PartitionedCall']}[piece]


def test_fused_when_an_op_cannot_be_taken_apart(monkeypatch):
  def _fail(op, *_):
    raise split_graph.LocalGradError(f'{op.type} refused')
  monkeypatch.setattr(split_graph, 'local_weight_grads', _fail)
  stage = _embed_stage(None)
  traced = _check_against_tape(stage, SplitStage(stage, _scope))
  assert not traced.split and 'refused' in traced.reason
  # kept is dθ itself: the embedding table and the FC's weights.
  assert traced.kept_bytes == (7 * 4 + 4 * 4 + 4) * 4
