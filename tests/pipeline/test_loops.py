"""Loops over the steady state: the same step, a graph that does not grow with M.

`loops.plan` cuts a schedule's emission order into ops emitted one by one
and `tf.while_loop`s over its periodic runs. Unrolled, the plan must be
exactly the emission order; the ops left outside loops must not grow with
M; 1F1B's loops must carry no more micro-batches than a stage holds; and a
step emitted with loops must compute what the step emitted op by op does
(the transparency tests of test_gpipe and test_fprop_loss run with loops
too, against an unpipelined reference).
"""

from __future__ import annotations

import itertools

import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import linear
from lingvo_pipe.pipeline import engine
from lingvo_pipe.pipeline import loops
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import executor
from lingvo_pipe.pipeline.stage import Stage

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order

LOOPED = ('always', 'needed', 'except_last')


def _plan(name: str, k: int, m: int, recompute: str,
          seeds: bool = False) -> tuple[list, list[loops.Segment], loops.IO]:
  """(emission order, plan, what each action reads and writes) as the
  engine's executor makes them."""
  schedule = schedule_lib.make_schedule(
      name, k, m, recompute, 2 if name == 'interleaved' else 1)
  order = schedule_lib.emission_order(schedule)
  last = schedule.num_stages - 1
  final = ([('y', last, i) for i in range(m)] +
           [('dx', 0, i) for i in range(m)])
  segments = loops.plan(schedule, order, final, executor.MIN_LOOP_ITERATIONS,
                        executor.LOOP_UNROLL, seeded=seeds)
  return order, segments, loops.io_of(schedule, seeds)


def _unrolled(segments: list[loops.Segment]) -> list:
  ops = []
  for seg in segments:
    if isinstance(seg, loops.Loop):
      ops += [(d, op._replace(micro_batch=seg.micro_batch(op.micro_batch, i)))
              for i in seg.iterations() for d, op in seg.ops]
    else:
      ops += seg
  return ops


def _plain(segments: list[loops.Segment]) -> int:
  return sum(len(s) for s in segments if not isinstance(s, loops.Loop))


@pytest.mark.parametrize('name,k,m,recompute', list(itertools.product(
    ('gpipe', '1f1b', 'interleaved'), (1, 2, 4), (4, 8, 16, 64),
    stacks.POLICIES)))
def test_plan_unrolled_is_the_emission_order(name, k, m, recompute):
  order, segments, _ = _plan(name, k, m, recompute)
  assert _unrolled(segments) == order


@pytest.mark.parametrize('name,k,recompute', [
    (n, k, r) for n, k, r in itertools.product(('gpipe', '1f1b'), (1, 2, 4),
                                               LOOPED)
    # A kept stage's tapes cannot cross from GPipe's forward loop to its
    # backward one (nor can K=1's, whose one stage is the last).
    if r != 'except_last' or (n, k) not in (('gpipe', 2), ('gpipe', 4),
                                            ('gpipe', 1), ('1f1b', 1))])
def test_ops_outside_loops_do_not_grow_with_m(name, k, recompute):
  _, at16, _ = _plan(name, k, 16, recompute)
  _, at64, _ = _plan(name, k, 64, recompute)
  assert any(isinstance(s, loops.Loop) for s in at64)
  assert _plain(at64) == _plain(at16)


@pytest.mark.parametrize('k,recompute', list(itertools.product((2, 3, 4), LOOPED)))
def test_one_f_one_b_loops_carry_at_most_k_micro_batches(k, recompute):
  # Stage s holds K − s saved inputs in 1F1B's steady state; the loop's
  # delay lines hold no more, so its memory bound stays.
  _, segments, _ = _plan('1f1b', k, 32, recompute)
  for loop in (s for s in segments if isinstance(s, loops.Loop)):
    for (family, stage), length in loop.delays.items():
      if family == 'x':
        assert length <= k - stage, (stage, loop.delays)
    assert not any(f[0] == 'x' for f in loop.arrays), loop.arrays


@pytest.mark.parametrize('name,recompute', list(itertools.product(
    ('gpipe', '1f1b'), stacks.POLICIES)))
