"""Schedules tested as pictures (unit-cost clock cycles) and as dependencies."""

import random

import pytest

from lingvo_pipe.pipeline import schedule
from lingvo_pipe.pipeline.schedule import Op, ScheduleError


def _picture(sched):
  """One line per stage: the op running at each tick, '..' when idle."""
  ticks = schedule.clock_cycles(sched)
  width = max(t for stage in ticks for t in stage) + 1
  lines = []
  for ops, starts in zip(sched, ticks):
    row = ['..'] * width
    for op, t in zip(ops, starts):
      row[t] = str(op)
    lines.append(' '.join(row))
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


def test_except_last_has_no_recompute_on_the_last_stage():
  sched = schedule.gpipe_schedule(3, 2, 'except_last')
  assert [any(op.kind == 'R' for op in ops) for ops in sched] == [
      True, True, False]
  assert [str(op) for op in sched[2]] == ['F0', 'F1', 'B1', 'B0']
  assert [str(op) for op in sched[0]] == ['F0', 'F1', 'R1', 'B1', 'R0', 'B0']


def test_one_f_one_b_picture():
  # Warm-up of K-k-1 forwards, then one forward / one backward, then drain;
  # the same 12 ticks as GPipe.
  assert _picture(schedule.one_f_one_b_schedule(3, 4, 'never')) == [
      'F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3',
      '.. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..',
      '.. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..',
  ]


def _in_flight(ops):
  """Most micro-batches whose F has run and whose B has not."""
  live = peak = 0
  for op in ops:
    live += {'F': 1, 'B': -1}.get(op.kind, 0)
    peak = max(peak, live)
  return peak


@pytest.mark.parametrize('num_stages, num_micro_batches',
                         [(1, 1), (1, 5), (2, 1), (3, 4), (4, 2), (4, 16)])
@pytest.mark.parametrize('recompute', schedule.RECOMPUTE_POLICIES)
@pytest.mark.parametrize('name', schedule.SCHEDULES)
def test_dependencies_hold_under_random_op_times(name, recompute, num_stages,
                                                 num_micro_batches):
  sched = schedule.make_schedule(name, num_stages, num_micro_batches,
                                 recompute)
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
  limit = (num_micro_batches if name == 'gpipe' else
           [min(num_stages - k, num_micro_batches)
            for k in range(num_stages)])
  for k, ops in enumerate(sched):
    assert _in_flight(ops) == (limit if name == 'gpipe' else limit[k])


def test_dependencies_of_each_kind():
  sched = schedule.gpipe_schedule(3, 2, 'except_last')
  assert schedule.dependencies(sched, 0, Op('F', 1)) == []
  assert schedule.dependencies(sched, 1, Op('F', 1)) == [(0, Op('F', 1))]
  assert schedule.dependencies(sched, 1, Op('R', 0)) == [
      (1, Op('F', 0)), (2, Op('B', 0))]
  assert schedule.dependencies(sched, 1, Op('B', 0)) == [
      (1, Op('R', 0)), (2, Op('B', 0))]
  assert schedule.dependencies(sched, 2, Op('B', 0)) == [(2, Op('F', 0))]
  sched = schedule.gpipe_schedule(2, 2, 'always')
  assert schedule.dependencies(sched, 1, Op('R', 0)) == [(1, Op('F', 0))]
  assert schedule.dependencies(sched, 1, Op('B', 0)) == [(1, Op('R', 0))]


def test_deadlock_is_reported():
  # Stage 1 runs B0 before F0: it waits on its own later op forever.
  sched = [[Op('F', 0), Op('B', 0)], [Op('B', 0), Op('F', 0)]]
  with pytest.raises(ScheduleError, match='cannot finish.*stage 1: B0'):
    schedule.clock_cycles(sched)


@pytest.mark.parametrize('sched, message', [
    ([], 'no stages'),
    ([[Op('F', 0)]], "missing ['B0']"),
    ([[Op('F', 0), Op('B', 0), Op('B', 0)]], "repeated or unexpected ['B0']"),
    ([[Op('F', 0), Op('R', 0), Op('B', 0)], [Op('F', 0), Op('B', 0),
                                             Op('R', 1)]],
     "Stage 1 must run"),
    ([[Op('F', 0), Op('X', 0), Op('B', 0)]], 'unknown kind'),
])
def test_check_schedule_errors(sched, message):
  with pytest.raises(ScheduleError) as e:
    schedule.check_schedule(sched)
  assert message in str(e.value)


@pytest.mark.parametrize('args, message', [
    ((0, 4, 'always'), 'num_stages must be an int ≥ 1, got 0'),
    ((2, 0, 'always'), 'num_micro_batches must be an int ≥ 1, got 0'),
    ((2, 4, 'sometimes'), "recompute='sometimes' is not one of"),
])
def test_schedule_argument_errors(args, message):
  for make in (schedule.gpipe_schedule, schedule.one_f_one_b_schedule):
    with pytest.raises(ScheduleError, match=message):
      make(*args)


def test_unknown_schedule_name():
  with pytest.raises(ScheduleError, match="schedule='zb' is not one of"):
    schedule.make_schedule('zb', 2, 2)
