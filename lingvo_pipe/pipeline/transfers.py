"""The transfer pass: SEND and RECV actions for boundaries between processes.

A schedule is written with compute actions only (F, R, B, I, W). Where a
stage boundary crosses processes, `insert` adds the transfers as actions of
the two devices' lists, so that what travels, and when it is posted, is
schedule data like the rest:

* a send follows the action that made its value (an F's output, a B's or
  I's input gradient); nothing waits on it but the step's end;
* a recv is inserted `lookahead` compute calls of its device before its
  reader (an R and the B after it are one call): it is posted once the
  action before it has finished (a recv posted before its send gets the
  data as soon as it is sent, one posted after waits a round trip), so the
  transfer overlaps the calls between, and the stage holds at most
  `lookahead` + 1 received buffers ahead.

`buffers` counts, off the lists, the boundary buffers a stage holds at once:
the memory model's `transfers` component.

>>> from lingvo_pipe.pipeline import schedule
>>> s = insert(schedule.gpipe_schedule(2, 2, 'never'))
>>> [a.label(False) for a in s[1]]
['RECV_F0', 'RECV_F1', 'F0', 'F1', 'B1', 'SEND_B1', 'B0', 'SEND_B0']
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable

from lingvo_pipe.pipeline.actions import RECV_LOOKAHEAD, Action, Schedule

__all__ = ['buffers', 'insert']


def insert(schedule: Schedule, crosses: Callable[[int, int], bool] | None = None,
           lookahead: int = RECV_LOOKAHEAD) -> Schedule:
  """`schedule` with SEND/RECV actions for each boundary that crosses
  processes (`crosses(stage_a, stage_b)`; default: different devices)."""
  if crosses is None:
    crosses = lambda a, b: schedule.device_of(a) != schedule.device_of(b)
  base = schedule.compute()
  out = []
  for ops in base.actions:
    slots = _slots(ops)  # Ascending: the first action of a slot bisects.
    recvs: dict[int, list[Action]] = {}
    for i, a in enumerate(ops):
      for recv in _recvs_for(base, a, crosses):
        at = bisect.bisect_left(slots, max(0, slots[i] - lookahead))
        recvs.setdefault(at, []).append(recv)
    device_ops: list[Action] = []
    for i, a in enumerate(ops):
      device_ops += recvs.get(i, [])
      device_ops.append(a)
      device_ops += _sends_after(base, a, crosses)
    out.append(tuple(device_ops))
  return dataclasses.replace(base, actions=tuple(out))


def buffers(schedule: Schedule, stage: int) -> dict[str, int]:
  """Boundary buffers `stage` may hold at once on each side: 'input'
  (received inputs, and the input gradient being sent) and 'output'
  (received output gradients, and the output being sent). A recv's buffer
  lives from its post to its reader; a send's until it is taken."""
  waiting = {'input': 0, 'output': 0}
  peak = dict(waiting)
  sends = dict(waiting)
  readers: dict[Action, list[str]] = {}
  for a in schedule[schedule.device_of(stage)]:
    if a.stage != stage:
      continue
    if a.kind in ('RECV_F', 'RECV_B'):
      side = 'input' if a.kind == 'RECV_F' else 'output'
      waiting[side] += 1
      reader = (Action('F', a.micro_batch, stage) if side == 'input' else
                schedule.first_backward(stage, a.micro_batch))
      readers.setdefault(reader, []).append(side)
    elif a.kind == 'SEND_F':
      sends['output'] = 1
    elif a.kind == 'SEND_B':
      sends['input'] = 1
    for side in peak:
      peak[side] = max(peak[side], waiting[side])
    for side in readers.pop(a, []):
      waiting[side] -= 1
  return {side: peak[side] + sends[side] for side in peak}


def _slots(ops: tuple[Action, ...]) -> list[int]:
  """Each action's place in its device's order, counting an R and the B
  (or I) of its micro-batch right after it as one: the executor runs the
  two as one call, so lookahead counted in actions would post a
  recompute schedule's recvs one call ahead where three were meant."""
  slots, slot = [], -1
  for i, a in enumerate(ops):
    prev = ops[i - 1] if i else None
    if not (prev is not None and prev.kind == 'R' and a.kind in ('B', 'I')
            and (prev.stage, prev.micro_batch) == (a.stage, a.micro_batch)):
      slot += 1
    slots.append(slot)
  return slots


def _recvs_for(schedule: Schedule, a: Action,
               crosses: Callable[[int, int], bool]) -> list[Action]:
  """The recvs `a` reads from (posted ahead of it)."""
  s, m = a.stage, a.micro_batch
  if a.kind == 'F' and s > 0 and crosses(s - 1, s):
    return [Action('RECV_F', m, s)]
  if (a.kind in ('R', 'B', 'I') and s < schedule.last and crosses(s + 1, s)
      and schedule.first_backward(s, m) == a):
    return [Action('RECV_B', m, s)]
  return []


def _sends_after(schedule: Schedule, a: Action,
                 crosses: Callable[[int, int], bool]) -> list[Action]:
  s, m = a.stage, a.micro_batch
  if a.kind == 'F' and s < schedule.last and crosses(s, s + 1):
    return [Action('SEND_F', m, s)]
  if a.kind in ('B', 'I') and s > 0 and crosses(s, s - 1):
    return [Action('SEND_B', m, s)]
  return []