def test_a_tape_never_leaves_its_iteration(name, recompute):
  for k in (1, 2, 4):
    _, segments, io = _plan(name, k, 16, recompute)
    for loop in (s for s in segments if isinstance(s, loops.Loop)):
      made = {key for d, op in loop.ops for key in io(d, op)[1]
              if key[0] == 'tape'}
      read = {key for d, op in loop.ops for key in io(d, op)[0]
              if key[0] == 'tape'}
      assert made == read


def _step(model: str, schedule: str, form: str, m: int, recompute: str,
          loop: bool):
  net, inputs = stacks.net(model, num_stages=2, num_micro_batches=m,
                           recompute=recompute, schedule=schedule,
                           loop_steady_state=loop)
  if form == 'FProp':
    return net, tf.function(lambda: stacks.pipelined(net, inputs))
  labels = stacks.loss_labels(model)

  def _run():
    collector = fprop_context.StatsCollector()
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=7, stats=collector):
        metrics = net.FPropLoss(net.theta, inputs, labels,
                                stacks.weighted_loss)
    grads = tape.gradient(metrics['loss'][0], net.theta)
    return metrics, grads, collector.stats
  return net, tf.function(_run)


# Each model in each form once, the policy alternating (both policies meet
# every model and form; the product cost 2 minutes of CI).
@pytest.mark.parametrize('model,schedule,form,recompute', [
    (model, s, f, ('always', 'needed')[(i + j) % 2])
    for i, model in enumerate(stacks.MODELS)
    for j, (s, f) in enumerate((('gpipe', 'FProp'), ('gpipe', 'FPropLoss'),
                                ('1f1b', 'FPropLoss')))])
def test_looped_step_equals_step_emitted_op_by_op(model, schedule, form,
                                                  recompute):
  results = []
  for loop in (True, False):
    _, step = _step(model, schedule, form, 8, recompute, loop)
    graph = step.get_concrete_function().graph
    has_loop = any(op.type in ('While', 'StatelessWhile')
                   for op in graph.get_operations())
    assert has_loop == loop
    results.append(step())
  looped, unrolled = (tf.nest.flatten(r) for r in results)
  assert len(looped) == len(unrolled)
  assert stacks.max_rel_diff(looped, unrolled) <= 1e-6


def _fc_step(schedule: str, form: str, m: int, loop: bool):
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=4,
                                        output_dim=4, activation='TANH')
            for i in range(4)]  # K=2 × 2 chunks for 'interleaved'.
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=2, num_micro_batches=m,
      schedule=schedule, devices=stacks.DEVICES[:2], input_shapes=[[64, 4]],
      loop_steady_state=loop).Instantiate()
  # Distinct micro-batches: a loop that read the wrong one must show.
  x = tf.random.stateless_normal([64, 4], [1, 2])
  labels = tf.random.stateless_normal([64], [3, 4])

  @tf.function(autograph=False)
  def _step():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        if form == 'FProp':
          loss = tf.reduce_sum(net.FProp(net.theta, x))
        else:
          loss = net.FPropLoss(net.theta, (x,), labels, lambda y, w: {
              'loss': (tf.reduce_mean(tf.square(y - w[:, None])),
                       tf.cast(tf.size(w), tf.float32))})['loss'][0]
    return tape.gradient(loss, net.trainable_variables)
  return _step


@pytest.mark.parametrize('schedule,form', [
    ('gpipe', 'FProp'), ('gpipe', 'FPropLoss'), ('1f1b', 'FPropLoss')])
def test_graph_size_does_not_grow_with_m(schedule, form):
  sizes = {}
  for loop, m in itertools.product((True, False), (8, 32)):
    graph = _fc_step(schedule, form, m, loop).get_concrete_function().graph
    sizes[(loop, m)] = len(graph.get_operations())
  # Emitted op by op, each micro-batch adds its ops; with loops only the
  # per-micro-batch reads of the step's outputs remain.
  grown = sizes[(False, 32)] - sizes[(False, 8)]
  assert grown > 500, sizes
  assert sizes[(True, 32)] - sizes[(True, 8)] <= 0.2 * grown, sizes


