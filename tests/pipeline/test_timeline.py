"""Timeline records → Chrome trace, Gantt PNG; records of a real step."""

import json

import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import timeline
from lingvo_pipe.layers import linear

# Two timestamp ops that wait for the same tensor can run in either order.
_STAMP_SLACK_S = 5e-3

# Hand-made K=2, M=2 step without recompute (seconds).
_RECORDS = [
    (0, 0, 'F', 10.0, 10.1), (0, 1, 'F', 10.1, 10.2),
    (1, 0, 'F', 10.1, 10.2), (1, 1, 'F', 10.2, 10.3),
    (1, 1, 'B', 10.3, 10.5), (1, 0, 'B', 10.5, 10.7),
    (0, 1, 'B', 10.5, 10.7), (0, 0, 'B', 10.7, 10.9),
]


def test_chrome_trace_structure():
  trace = timeline.to_chrome_trace([('measured', _RECORDS)])
  json.dumps(trace)  # Serialisable.
  events = trace['traceEvents']
  ops = [e for e in events if e['ph'] == 'X']
  assert len(ops) == len(_RECORDS)
  names = {(e['tid'], e['name']) for e in ops}
  assert (0, 'F0') in names and (1, 'B1') in names
  first = [e for e in ops if e['tid'] == 0 and e['name'] == 'F0'][0]
  assert first['ts'] == pytest.approx(0.0)  # Normalized to the first start.
  assert first['dur'] == pytest.approx(0.1e6)  # Microseconds.
  b0 = [e for e in ops if e['tid'] == 0 and e['name'] == 'B0'][0]
  assert b0['ts'] == pytest.approx(0.7e6)
  threads = {e['tid']: e['args']['name'] for e in events
             if e['ph'] == 'M' and e['name'] == 'thread_name'}
  assert threads == {0: 'stage 0', 1: 'stage 1'}
  procs = [e['args']['name'] for e in events if e['name'] == 'process_name']
  assert procs == ['measured']


def test_chrome_trace_one_process_per_panel(tmp_path):
  sim = simulator.simulate([simulator.StageCost(forward=1.0)] * 2, 2)
  path = tmp_path / 't.json'
  timeline.write_chrome_trace(str(path), [('a', _RECORDS),
                                          ('b', sim.events)])
  trace = json.loads(path.read_text())
  pids = {e['pid'] for e in trace['traceEvents'] if e['ph'] == 'X'}
  assert pids == {1, 2}
  assert sum(e['ph'] == 'X' for e in trace['traceEvents']) == (
      len(_RECORDS) + 2 * 2 * 3)


def test_bad_records_raise():
  with pytest.raises(timeline.TimelineError, match='kind'):
    timeline.to_chrome_trace([('x', [(0, 0, 'Q', 0.0, 1.0)])])
  with pytest.raises(timeline.TimelineError, match='ends before'):
    timeline.normalized([(0, 0, 'F', 2.0, 1.0)])
  with pytest.raises(timeline.TimelineError, match='no records'):
    timeline.plot_gantt([('empty', [])], '/tmp/never_written.png')


def test_gantt_png_of_simulated_schedule(tmp_path):
  sim = simulator.simulate([simulator.StageCost(forward=1e-3)] * 3, 4)
  path = tmp_path / 'g.png'
  timeline.plot_gantt([('predicted', sim.events), ('again', sim.events)],
                      str(path), title='tiny')
  data = path.read_bytes()
  assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 1000


def test_calibrated_costs_are_medians():
  costs = timeline.calibrated_costs(_RECORDS)
  assert len(costs) == 2
  assert costs[0].forward == pytest.approx(0.1)
  assert costs[1].backward == pytest.approx(0.2)
  assert costs[0].recompute == pytest.approx(0.1)  # No R: = forward.
  # The simulator replays the hand-made step exactly (no transfer gaps).
  sim = simulator.simulate(costs, 2, 'never')
  assert sim.step_time == pytest.approx(0.9)


