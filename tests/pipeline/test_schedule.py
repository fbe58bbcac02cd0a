"""Schedules tested as pictures (unit-cost clock cycles) and as dependencies."""

import random

import pytest

from lingvo_pipe.pipeline import schedule
from lingvo_pipe.pipeline.schedule import Action, Schedule, ScheduleError


def _picture(sched, width=2):
  """One line per device: the op running at each tick, '..' when idle."""
  ticks = schedule.clock_cycles(sched)
  end = max(t for stage in ticks for t in stage) + 1
  lines = []
  for d, (ops, starts) in enumerate(zip(sched, ticks)):
    row = ['.' * width] * end
    for op, t in zip(ops, starts):
      row[t] = op.label(sched.stages_of(d) != (d,)).ljust(width)
    lines.append(' '.join(row).rstrip())
  return lines


def test_gpipe_forward_is_the_fill_drain_diagonal():
  sched = schedule.gpipe_schedule(3, 4, 'never')
  for k, starts in enumerate(schedule.clock_cycles(sched)):
    assert starts[:4] == [k + m for m in range(4)]  # F of m on stage k: k+m.


def test_gpipe_picture_without_recompute():
  assert _picture(schedule.gpipe_schedule(3, 4, 'never')) == [
      'F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0',
      '.. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..',
      '.. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..',
  ]


def test_gpipe_picture_with_recompute():
  # R waits for the gradient from the next stage, then B follows it.
  assert _picture(schedule.gpipe_schedule(3, 4, 'always')) == [
      'F0 F1 F2 F3 .. .. .. .. .. .. R3 B3 R2 B2 R1 B1 R0 B0',
      '.. F0 F1 F2 F3 .. .. .. R3 B3 R2 B2 R1 B1 R0 B0 .. ..',
      '.. .. F0 F1 F2 F3 R3 B3 R2 B2 R1 B1 R0 B0 .. .. .. ..',
  ]


def test_needed_leaves_out_each_r_right_after_its_own_forward():
  # GPipe: the last micro-batch on every stage; the drain starts a tick
  # earlier on each stage than with 'always'.
  assert _picture(schedule.gpipe_schedule(3, 4, 'needed')) == [
      'F0 F1 F2 F3 .. .. .. .. B3 .. .. R2 B2 R1 B1 R0 B0',
      '.. F0 F1 F2 F3 .. .. B3 .. R2 B2 R1 B1 R0 B0 .. ..',
      '.. .. F0 F1 F2 F3 B3 R2 B2 R1 B1 R0 B0 .. .. .. ..',
  ]
  kept = lambda sched: [[m for m in range(4) if not sched.rebuilds(s, m)]
                        for s in range(3)]
  assert kept(schedule.gpipe_schedule(3, 4, 'needed')) == [[3], [3], [3]]
  assert kept(schedule.gpipe_schedule(3, 4, 'always')) == [[], [], []]
  # 1F1B: every micro-batch of the last stage.
  assert kept(schedule.one_f_one_b_schedule(3, 4, 'needed')) == [
      [], [], [0, 1, 2, 3]]
  for name in schedule.SCHEDULES:
    for k, m in ((1, 1), (2, 4), (3, 6), (4, 8)):
      sched = schedule.make_schedule(name, k, m, 'needed')
      always = schedule.make_schedule(name, k, m, 'always')
      for ops, full in zip(sched, always):
        # Exactly the R ops that directly follow their F are gone.
        assert list(ops) == [op for i, op in enumerate(full) if not (
            op.kind == 'R' and full[i - 1] == Action('F', op.micro_batch,
                                                      op.stage))], (name, k, m)


def test_except_last_has_no_recompute_on_the_last_stage():
  sched = schedule.gpipe_schedule(3, 2, 'except_last')
  assert [any(op.kind == 'R' for op in ops) for ops in sched] == [
      True, True, False]
  assert [op.label(False) for op in sched[2]] == ['F0', 'F1', 'B1', 'B0']
  assert [op.label(False) for op in sched[0]] == ['F0', 'F1', 'R1', 'B1',
                                                  'R0', 'B0']


def test_one_f_one_b_picture():
  # Warm-up of K-k-1 forwards, then one forward / one backward, then drain;
  # the same 12 ticks as GPipe.
  assert _picture(schedule.one_f_one_b_schedule(3, 4, 'never')) == [
      'F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3',
      '.. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..',
      '.. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..',
  ]