@pytest.mark.parametrize('schedule', ['interleaved', '1f1b'])
def test_looped_and_op_by_op_fc_steps_agree_at_m16(schedule):
  # The interleaved schedule's period shifts micro-batches by K, and needs
  # M = 16 at K = 2 for a loop.
  grads = []
  for loop in (True, False):
    step = _fc_step(schedule, 'FPropLoss', 16, loop)
    graph = step.get_concrete_function().graph
    assert loop == any(op.type in ('While', 'StatelessWhile')
                       for op in graph.get_operations())
    grads.append(step())
  assert stacks.max_rel_diff(*grads) <= 1e-6


_CALLS = ('PartitionedCall', 'StatefulPartitionedCall')


def _loop_bodies(stages: list[Stage], schedule) -> list:
  """The loop bodies (FunctionDefs) of a traced step of `stages` (a batch
  of 16) under `schedule`; at least one."""

  @tf.function
  def _step():
    with fprop_context.scope(training=True, step=0):
      return engine.run_with_loss(
          stages, (tf.ones([16, 3]),), tf.zeros([16]),
          lambda y, _: {'loss': (tf.reduce_sum(y), tf.constant(1.))},
          schedule, loop=True)
  library = _step.get_concrete_function().graph.as_graph_def().library
  bodies = [f for f in library.function if '_body_' in f.signature.name]
  assert bodies
  return bodies


def _waits_by_control_on_a_call(body, name: str) -> list[str]:
  """The calls that node `name` of `body` (a FunctionDef), or an Identity
  chain feeding it, waits on by a control edge."""
  nodes = {n.name: n for n in body.node_def}
  calls, seen, todo = [], set(), [name]
  while todo:
    node = nodes.get(todo.pop())
    if node is None or node.name in seen:
      continue
    seen.add(node.name)
    for i in node.input:
      source = nodes.get(i.lstrip('^').split(':')[0])
      if source is None:
        continue
      if i.startswith('^') and source.op in _CALLS:
        calls.append(source.name)
      elif source.op == 'Identity':
        todo.append(source.name)
  return calls


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_loop_carries_each_devices_order_by_data(schedule):
  # The order carried to the next iteration (a token per device) waited on
  # the device's last called body by a control edge. Once TF inlines the
  # call (stage processes do), such an edge fires as the call starts, not
  # when its outputs exist: GPipe with recompute on 2 stage processes ran
  # later iterations' forwards beside the last one, and its steps were
  # slower than unrolled ones. The token waits by data now.
  stages = [Stage(lambda theta, x: (tf.tanh(x[0] * theta[0]),),
                  [tf.Variable(1.0 + s)], stacks.DEVICES[s], inline=True)
            for s in range(2)]
  for f in _loop_bodies(stages, schedule_lib.make_schedule(
      schedule, 2, 16, 'always')):
    assert any(n.op in _CALLS for n in f.node_def), f.signature.name
    for out in f.ret.values():
      node = out.split(':')[0]
      assert not _waits_by_control_on_a_call(f, node), (
          f.signature.name, out)


def test_a_loop_body_does_not_wait_for_its_stateful_ops():
  # tf.function ends a while body with a barrier: every value it returns
  # waits on a NoOp behind each stateful op of the iteration. On stage
  # processes those are the transfers: each iteration waited until its
  # peer had taken every send, and two processes deadlocked
  # (dependency.free_loop_body).
  def _body(theta, x):  # tf.timestamp(): a stateful stage call.
    return (x[0] * theta[0] + tf.cast(0. * tf.timestamp(), tf.float32),)
  stages = [Stage(_body, [tf.Variable(1.0 + s)], stacks.DEVICES[s])
            for s in range(2)]
  for f in _loop_bodies(stages, schedule_lib.make_schedule('1f1b', 2, 16)):
    assert any(n.op == 'StatefulPartitionedCall' for n in f.node_def), (
        f.signature.name)  # Else there is nothing to wait on.
    barriers = [n.name for n in f.node_def if n.op == 'NoOp' and
                any(i.startswith('^') for i in n.input)]
    assert not barriers, (f.signature.name, barriers)


