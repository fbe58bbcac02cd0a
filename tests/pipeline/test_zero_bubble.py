"""Zero-bubble schedules checked by a unit-cost event simulation of their
own (not `actions.run_times`, which derives waits from the schedule's
declarations): every action waits for its device and its data, nothing
deadlocks, the step and the memory in flight are the paper's."""

import pytest

from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import schedule_text
from lingvo_pipe.pipeline import zero_bubble
from lingvo_pipe.pipeline.actions import Action, ScheduleError

KS, MS = (1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16)


def _inputs(act, stage_device, rebuilt):
  """What `act` waits for (besides its device's previous action)."""
  kind, m, s = act
  last = len(stage_device) - 1
  grad = [('F', m, s)] if s == last else [('I', m, s + 1)]
  own = [('R', m, s)] if (s, m) in rebuilt else [('F', m, s)]
  return {'F': [[('F', m, s - 1)]] if s else [],
          'R': [[('F', m, s)], grad],
          'I': [own, grad],
          'W': [[('I', m, s)]]}[kind]


def simulate(sched, cost=lambda kind: 1):
  """(start, end) of every action: each device runs its list in order, an
  action starts when its device is free and one of each group of its
  inputs is done."""
  rebuilt = {(a.stage, a.micro_batch) for acts in sched.actions
             for a in acts if a.kind == 'R'}
  times, free, pos = {}, [0] * sched.num_devices, [0] * sched.num_devices
  while any(p < len(a) for p, a in zip(pos, sched.actions)):
    moved = False
    for d, acts in enumerate(sched.actions):
      while pos[d] < len(acts):
        act = acts[pos[d]]
        assert sched.stage_devices[act.stage] == d, (act, d)
        groups = _inputs(act, sched.stage_devices, rebuilt)
        ends = [min(times[i][1] for i in g if i in times) for g in groups
                if any(i in times for i in g)]
        if len(ends) < len(groups):
          break
        start = max([free[d]] + ends)
        times[act] = (start, start + cost(act.kind))
        free[d], pos[d], moved = start + cost(act.kind), pos[d] + 1, True
    assert moved, f'deadlock: {sched.name} {sched.to_text()}'
  return times


def _step(times):
  return max(end for _, end in times.values())


def _peak(sched, times, start_kind, end_kind):
  """Per device, most micro-batches (of any of its stages) between the
  start of their `start_kind` and the end of their `end_kind`."""
  peaks = []
  for acts in sched.actions:
    events = []
    for a in acts:
      if a.kind == start_kind:
        events.append((times[a][0], 1))
      if a.kind == end_kind:
        events.append((times[a][1], -1))
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
      level += delta
      peak = max(peak, level)
    peaks.append(peak)
  return peaks


def _one_f_one_b_step(k, m):
  times = schedule_lib.run_times(schedule_lib.one_f_one_b_schedule(
      k, m, 'never'), lambda d, op: 2.0 if op.kind == 'B' else 1.0)
  return max(end for ops in times for _, end in ops)


@pytest.mark.parametrize('k', KS)
def test_zb_h1_step_and_memory(k):
  for m in MS:
    sched = zero_bubble.zb_h1(k, m)
    assert sched.stage_devices == tuple(range(k))
    times = simulate(sched)
    one_f_one_b = _one_f_one_b_step(k, m)
    if m >= k:  # ZB-H1: idle (K-1)(F + I - W), a third of 1F1B's 3(K-1).
      assert _step(times) - 3 * m == k - 1
      assert 3 * (_step(times) - 3 * m) == one_f_one_b - 3 * m
    else:
      assert _step(times) < one_f_one_b or k == 1
    assert _peak(sched, times, 'F', 'I') == [min(k - d, m) for d in range(k)]
    assert max(_peak(sched, times, 'F', 'W')) <= k


@pytest.mark.parametrize('k', KS)
def test_zb_v_step_and_memory(k):
  for m in MS:
    sched = zero_bubble.zb_v(k, m)
    assert sched.stage_devices == tuple(list(range(k)) +
                                        list(reversed(range(k))))
    assert schedule_lib.stage_devices('zb_v', k) == sched.stage_devices
    times = simulate(sched)  # Costs per chunk (half a stage): 1 each.
    if m >= k:  # Device K-1's start-up alone: 1F1B's idle ÷ 6.
      assert _step(times) - 6 * m == k - 1
      assert 6 * (_step(times) - 6 * m) == 2 * _one_f_one_b_step(k, m) - 6 * m
    assert max(_peak(sched, times, 'F', 'W')) <= 2 * k  # 1F1B's K stages.


def test_zb_v_bubble_vanishes_with_m():
  k = 4
  fractions = [(_step(simulate(zero_bubble.zb_v(k, m))) - 6 * m) /
               _step(simulate(zero_bubble.zb_v(k, m))) for m in (4, 16, 64)]
  assert fractions == sorted(fractions, reverse=True) and fractions[-1] < 0.01


@pytest.mark.parametrize('name', zero_bubble.ZERO_BUBBLE_SCHEDULES)
@pytest.mark.parametrize('recompute', schedule_lib.RECOMPUTE_POLICIES)
def test_recompute_policies(name, recompute):
  for k, m in ((1, 1), (2, 3), (3, 8)):
    sched = schedule_lib.make_schedule(name, k, m, recompute)
    last = sched.num_stages - 1
    for acts in sched.actions:
      for i, a in enumerate(acts):
        if a.kind == 'R':  # Right before its I.
          assert acts[i + 1] == Action('I', a.micro_batch, a.stage)
          assert acts[i - 1:i] != [Action('F', a.micro_batch, a.stage)] or (
              recompute != 'needed')
      rs = [a for a in acts if a.kind == 'R']
      want = {'never': 0, 'except_last': None}.get(recompute)
      if want == 0:
        assert not rs
      if recompute == 'always':
        assert len(rs) == sum(a.kind == 'I' for a in acts)
      if recompute == 'except_last':
        assert all(a.stage != last for a in rs) and len(rs) == sum(
            a.kind == 'I' and a.stage != last for a in acts)
    simulate(sched, lambda kind: 2 if kind == 'R' else 1)


@pytest.mark.parametrize('name', zero_bubble.ZERO_BUBBLE_SCHEDULES)
def test_by_name_and_as_text(name):
  """Built by name, the schedule is data like the others: its text reads
  back to the same actions and V placement, and the validator passes it."""
  sched = schedule_lib.make_schedule(name, 3, 6, 'except_last')
  assert name in schedule_lib.SCHEDULES
  again = schedule_lib.make_schedule(sched.to_text(), 3, 6)
  assert again.actions == sched.actions
  assert again.stage_devices == sched.stage_devices
  assert schedule_text.validate(sched) == 6
  # Every stage's backward is split, and each I's gradient goes upstream.
  assert all(sched.splits(s, m) for s in range(sched.num_stages)
             for m in range(6))


def test_bad_arguments():
  with pytest.raises(ScheduleError, match='zb_h1'):
    schedule_lib.make_schedule('zb_h2', 2, 4)
  with pytest.raises(ScheduleError, match='num_micro_batches'):
    zero_bubble.zb_v(2, 0)
  with pytest.raises(ScheduleError, match='recompute'):
    zero_bubble.zb_h1(2, 4, 'sometimes')
