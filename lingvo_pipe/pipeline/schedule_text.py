"""Schedules as text: read, write and check them before anything runs.

One row per device, its actions in order, readable in a terminal:

    # 1F1B with one more warm-up forward than usual on device 0
    device 0: F0 F1 F2 R0 B0 F3 R1 B1 R2 B2 R3 B3
    device 1: F0 R0 B0 F1 R1 B1 F2 R2 B2 F3 R3 B3

An action is its kind and micro-batch (`F3`), with `@stage` where a device
holds several stages (`F3@2`); without it, the action is of stage d on
device d. Kinds: F, R, B, I, W (see `actions.py`); transfers are inserted
by the engine, never written. `#` starts a comment.

`validate` refuses, before any op runs, a schedule that misses or repeats
an action, puts an R anywhere but directly before its B or I, or would
deadlock (a dry run with unit costs): one line naming the device and the
action, then the grid with that action marked.

>>> s = from_text('device 0: F0 B0\\ndevice 1: F0 B0')
>>> print(to_text(s))
# custom: 2 devices, 2 stages, M=1
device 0: F0 B0
device 1: F0 B0
"""

from __future__ import annotations

import os
import re

from lingvo_pipe.pipeline import actions as actions_lib
from lingvo_pipe.pipeline.actions import Action, Schedule, ScheduleError

__all__ = ['check_actions', 'from_text', 'grid', 'load', 'read', 'to_text',
           'validate']

_ROW = re.compile(r'^\s*(?:device\s*)?(\d+)\s*:(.*)$')
_ACTION = re.compile(r'^([A-Z_]+?)(\d+)(?:@(\d+))?$')


def to_text(schedule: Schedule, transfers: bool = False) -> str:
  """The schedule as text rows (`transfers`: show SEND/RECV too)."""
  if not transfers:
    schedule = schedule.compute()
  lines = [f'# {schedule.name}: {schedule.num_devices} devices, '
           f'{schedule.num_stages} stages, M={schedule.num_micro_batches}']
  for d, ops in enumerate(schedule):
    lines.append(f'device {d}: ' + _row(schedule, d, ops))
  return '\n'.join(lines)


def _row(schedule: Schedule, d: int, ops, mark: int | None = None) -> str:
  with_stage = schedule.stages_of(d) != (d,)
  labels = [a.label(with_stage) for a in ops]
  if mark is not None:
    labels[mark] = f'[{labels[mark]}]'
  return ' '.join(labels)


def grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
  """Rows of the schedule (as `to_text`), with action `mark` = (device,
  index in its list) bracketed and its row flagged."""
  lines = []
  for d, ops in enumerate(schedule):
    here = mark[1] if mark is not None and mark[0] == d else None
    lines.append(f'  device {d}: {_row(schedule, d, ops, here)}' +
                 ('   <-- here' if here is not None else ''))
  return '\n'.join(lines)


def from_text(text: str, name: str = 'custom') -> Schedule:
  """Parses rows 'device d: A A A …' into a validated Schedule."""
  rows: dict[int, list[tuple[str, int, int]]] = {}
  for number, line in enumerate(text.splitlines(), 1):
    line = line.split('#', 1)[0].strip()
    if not line:
      continue
    found = _ROW.match(line)
    if not found:
      raise ScheduleError(
          f'Schedule text line {number} {line!r:.60} is not a row; write '
          '"device 0: F0 F1 B1 B0", one row per device.')
    d = int(found[1])
    if d in rows:
      raise ScheduleError(f'Schedule text line {number}: device {d} has a '
                          'second row; give each device one row.')
    rows[d] = [_parse(token, d, number) for token in found[2].split()]
  if sorted(rows) != list(range(len(rows))) or not rows:
    raise ScheduleError(f'Schedule text has rows for devices {sorted(rows)}; '
                        'give one row per device, numbered from 0.')
  schedule = Schedule.from_lists(name, [rows[d] for d in range(len(rows))])
  validate(schedule)
  return schedule


def _parse(token: str, device: int, line: int) -> tuple[str, int, int]:
  found = _ACTION.match(token)
  if not found or found[1] not in actions_lib.COMPUTE_KINDS:
    hint = (' (transfers are inserted by the engine; leave them out)'
            if found and found[1] in actions_lib.TRANSFER_KINDS else '')
    raise ScheduleError(
        f'Schedule text line {line}, device {device}: {token!r} is not an '
        f'action{hint}; write kind and micro-batch, e.g. F3 or B3@2 '
        f'(kinds {", ".join(actions_lib.COMPUTE_KINDS)}).')
  stage = int(found[3]) if found[3] is not None else device
  return found[1], int(found[2]), stage


def read(spec: str) -> Schedule:
  """A validated schedule from its text or a file path (named after the
  file, else 'custom')."""
  if '\n' not in spec and os.path.isfile(spec):
    with open(spec, encoding='utf-8') as f:
      return from_text(f.read(), os.path.basename(spec))
  return from_text(spec)