def _scale_stages(k: int) -> list[Stage]:
  """K stages, each multiplying its input by its own weight."""
  stages = []
  for s in range(k):
    w = tf.Variable(1.0 + 0.25 * s)
    stages.append(Stage(lambda theta, x: (x[0] * theta[0],), [w],
                        stacks.DEVICES[s]))
  return stages


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_batch_with_dynamic_feature_dims_loops(schedule):
  # The batch dimension static, another one not: gathered and sliced
  # micro-batches must agree on the static shape the loop carries.
  stages = _scale_stages(2)
  sched = schedule_lib.make_schedule(schedule, 2, 8)
  out = {}
  for loop in (True, False):

    @tf.function(input_signature=[tf.TensorSpec([16, None])])
    def _step(x, loop=loop):
      with tf.GradientTape() as tape:
        tape.watch(x)
        with fprop_context.scope(training=True, step=0):
          metrics = engine.run_with_loss(
              stages, (x,), tf.zeros([16]),
              lambda y, _: {'loss': (tf.reduce_sum(y * y), tf.constant(1.))},
              sched, loop=loop)
      return tape.gradient(metrics['loss'][0], x)
    out[loop] = _step(tf.reshape(tf.range(48, dtype=tf.float32), [16, 3]))
  assert stacks.max_rel_diff(out[True], out[False]) <= 1e-6


def test_an_output_without_batch_dimension_is_refused_after_a_loop():
  stages = _scale_stages(2)
  stages[-1] = Stage(lambda theta, x: (tf.reduce_sum(x[0]) * theta[0],),
                     stages[-1].theta, stages[-1].device)

  @tf.function(autograph=False)  # The error itself, not AutoGraph's.
  def _fprop():
    with fprop_context.scope(training=True, step=0):
      return engine.run(stages, (tf.ones([32, 3]),),
                        schedule_lib.make_schedule('gpipe', 2, 16))
  with pytest.raises(microbatch.MicroBatchError, match='is a scalar'):
    _fprop.get_concrete_function()


@pytest.mark.parametrize('value', ['yes', 1, None])
def test_bad_loop_steady_state_is_named(value):
  with pytest.raises(ValueError, match=rf'net: loop_steady_state={value!r}; '
                     'use True'):
    stacks.net('nested', num_stages=2, loop_steady_state=value)


def _peak_bytes(step, calls: int = 3) -> int:
  """The least peak over `calls` warm calls.

  How far a dataflow executor runs ahead depends on thread timing, so one
  call's peak moves by a few micro-batches when other processes share the
  cores (CI ran 3 MiB over on a loaded machine). The least peak is what the
  step must hold; a regression raises every call's.
  """
  step()  # Traced and warmed up; later calls are measured.
  peaks = []
  for _ in range(calls):
    try:
      tf.config.experimental.reset_memory_stats(stacks.DEVICES[0])
    except (ValueError, tf.errors.InvalidArgumentError) as e:
      pytest.skip(f'no allocator statistics on this CPU: {e}')
    step()
    peaks.append(
        tf.config.experimental.get_memory_info(stacks.DEVICES[0])['peak'])
  return min(peaks)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_loop_holds_no_more_memory_than_op_by_op(schedule):
  # 1 MiB per input micro-batch, M=32. A loop's input reads once ran up to
  # parallel_iterations ahead (1F1B held ~30 MiB more), and GPipe kept a
  # second copy of the input for stage 0's recompute.
  m = 32
  stages = _scale_stages(2)
  x = tf.random.stateless_normal([m * 256, 1024], [1, 2])
  peaks = {}
  for loop in (True, False):
    sched = schedule_lib.make_schedule(schedule, 2, m)

    @tf.function
    def _step(loop=loop, sched=sched):
      with tf.GradientTape() as tape:
        with fprop_context.scope(training=True, step=0):
          metrics = engine.run_with_loss(
              stages, (x,), tf.zeros([m * 256]),
              lambda y, _: {'loss': (tf.reduce_mean(y), tf.constant(1.))},
              sched, loop=loop)
      return tape.gradient(metrics['loss'][0], [s.theta[0] for s in stages])
    peaks[loop] = _peak_bytes(_step)
  # Four micro-batches of slack: the regressions this guards held 30 more.
  assert peaks[True] <= peaks[False] + (4 << 20), peaks