def test_interleaved_picture():
  # Megatron's interleaved 1F1B, K=2 devices × v=2 chunks (stage c·K + d):
  # forwards in groups of K micro-batches per chunk, backwards visit the
  # chunks in reverse. Each op is half a stage, so 18 half-ticks = 9 ticks
  # against 1F1B's 10: the bubble halves.
  sched = schedule.interleaved_schedule(2, 4, 'never', num_chunks=2)
  assert _picture(sched, 4) == [
      'F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 .... '
      'B2@2 .... B3@2 B2@0 B3@0',
      '.... F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 '
      'F3@3 B3@3 B2@1 B3@1 ....',
  ]
  assert (sched.num_devices, sched.num_chunks, sched.num_stages) == (2, 2, 4)
  assert sched.device_of(3) == 1 and sched.stages_of(1) == (1, 3)


@pytest.mark.parametrize('num_devices,num_chunks', [(2, 2), (2, 3), (4, 2)])
def test_interleaving_divides_the_bubble_by_the_chunks(num_devices,
                                                       num_chunks):
  m = 4 * num_devices
  def bubble(sched, chunks):
    times = schedule.run_times(
        sched, lambda d, op: {'F': 1, 'R': 1, 'B': 2}[op.kind] / chunks)
    step = max(end for ops in times for _, end in ops)
    busy = sum(end - start for ops in times for start, end in ops)
    return 1 - busy / (num_devices * step)
  flat = bubble(schedule.one_f_one_b_schedule(num_devices, m), 1)
  inter = bubble(schedule.interleaved_schedule(num_devices, m, 'always',
                                               num_chunks), num_chunks)
  assert flat == pytest.approx((num_devices - 1) / (m + num_devices - 1))
  # Megatron's (K-1)/(v·M) of ideal time, as a share of the step: ÷ ~v.
  assert inter < flat / num_chunks * 1.25


def test_interleaved_needs_micro_batches_in_multiples_of_the_devices():
  with pytest.raises(ScheduleError, match='multiple of the 4 devices'):
    schedule.interleaved_schedule(4, 6, 'always', 2)


def test_recompute_policy_lives_on_the_schedule():
  sched = schedule.interleaved_schedule(2, 2, 'except_last', 2)
  assert [sched.recomputes(s) for s in range(4)] == [True, True, True,
                                                     False]
  # The last stage (device 1's second) has no R; device 1's first does.
  assert {op.stage for op in sched[1] if op.kind == 'R'} == {1}


@pytest.mark.parametrize('name', schedule.SCHEDULES)
def test_emission_order_respects_every_dependency(name):
  sched = schedule.make_schedule(name, 4, 8, 'always', 2)
  seen = set()
  for d, op in schedule.emission_order(sched):
    assert all(dep in seen for dep in schedule.dependencies(sched, d, op))
    seen.add((d, op))
  assert len(seen) == sum(len(ops) for ops in sched)


def _in_flight(ops):
  """Most micro-batches whose F has run and whose B has not."""
  live = peak = 0
  for op in ops:
    live += {'F': 1, 'B': -1}.get(op.kind, 0)
    peak = max(peak, live)
  return peak


@pytest.mark.parametrize('num_stages, num_micro_batches',
                         [(1, 1), (1, 5), (2, 1), (3, 4), (4, 2), (4, 16),
                          (2, 6), (3, 9)])