def load(spec: str, num_devices: int,
         num_micro_batches: int | None) -> Schedule:
  """A schedule from its text or a file path, checked against the
  pipeline's K devices and M micro-batches (None: any M)."""
  schedule = read(spec)
  name = schedule.name
  if schedule.num_devices != num_devices:
    raise ScheduleError(
        f'The schedule {name!r} has {schedule.num_devices} device rows but '
        f'the pipeline has num_stages={num_devices}; write one row per '
        'device.')
  if num_micro_batches not in (None, schedule.num_micro_batches):
    raise ScheduleError(
        f'The schedule {name!r} runs {schedule.num_micro_batches} micro-'
        f'batches but the pipeline splits the batch into {num_micro_batches}'
        f'; set num_micro_batches={schedule.num_micro_batches} or write the '
        'schedule for that M.')
  return schedule


def check_actions(schedule: Schedule) -> int:
  """Every stage runs F and B (or I and W) of each micro-batch exactly
  once and R at most once, each on the stage's device. Returns M."""
  if not schedule.num_devices or not any(schedule):
    raise ScheduleError('The schedule has no actions; give one action list '
                        'per device, e.g. gpipe_schedule(num_stages, M).')
  m_total = schedule.num_micro_batches
  seen: dict[Action, tuple[int, int]] = {}
  for d, ops in enumerate(schedule.compute()):
    for i, a in enumerate(ops):
      where = (d, i)
      if a.kind not in actions_lib.COMPUTE_KINDS:
        _fail(schedule, where, f'{a} has an unknown kind; kinds are '
              f'{", ".join(actions_lib.COMPUTE_KINDS)}.')
      if not 0 <= a.stage < schedule.num_stages or (
          schedule.device_of(a.stage) != d):
        _fail(schedule, where, f'{a} is of a stage this device does not '
              'hold; a stage runs on one device.')
      if a in seen:
        _fail(schedule, where, f'{a} is repeated; each action runs once.')
      seen[a] = where
  for s in range(schedule.num_stages):
    for m in range(m_total):
      if Action('B', m, s) in seen and Action('I', m, s) in seen:
        _fail(schedule, seen[Action('I', m, s)], f'stage {s} has both B{m} '
              f'and I{m}: a backward is either B, or I then W.')
      missing = [k for k in _expected(schedule, s, m)
                 if Action(k, m, s) not in seen]
      if missing:
        d = schedule.device_of(s)
        _fail(schedule, (d, None), f'stage {s} lacks '
              f'{", ".join(k + str(m) for k in missing)}: every stage runs '
              'F and B (or I and W) of each micro-batch 0..'
              f'{m_total - 1} once.', device=d)
  return m_total


def _expected(schedule: Schedule, s: int, m: int) -> list[str]:
  if schedule.has('I', s, m) or schedule.has('W', s, m):
    return ['F', 'I', 'W']
  return ['F', 'B']


def validate(schedule: Schedule) -> int:
  """`check_actions`, R placement, and a dry run for deadlocks. Returns M."""
  m_total = check_actions(schedule)
  for d, ops in enumerate(schedule.compute()):
    for i, a in enumerate(ops):
      if a.kind == 'R' and (i + 1 == len(ops) or ops[i + 1] not in (
          Action('B', a.micro_batch, a.stage),
          Action('I', a.micro_batch, a.stage))):
        _fail(schedule, (d, i), f'{a} must directly precede its B or I '
              '(the two run as one call).')
  try:
    actions_lib.run_times(schedule, lambda d, a: 1.0)
  except actions_lib.Deadlock as e:
    compute = schedule.compute()
    # Name the action that waits on its own device's later action: the
    # one out of order. Others wait on it, directly or not.
    d, i = next(((d, i) for d, i in e.stuck if any(
        pd == d and compute[d].index(p) > i
        for pd, p in schedule.dependencies(d, compute[d][i]))), e.stuck[0])
    a = compute[d][i]
    later = [str(p) for pd, p in schedule.dependencies(d, a)
             if pd == d and compute[d].index(p) > i]
    if later:
      why = f'waits for {", ".join(later)}, which device {d} runs after it'
    else:
      why = 'waits for ' + ', '.join(
          f'{p} (device {pd})' for pd, p in schedule.dependencies(d, a))
      why += ', which wait on it in turn'
    _fail(schedule, (d, i), f'{a} {why}: the schedule deadlocks.')
  return m_total


def _fail(schedule: Schedule, where: tuple[int, int | None], what: str,
          device: int | None = None) -> None:
  d, i = where
  head = f'Schedule {schedule.name!r}, device {d if device is None else device}'
  body = grid(schedule.compute(), None if i is None else (d, i))
  raise ScheduleError(f'{head}: {what}\n{body}')