def test_records_of_a_real_step_on_logical_devices():
  d = 8
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=d,
                                        output_dim=d) for i in range(4)]
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=2, num_micro_batches=2,
      input_shapes=[[4, d]]).Instantiate()
  x = tf.random.stateless_normal([4, d], seed=[1, 2])
  records = timeline.record_step(net, (x,),
                                 lambda y: tf.reduce_sum(tf.square(y)))
  assert len(records) == 2 * 2 * 3
  keys = {(r.stage, r.micro_batch, r.kind) for r in records}
  assert keys == {(k, m, kind) for k in range(2) for m in range(2)
                  for kind in 'FRB'}
  assert all(r.start <= r.end for r in records)
  assert min(r.start for r in records) == 0.0
  f = {(r.stage, r.micro_batch): r for r in records if r.kind == 'F'}
  for m in range(2):
    # Causal: stage 1 needs stage 0's output of micro-batch m.
    assert f[(1, m)].start >= f[(0, m)].start
    # Stage 0's end stamp and stage 1's start stamp both wait only for that
    # output, so they may fire in either order: allow a scheduling slack.
    assert f[(1, m)].start >= f[(0, m)].end - _STAMP_SLACK_S
  by_key = {(r.stage, r.micro_batch, r.kind): r for r in records}
  for k in range(2):
    for m in range(2):  # Recompute precedes its backward.
      assert by_key[(k, m, 'R')].end <= by_key[(k, m, 'B')].start


def test_recompute_and_backward_are_recorded_as_two_brackets():
  """Regression: a recomputing backward stamps R and B as two brackets
  [R start, R end, B start, B end]; they were paired as contiguous
  intervals, so B was recorded as (R end, B start), ~0 s long, and the
  backward's compute fell outside every record."""
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=4,
                                        output_dim=4) for i in range(2)]
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_micro_batches=2,
      input_shapes=[[4, 4]]).Instantiate()
  seen = []

  @tf.function
  def step():
    records = []
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, timeline=records):
        y = net.FProp(net.theta, tf.ones([4, 4]))
      loss = tf.reduce_sum(y)
    grads = tape.gradient(loss, net.trainable_variables)
    seen.extend(records)
    return grads

  step.get_concrete_function()
  by = {(s, m, kind): (start, end) for s, m, kind, start, end in seen}
  for m in range(2):
    r_start, r_end = by[(0, m, 'R')]
    b_start, b_end = by[(0, m, 'B')]
    # Four stamps; before the fix B's start was R's end (the same tensor).
    assert len({t.name for t in (r_start, r_end, b_start, b_end)}) == 4


def test_overlap_fraction():
  # Stage 1 busy [1, 3) while stage 0 busy [0, 2): shared time 1 of each.
  recs = [(0, 0, 'F', 0.0, 2.0), (1, 0, 'F', 1.0, 3.0)]
  assert timeline.overlap_fraction(recs) == pytest.approx(2.0 / 4.0)
  turns = [(0, 0, 'F', 0.0, 1.0), (1, 0, 'F', 1.0, 2.0)]
  assert timeline.overlap_fraction(turns) == 0.0
  # Simulated GPipe, K=2, M=8, no recompute: stages overlap except in the
  # fill and drain (one F, resp. one B, of each stage runs alone).
  sim = simulator.simulate([simulator.StageCost(forward=1.0)] * 2, 8,
                           'never')
  busy = 2 * 8 * 3.0
  alone = 2 * (1.0 + 2.0)
  assert timeline.overlap_fraction(sim.events) == pytest.approx(
      (busy - alone) / busy)


def test_gantt_rows_per_device_for_interleaved(tmp_path):
  sim = simulator.simulate([simulator.StageCost(forward=1e-3)] * 4, 4,
                           'never', 'interleaved', num_chunks=2)
  path = tmp_path / 'i.png'
  timeline.plot_gantt([('interleaved', sim.events)], str(path),
                      num_devices=2)
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  with pytest.raises(timeline.TimelineError, match='num_devices=5'):
    timeline.plot_gantt([('x', sim.events)], str(path), num_devices=5)


