"""Zero-bubble schedules (Qi et al., ICLR 2024): ZB-H1 and ZB-V.

A backward split into I (the input gradient, which the previous stage
waits for) and W (the weight gradients, which nothing waits for) lets W
fill the slots where 1F1B idles. Each builder returns a `Schedule`: per
device, the actions it runs in order, and the stage → device map (ZB-V's
is a V, not round-robin: the map is part of the schedule, and every
reader — plan, gpipe, simulator, memory — takes it from there):

  F(s, m)  forward of micro-batch m on stage s; waits for F(s-1, m)
  R(s, m)  recompute, directly before I (recompute policies as in
           schedule.py)
  I(s, m)  input gradient; waits for I(s+1, m) (last stage: its own F)
  W(s, m)  weight gradients; waits for I(s, m)

Under unit costs (F = I = W = 1; 1F1B's B = 2), K devices, M ≥ K:

  schedule  stages  step          idle per device     micro-batches alive
  1f1b      K       3M + 3(K-1)   3(K-1)              ≤ K-d on device d
  zb_h1     K       3M + (K-1)    K-1   (1F1B's / 3)  F→I ≤ K-d, F→W ≤ K
  zb_v      2K      3M + (K-1)/2  (K-1)/2 (1F1B's/6)  ≤ 2K chunks = K stages'

(ZB-V's costs are in full-stage units: each of its 2K chunks holds half a
stage.) No step can be shorter than device K-1's first input arriving plus
its work, and both reach that bound in this model; the paper's "zero"
counts that start-up skew as free (its optimizer step runs
unsynchronised). So ZB-H2 (more memory) is not built: with one
synchronous update per step it has zb_h1's step under unit costs. Any
K ≥ 1 and M ≥ 1 run; for M < K with more idle.

Stage 0's W could be fused with its I into one B (its dx goes nowhere
that waits), but a fused B from a kept forward needs the forward's tape,
which cannot cross a loop iteration; split, what I reads is plain values
and the steady state loops.

>>> print(zb_h1(2, 3).to_text())
# zb_h1: 2 devices, 2 stages, M=3
device 0: F0 F1 I0 W0 F2 I1 W1 I2 W2
device 1: F0 I0 F1 I1 W0 F2 I2 W1 W2
"""

from __future__ import annotations

import collections
from typing import Sequence

from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline.actions import Action, Schedule, ScheduleError

__all__ = ['ZERO_BUBBLE_SCHEDULES', 'v_stage_devices', 'zb_h1', 'zb_v']

ZERO_BUBBLE_SCHEDULES = ('zb_h1', 'zb_v')