@pytest.mark.parametrize('recompute', schedule.RECOMPUTE_POLICIES)
@pytest.mark.parametrize('name', schedule.SCHEDULES)
def test_dependencies_hold_under_random_op_times(name, recompute, num_stages,
                                                 num_micro_batches):
  if name == 'interleaved' and num_micro_batches % num_stages:
    pytest.skip('interleaved needs M a multiple of K')
  sched = schedule.make_schedule(name, num_stages, num_micro_batches,
                                 recompute, num_chunks=2)
  assert schedule.check_schedule(sched) == num_micro_batches
  rng = random.Random(0)
  durations = {(k, op): rng.uniform(0.1, 2.0)
               for k, ops in enumerate(sched) for op in ops}
  times = schedule.run_times(sched, lambda k, op: durations[(k, op)],
                             transfer_time=0.25)
  start = {(k, op): t[0] for k, ops in enumerate(sched)
           for op, t in zip(ops, times[k])}
  end = {(k, op): t[1] for k, ops in enumerate(sched)
         for op, t in zip(ops, times[k])}
  for (k, op), s in start.items():
    for dep in schedule.dependencies(sched, k, op):
      gap = 0.25 if dep[0] != k else 0.0
      assert s >= end[dep] + gap - 1e-12, (k, op, dep)
  for k, ops in enumerate(times):  # A stage runs one op at a time, in order.
    assert all(a[1] <= b[0] for a, b in zip(ops, ops[1:]))
  if name in ('zb_h1', 'zb_v'):
    return  # Their memory: tests/pipeline/test_zero_bubble.py.
  if name == 'interleaved':  # Megatron's warm-up, + 1 in steady state.
    limit = [min(2 * (num_stages - k - 1) + num_stages + 1,
                 2 * num_micro_batches) for k in range(num_stages)]
    assert [_in_flight(ops) for ops in sched] == limit
    return
  limit = (num_micro_batches if name == 'gpipe' else
           [min(num_stages - k, num_micro_batches)
            for k in range(num_stages)])
  for k, ops in enumerate(sched):
    assert _in_flight(ops) == (limit if name == 'gpipe' else limit[k])


def test_dependencies_of_each_kind():
  # Derived from what each action reads (Schedule.io): R gathers the saved
  # input and the incoming gradient, its B reads what R gathered.
  a = Action
  sched = schedule.gpipe_schedule(3, 2, 'except_last')
  assert schedule.dependencies(sched, 0, a('F', 1, 0)) == []
  assert schedule.dependencies(sched, 1, a('F', 1, 1)) == [(0, a('F', 1, 0))]
  assert schedule.dependencies(sched, 1, a('R', 0, 1)) == [
      (1, a('F', 0, 1)), (2, a('B', 0, 2))]
  assert schedule.dependencies(sched, 1, a('B', 0, 1)) == [(1, a('R', 0, 1))]
  assert schedule.dependencies(sched, 2, a('B', 0, 2)) == [(2, a('F', 0, 2))]
  sched = schedule.gpipe_schedule(2, 2, 'always')
  assert schedule.dependencies(sched, 1, a('R', 0, 1)) == [(1, a('F', 0, 1))]
  assert schedule.dependencies(sched, 1, a('B', 0, 1)) == [(1, a('R', 0, 1))]


def test_deadlock_is_reported():
  # Stage 1 runs B0 before F0: it waits on its own later action forever.
  sched = Schedule.from_lists('bad', [[('F', 0), ('B', 0)],
                                      [('B', 0), ('F', 0)]])
  with pytest.raises(ScheduleError, match='cannot finish.*device 1: B0@1'):
    schedule.clock_cycles(sched)


@pytest.mark.parametrize('lists, message', [
    ([], 'no actions'),
    ([[('F', 0)]], 'stage 0 lacks B0'),
    ([[('F', 0), ('B', 0), ('B', 0)]], 'B0@0 is repeated'),
    ([[('F', 0), ('R', 0), ('B', 0)], [('F', 0), ('B', 0), ('R', 1)]],
     'stage 0 lacks F1, B1'),
    ([[('F', 0), ('X', 0), ('B', 0)]], 'unknown kind'),
])
def test_check_schedule_errors(lists, message):
  with pytest.raises(ScheduleError) as e:
    schedule.check_schedule(Schedule.from_lists('bad', lists))
  assert message in str(e.value)


@pytest.mark.parametrize('args, message', [
    ((0, 4, 'always'), 'num_stages must be an int ≥ 1, got 0'),
    ((2, 0, 'always'), 'num_micro_batches must be an int ≥ 1, got 0'),
    ((2, 4, 'sometimes'), "recompute='sometimes' is not one of"),
])
def test_schedule_argument_errors(args, message):
  for make in (schedule.gpipe_schedule, schedule.one_f_one_b_schedule,
               schedule.interleaved_schedule):
    with pytest.raises(ScheduleError, match=message):
      make(*args)


def test_unknown_schedule_name():
  with pytest.raises(ScheduleError, match="schedule='zb' is not one of"):
    schedule.make_schedule('zb', 2, 2)