def test_step_recorder_with_the_loss_in_the_pipeline():
  """1F1B needs the loss in the last stage (FPropLoss): labels= selects it;
  normalize=False keeps the absolute seconds stage processes compare."""
  d = 8
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=d,
                                        output_dim=d) for i in range(4)]
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=2, num_micro_batches=2,
      schedule='1f1b', input_shapes=[[4, d]]).Instantiate()
  x = tf.random.stateless_normal([4, d], seed=[1, 2])

  def loss_fn(y, labels):
    n = tf.cast(tf.shape(y)[0], y.dtype)
    return {'loss': (tf.reduce_sum(tf.square(y - labels)) / n, n)}

  recorder = timeline.StepRecorder(net, (x,), loss_fn,
                                   labels=tf.zeros([4, d]), normalize=False)
  records = recorder()
  assert {(r.stage, r.micro_batch, r.kind) for r in records} == {
      (k, m, kind) for k in range(2) for m in range(2) for kind in 'FRB'}
  assert min(r.start for r in records) > 1e9  # Seconds since the epoch.


def test_split_backward_records_calibrate_and_draw_on_their_devices(
    tmp_path):
  # zb_v, K=1: stages 0 and 1 both on device 0; F, I and W per stage.
  recs = [(0, 0, 'F', 0.0, 0.1), (1, 0, 'F', 0.1, 0.2),
          (1, 0, 'I', 0.2, 0.3), (0, 0, 'I', 0.3, 0.4),
          (1, 0, 'W', 0.4, 0.45), (0, 0, 'W', 0.45, 0.5)]
  costs = timeline.calibrated_costs(recs)
  assert costs[1].time('I') == pytest.approx(0.1)
  assert costs[1].time('W') == pytest.approx(0.05)
  assert costs[1].backward == pytest.approx(0.15)
  sim = simulator.simulate(costs, 1, 'never', 'zb_v')
  assert sim.stage_devices == (0, 0)
  assert sim.step_time == pytest.approx(0.5)
  path = tmp_path / 'zb.png'
  timeline.plot_gantt([('measured', recs), ('predicted', sim.events)],
                      str(path), stage_devices=sim.stage_devices)
  assert path.stat().st_size > 0
  with pytest.raises(timeline.TimelineError, match='places 1 stages'):
    timeline.plot_gantt([('measured', recs)], str(path), stage_devices=(0,))


def test_split_backward_brackets_hold_their_compute():
  """Regression: I's end stamp waited, by a control edge, on the call of
  the traced I function, which once inlined fires when the call's stateful
  ops are done, not its outputs: I was recorded ~0 s long and its compute
  fell between I and W, so a zero-bubble step was predicted 3× short. I
  does about as much work as W here (one matmul per layer each)."""
  d, n = 256, 4
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=d,
                                        output_dim=d) for i in range(n)]
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=1, num_micro_batches=2,
      schedule='zb_h1', recompute='never', input_shapes=[[256, d]]
  ).Instantiate()
  x = tf.random.stateless_normal([256, d], seed=[1, 2])

  def loss_fn(y, labels):
    return {'loss': (tf.reduce_mean(tf.square(y - labels)),
                     tf.constant(1.0))}

  recorder = timeline.StepRecorder(net, (x,), loss_fn,
                                   labels=tf.zeros([256, d]))
  recorder()

  def _brackets_hold(recs):
    by_kind = {k: [r.end - r.start for r in recs if r.kind == k]
               for k in 'FIW'}
    assert all(len(v) == 2 for v in by_kind.values())
    # The stamps bracket the device's compute: back to back on one device,
    # the recorded ops leave little of the span uncovered.
    busy = sum(r.end - r.start for r in recs)
    return (min(by_kind['I']) > 0.2 * max(by_kind['W']) and
            busy > 0.6 * max(r.end for r in recs))

  # One of a few steps: a test running beside others (Bazel runs two) can
  # lose the core between two ops of one step, which no bracket prevents;
  # the regression put I's compute outside its stamps in every step.
  steps = [recorder() for _ in range(3)]
  assert any(_brackets_hold(recs) for recs in steps), steps
