"""Zero-bubble schedules (Qi et al., ICLR 2024) as data: ZB-H1 and ZB-V.

A backward split into I (the input gradient, which the previous stage
waits for) and W (the weight gradients, which nothing waits for) lets W
fill the slots where 1F1B idles. Each builder returns, per device, the
actions it runs in order, and the stage → device map (ZB-V's is not
round-robin, so the map is part of the schedule):

  F(s, m)  forward of micro-batch m on stage s; waits for F(s-1, m)
  R(s, m)  recompute before I (recompute policies as in schedule.py)
  I(s, m)  input gradient; waits for I(s+1, m) (last stage: its own F)
  W(s, m)  weight gradients; waits for I(s, m)
  B(s, m)  I and W fused (`fuse_adjacent`: stage 0, where W follows I)

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

>>> print(zb_h1(2, 3).to_text())
d0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2
d1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Sequence

from lingvo_pipe.pipeline import schedule as schedule_lib

__all__ = ['Action', 'ZeroBubbleSchedule', 'ZERO_BUBBLE_SCHEDULES',
           'fuse_adjacent', 'make_zero_bubble', 'zb_h1', 'zb_v']

ZERO_BUBBLE_SCHEDULES = ('zb_h1', 'zb_v')
ScheduleError = schedule_lib.ScheduleError


class Action(NamedTuple):
  """One op of a device: kind F, R, I, W or B of micro-batch m of a stage."""
  kind: str
  stage: int
  micro_batch: int

  def __str__(self) -> str:
    return f'{self.kind}{self.stage}.{self.micro_batch}'


@dataclasses.dataclass(frozen=True)
class ZeroBubbleSchedule:
  """Per-device action lists and the stage → device map."""
  name: str
  actions: tuple[tuple[Action, ...], ...]
  stage_device: tuple[int, ...]
  num_micro_batches: int
  recompute: str

  @property
  def num_devices(self) -> int:
    return len(self.actions)

  @property
  def num_stages(self) -> int:
    return len(self.stage_device)

  def to_text(self) -> str:
    """One line per device: 'd0: F0.0 F0.1 I0.0 …' (kind, stage.m)."""
    return '\n'.join(f'd{d}: ' + ' '.join(map(str, acts))
                     for d, acts in enumerate(self.actions))


def _check(k: int, m: int, recompute: str) -> None:
  for name, value in (('num_devices', k), ('num_micro_batches', m)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ScheduleError(f'{name} must be an int ≥ 1, got {value!r}.')
  if recompute not in schedule_lib.RECOMPUTE_POLICIES:
    raise ScheduleError(f'recompute={recompute!r} is not one of '
                        f'{schedule_lib.RECOMPUTE_POLICIES}.')


def zb_h1(num_devices: int, num_micro_batches: int,
          recompute: str = 'never') -> ZeroBubbleSchedule:
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
    acts = [Action('F', d, m) for m in range(warmup)]
    waiting: collections.deque[int] = collections.deque()
    forwards = warmup
    for m in range(m_total):
      if forwards < m_total:
        acts.append(Action('F', d, forwards))
        forwards += 1
      acts.append(Action('I', d, m))
      waiting.append(m)
      if len(waiting) > d or forwards == m_total:
        acts.append(Action('W', d, waiting.popleft()))
    acts += [Action('W', d, m) for m in waiting]
    out.append(acts)
  return _finish('zb_h1', out, tuple(range(k)), m_total, recompute)


def zb_v(num_devices: int, num_micro_batches: int,
         recompute: str = 'never') -> ZeroBubbleSchedule:
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
  stage_device = tuple(s if s < k else 2 * k - 1 - s for s in range(2 * k))
  out = _greedy(stage_device, k, m_total, alive_limit=2 * k)
  return _finish('zb_v', out, stage_device, m_total, recompute)


def _greedy(stage_device: Sequence[int], k: int, m_total: int,
            alive_limit: int) -> list[list[Action]]:
  """Per-device orders from a unit-cost list scheduler (see `zb_v`)."""
  n = len(stage_device)
  own = [[s for s in reversed(range(n)) if stage_device[s] == d]
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
      inputs = [Action('I', s, next_i[s]) for s in own[d]
                if next_i[s] < m_total and _ready(
                    Action('I', s + 1, next_i[s]) if s < n - 1 else
                    Action('F', s, next_i[s]))]
      forwards = [Action('F', s, next_f[s]) for s in own[d]
                  if next_f[s] < m_total and alive[d] < alive_limit and
                  _ready(Action('F', s - 1, next_f[s]) if s else None)]
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
        waiting[d].append(Action('W', act.stage, act.micro_batch))
      else:
        waiting[d].popleft()
        alive[d] -= 1
    if not ran and not any(t > tick for t in done.values()):
      raise ScheduleError(f'zero-bubble list scheduler stuck at tick {tick} '
                          f'(K={k}, M={m_total}).')
    tick += 1
  return out


def _with_recompute(acts: list[Action], num_stages: int,
                    recompute: str) -> list[Action]:
  """R(s, m) before each I(s, m) of a recomputing stage; 'needed' leaves
  out an R that would directly follow its own F (schedule.py says why)."""
  out: list[Action] = []
  for act in acts:
    # pylint: disable-next=protected-access
    if act.kind == 'I' and schedule_lib._recomputes(act.stage, num_stages,
                                                    recompute):
      if not (recompute == 'needed' and out and
              out[-1] == Action('F', act.stage, act.micro_batch)):
        out.append(Action('R', act.stage, act.micro_batch))
    out.append(act)
  return out


def _finish(name: str, per_device: list[list[Action]],
            stage_device: tuple[int, ...], m_total: int,
            recompute: str) -> ZeroBubbleSchedule:
  n = len(stage_device)
  per_device = [_with_recompute(acts, n, recompute) for acts in per_device]
  for d, acts in enumerate(per_device):
    want = collections.Counter(
        Action(kind, s, m) for s in range(n) if stage_device[s] == d
        for m in range(m_total) for kind in 'FIW')
    got = collections.Counter(a for a in acts if a.kind != 'R')
    if got != want:  # A builder's bug, never the caller's.
      raise ScheduleError(f'{name}: device {d} runs {sorted(map(str, got))}'
                          f', not F, I, W of each micro-batch once.')
  return ZeroBubbleSchedule(name, tuple(tuple(a) for a in per_device),
                            stage_device, m_total, recompute)


def fuse_adjacent(schedule: ZeroBubbleSchedule) -> ZeroBubbleSchedule:
  """B(0, m) wherever W(0, m) directly follows I(0, m): one op instead of
  two, and nothing kept between them.

  Stage 0 only: its input gradient goes to no other stage. Elsewhere a
  fused op hands its dx upstream only once its dθ exists too, and the
  stage before waits for W (a unit-cost ZB-V step at K=3, M=6: 40 ticks
  instead of 38).
  """
  per_device = []
  for acts in schedule.actions:
    out: list[Action] = []
    for act in acts:
      if (act.kind == 'W' and act.stage == 0 and out and
          out[-1] == Action('I', act.stage, act.micro_batch)):
        out[-1] = Action('B', act.stage, act.micro_batch)
      else:
        out.append(act)
    per_device.append(tuple(out))
  return dataclasses.replace(schedule, actions=tuple(per_device))


def make_zero_bubble(name: str, num_devices: int, num_micro_batches: int,
                     recompute: str = 'never') -> ZeroBubbleSchedule:
  """The zero-bubble schedule called `name` (ZERO_BUBBLE_SCHEDULES)."""
  builders = {'zb_h1': zb_h1, 'zb_v': zb_v}
  if name not in builders:
    raise ScheduleError(f'schedule={name!r} is not one of '
                        f'{ZERO_BUBBLE_SCHEDULES}.')
  return builders[name](num_devices, num_micro_batches, recompute)