def _check(k: int, m: int, recompute: str) -> None:
  for name, value in (('num_devices', k), ('num_micro_batches', m)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ScheduleError(f'{name} must be an int ≥ 1, got {value!r}.')
  if recompute not in schedule_lib.RECOMPUTE_POLICIES:
    raise ScheduleError(f'recompute={recompute!r} is not one of '
                        f'{schedule_lib.RECOMPUTE_POLICIES}.')


def v_stage_devices(num_devices: int) -> tuple[int, ...]:
  """ZB-V's placement: 2K stages, device d holding stages d and 2K-1-d."""
  k = num_devices
  return tuple(s if s < k else 2 * k - 1 - s for s in range(2 * k))


def zb_h1(num_devices: int, num_micro_batches: int,
          recompute: str = 'never') -> Schedule:
  """ZB-H1: 1F1B's order of F and I, each device's W delayed to fill the
  cool-down.

  Device d runs 1F1B's warm-up (K-d-1 forwards) and its F/I alternation
  with I in B's place; W(m) follows I(m+d) in the steady state, and one W
  follows each I of the cool-down (where 1F1B's devices wait for the
  gradients coming back), the rest at the end. So F→I in flight stay
  1F1B's K-d, and at most d more micro-batches wait for their W (holding
  only what W keeps).
  """
  k, m_total = num_devices, num_micro_batches
  _check(k, m_total, recompute)
  out = []
  for d in range(k):
    warmup = min(k - d - 1, m_total)
    acts = [Action('F', m, d) for m in range(warmup)]
    waiting: collections.deque[int] = collections.deque()
    forwards = warmup
    for m in range(m_total):
      if forwards < m_total:
        acts.append(Action('F', forwards, d))
        forwards += 1
      acts.append(Action('I', m, d))
      waiting.append(m)
      if len(waiting) > d or forwards == m_total:
        acts.append(Action('W', waiting.popleft(), d))
    acts += [Action('W', m, d) for m in waiting]
    out.append(acts)
  return _finish('zb_h1', out, tuple(range(k)), m_total, recompute)


def zb_v(num_devices: int, num_micro_batches: int,
         recompute: str = 'never') -> Schedule:
  """ZB-V: 2K stages in a V, device d holding stages d and 2K-1-d.

  Device 0 holds the first stage and the last (the loss), so a
  micro-batch's forward goes down the devices and back up, and its
  backward the same way in reverse: every device has work from both ends
  of the pipeline. The order is found by a list scheduler under unit
  costs (`_greedy`): at each tick an idle device runs a ready I (nothing
  upstream can proceed without it), else a ready F while fewer than 2K of
  its chunk micro-batches are alive (F run, W not yet: 1F1B's peak, K
  micro-batches of a full stage), else its oldest pending W.
  """
  k, m_total = num_devices, num_micro_batches
  _check(k, m_total, recompute)
  stage_devices = v_stage_devices(k)
  out = _greedy(stage_devices, k, m_total, alive_limit=2 * k)
  return _finish('zb_v', out, stage_devices, m_total, recompute)


def _greedy(stage_devices: Sequence[int], k: int, m_total: int,
            alive_limit: int) -> list[list[Action]]:
  """Per-device orders from a unit-cost list scheduler (see `zb_v`)."""
  n = len(stage_devices)
  own = [[s for s in reversed(range(n)) if stage_devices[s] == d]
         for d in range(k)]  # Later stages first: nearer the loss.
  done: dict[Action, int] = {}  # Tick at which each action has finished.
  next_f, next_i = [0] * n, [0] * n
  waiting: list[collections.deque[Action]] = [collections.deque()
                                              for _ in range(k)]
  alive = [0] * k
  out: list[list[Action]] = [[] for _ in range(k)]
  tick, left = 0, 3 * n * m_total

  def _ready(dep: Action | None) -> bool:
    return dep is None or done.get(dep, tick + 1) <= tick

  while left:
    ran = False
    for d in range(k):
      inputs = [Action('I', next_i[s], s) for s in own[d]
                if next_i[s] < m_total and _ready(
                    Action('I', next_i[s], s + 1) if s < n - 1 else
                    Action('F', next_i[s], s))]
      forwards = [Action('F', next_f[s], s) for s in own[d]
                  if next_f[s] < m_total and alive[d] < alive_limit and
                  _ready(Action('F', next_f[s], s - 1) if s else None)]
      ready = inputs or forwards or list(waiting[d])[:1]
      if not ready:
        continue
      act = min(ready, key=lambda a: (a.micro_batch, -a.stage))
      out[d].append(act)
      done[act] = tick + 1
      left -= 1
      ran = True
      if act.kind == 'F':
        next_f[act.stage] += 1
        alive[d] += 1
      elif act.kind == 'I':
        next_i[act.stage] += 1
        waiting[d].append(Action('W', act.micro_batch, act.stage))
      else:
        waiting[d].popleft()
        alive[d] -= 1
    if not ran and not any(t > tick for t in done.values()):
      raise ScheduleError(f'zero-bubble list scheduler stuck at tick {tick} '
                          f'(K={k}, M={m_total}).')
    tick += 1
  return out


def _finish(name: str, per_device: list[list[Action]],
            stage_devices: tuple[int, ...], m_total: int,
            recompute: str) -> Schedule:
  """R before each I of a recomputing stage ('needed' then drops an R
  that directly follows its own F: `schedule.build`), checked."""
  n = len(stage_devices)
  with_r = []
  for d, acts in enumerate(per_device):
    want = collections.Counter(
        Action(kind, m, s) for s in range(n) if stage_devices[s] == d
        for m in range(m_total) for kind in 'FIW')
    if collections.Counter(acts) != want:  # A builder's bug, never the
      raise ScheduleError(  # caller's.
          f'{name}: device {d} runs {sorted(map(str, acts))}, not F, I, W '
          'of each micro-batch once.')
    ops: list[Action] = []
    for a in acts:
      if a.kind == 'I' and schedule_lib.recomputes(a.stage, n, recompute):
        ops.append(Action('R', a.micro_batch, a.stage))
      ops.append(a)
    with_r.append(ops)
  return schedule_lib.build(name, with_r, m_total, recompute, stage_devices)
