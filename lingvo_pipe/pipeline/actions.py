"""A step as data: one action list per device, and what each action reads.

Everything about a pipelined training step is read off one object, the
`Schedule`: for each device, the actions it runs, in order. An action is
(kind, micro-batch, stage):

  F  forward of stage s on micro-batch m.
  R  recompute: rebuilds F's activations from the saved input once the
     incoming gradient is there, and runs the backward that follows it in
     the same call (they share the tape), so R must directly precede its B
     or I on the device; that B or I then hands on what R made.
  B  backward: the gradient of the stage's input and of its weights.
  I  input gradient only (zero-bubble schedules): what the previous stage
     waits for; keeps what W needs.
  W  weight gradient of what I kept: nothing downstream waits for it.
  SEND_F, RECV_F, SEND_B, RECV_B  a boundary crossing processes: stage s
     sends its output (SEND_F) or its input's gradient (SEND_B); stage s
     receives its input (RECV_F) or its output's gradient (RECV_B).
     The transfer pass (`transfers.py`) inserts them into a compute-only
     schedule.

Each action declares the values it reads and writes, as keys (family,
stage, micro-batch) — `Schedule.io`. That declaration is the only
statement of the data flow: the dependencies (`Schedule.dependencies`), the
emission order, the loop planner (`loops.py`), the simulator, the memory
model's transfer buffers and the executor (`executor.py`, which reads and
writes exactly these keys) all derive from it. Families:

  input, label, seed  given by the caller per micro-batch: stage 0's
                      inputs, the last stage's labels, the gradients of the
                      last stage's outputs (when the loss is outside).
  x      a stage's input, kept for its backward.
  y      a stage's outputs.
  act    what R made for its B or I (the backward it ran).
  tape   a kept forward's GradientTape (cannot leave the graph that made it).
  dx     the gradient of a stage's input (stage 0's: the inputs' gradient).
  w      what I kept for W.
  recv, drecv   a received input, a received output gradient.
  wire_f, wire_b  a transfer in flight: no value, only an edge between the
                  two processes, for the dependencies.

>>> s = Schedule.from_lists('demo', [[('F', 0), ('B', 0)], [('F', 0), ('B', 0)]])
>>> s.dependencies(1, Action('B', 0, 1))
[(1, Action(kind='F', micro_batch=0, stage=1))]
>>> [str(a) for a in s.with_transfers()[0]]
['RECV_B0@0', 'F0@0', 'SEND_F0@0', 'B0@0']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

from lingvo_pipe import errors

__all__ = [
    'Action', 'COMPUTE_KINDS', 'EXTERNAL_FAMILIES', 'LOCAL_FAMILIES',
    'RECV_LOOKAHEAD', 'Schedule', 'ScheduleError', 'TRANSFER_KINDS',
    'WIRE_FAMILIES', 'clock_cycles', 'emission_order', 'run_times',
    'ticked_order',
]

COMPUTE_KINDS = ('F', 'R', 'B', 'I', 'W')
TRANSFER_KINDS = ('SEND_F', 'RECV_F', 'SEND_B', 'RECV_B')
# Values the caller gives; no action makes them.
EXTERNAL_FAMILIES = ('input', 'label', 'seed')
# Edges between processes: no value travels in the graph of either.
WIRE_FAMILIES = ('wire_f', 'wire_b')
# Values that cannot leave the graph (a loop iteration) that made them.
LOCAL_FAMILIES = ('tape',)
# A recv is posted this many compute actions of its device before its
# reader: a recv posted before its send gets the data as soon as it is sent,
# one posted after waits a round trip (docs/benchmarks.md has the figures).
# Each action ahead may hold one more boundary buffer per recv; the memory
# model counts them from the action lists (`transfer_buffers`).
RECV_LOOKAHEAD = 3

Key = tuple[str, int, int]  # (family, stage, micro-batch)


class ScheduleError(errors.LingvoPipeError):
  """A schedule that is malformed, or that cannot run to completion."""


class Action(NamedTuple):
  """One unit of work of a device: `kind` of micro-batch m of stage s."""
  kind: str
  micro_batch: int
  stage: int = 0

  def __str__(self) -> str:
    return f'{self.kind}{self.micro_batch}@{self.stage}'

  def label(self, with_stage: bool) -> str:
    """'F3' or, where a device holds several stages, 'F3@2'."""
    return str(self) if with_stage else f'{self.kind}{self.micro_batch}'


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-device action lists, and what they were built for.

  Indexing and iterating give each device's actions. `stage_devices[s]` is
  the device that runs stage s (round-robin, or a V for zero-bubble's
  two-chunk schedules): the one place that says where a stage runs.
  """
  name: str
  actions: tuple[tuple[Action, ...], ...]
  num_micro_batches: int
  recompute: str
  stage_devices: tuple[int, ...]

  @classmethod
  def from_lists(cls, name: str, lists: Sequence[Sequence[Sequence]],
                 recompute: str = 'custom',
                 stage_devices: Sequence[int] | None = None) -> 'Schedule':
    """A schedule from per-device lists of (kind, m[, stage]) tuples.

    Without `stage_devices`, device d holds the stages its actions name
    (stage d where an action names none).
    """
    actions = tuple(tuple(Action(a[0], a[1], a[2] if len(a) > 2 else d)
                          for a in ops) for d, ops in enumerate(lists))
    if stage_devices is None:
      where: dict[int, int] = {}
      for d, ops in enumerate(actions):
        for a in ops:
          if where.setdefault(a.stage, d) != d:
            raise ScheduleError(f'Stage {a.stage} has actions on devices '
                                f'{where[a.stage]} and {d}; a stage runs on '
                                'one device.')
      if sorted(where) != list(range(len(where))):
        raise ScheduleError(f'Stages {sorted(where)} are not 0..S-1; number '
                            'the stages from 0 without gaps.')
      stage_devices = [where[s] for s in range(len(where))]
    num_micro = 1 + max((a.micro_batch for ops in actions for a in ops),
                        default=-1)
    return cls(name, actions, num_micro, recompute, tuple(stage_devices))

  def to_text(self, transfers: bool = False) -> str:
    """One row per device (`schedule_text.to_text`)."""
    from lingvo_pipe.pipeline import schedule_text  # pylint: disable=C0415
    return schedule_text.to_text(self, transfers)

  @classmethod
  def from_text(cls, text: str, name: str = 'custom') -> 'Schedule':
    """Parses and validates rows 'device d: F0 F1 …'
    (`schedule_text.from_text`)."""
    from lingvo_pipe.pipeline import schedule_text  # pylint: disable=C0415
    return schedule_text.from_text(text, name)

  # ---- Shape -----------------------------------------------------------------
  def __getitem__(self, device: int) -> tuple[Action, ...]:
    return self.actions[device]

  def __len__(self) -> int:
    return len(self.actions)

  def __iter__(self) -> Iterator[tuple[Action, ...]]:
    return iter(self.actions)

  @property
  def num_devices(self) -> int:
    return len(self.actions)

  @property
  def num_stages(self) -> int:
    return len(self.stage_devices)

  @property
  def num_chunks(self) -> int:
    """The most stages one device holds (v of interleaved, 2 of zb_v)."""
    return max((len(s) for s in self._stages_of), default=1)

  @property
  def last(self) -> int:
    return self.num_stages - 1

  def device_of(self, stage: int) -> int:
    return self.stage_devices[stage]

  def stages_of(self, device: int) -> tuple[int, ...]:
    return self._stages_of[device]

  @functools.cached_property
  def _stages_of(self) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s for s, d in enumerate(self.stage_devices) if d == dev)
                 for dev in range(self.num_devices))

  @functools.cached_property
  def _present(self) -> frozenset[tuple[str, int, int]]:
    return frozenset((a.kind, a.stage, a.micro_batch)
                     for ops in self.actions for a in ops)

  def has(self, kind: str, stage: int, micro_batch: int) -> bool:
    return (kind, stage, micro_batch) in self._present

  def recomputes(self, stage: int) -> bool:
    """Whether `stage` rebuilds any micro-batch's activations (has R)."""
    return any(self.has('R', stage, m) for m in range(self.num_micro_batches))

  def rebuilds(self, stage: int, micro_batch: int) -> bool:
    """Whether micro-batch m of `stage` has an R (else its F is kept)."""
    return self.has('R', stage, micro_batch)

  def splits(self, stage: int, micro_batch: int) -> bool:
    """Whether its backward is split into I and W."""
    return self.has('I', stage, micro_batch)

  @property
  def has_transfers(self) -> bool:
    return any(a.kind in TRANSFER_KINDS for ops in self.actions for a in ops)

  def compute(self) -> 'Schedule':
    """The same schedule without its transfer actions."""
    if not self.has_transfers:
      return self
    return dataclasses.replace(self, actions=tuple(
        tuple(a for a in ops if a.kind in COMPUTE_KINDS)
        for ops in self.actions))

  # ---- Data flow ---------------------------------------------------------------
  def io(self, action: Action, seeded: bool = False
        ) -> tuple[dict[str, Key], dict[str, Key]]:
    """(reads, writes) of `action`: role → key. `seeded`: the loss is
    outside the pipeline, so the last stage reads no labels and its
    backward starts from given output gradients."""
    kind, m, s = action
    rebuilt = self.rebuilds(s, m)
    if kind == 'F':
      reads = {'x': self._input_key(s, m)}
      if s == self.last and not seeded:
        reads['side'] = ('label', s, m)
      writes = {'y': ('y', s, m)}
      if s > 0 or not rebuilt:  # Stage 0's R reads the input again.
        writes['x'] = ('x', s, m)
      if not rebuilt:
        writes['tape'] = ('tape', s, m)
      return reads, writes
    if kind == 'R':
      reads = {'x': ('input', 0, m) if s == 0 else ('x', s, m),
               'dy': self._output_grad_key(s, m, seeded)}
      if s == self.last and not seeded:
        reads['side'] = ('label', s, m)
      return reads, {'act': ('act', s, m)}
    if kind in ('B', 'I'):
      writes = {'dx': ('dx', s, m)}
      if kind == 'I':
        writes['w'] = ('w', s, m)
      if rebuilt:
        return {'act': ('act', s, m)}, writes
      return {'x': ('x', s, m), 'dy': self._output_grad_key(s, m, seeded),
              'tape': ('tape', s, m), 'y': ('y', s, m)}, writes
    if kind == 'W':
      return {'w': ('w', s, m)}, {}
    if kind == 'SEND_F':
      return {'value': ('y', s, m)}, {'wire': ('wire_f', s + 1, m)}
    if kind == 'RECV_F':
      return {'wire': ('wire_f', s, m)}, {'value': ('recv', s, m)}
    if kind == 'SEND_B':
      return {'value': ('dx', s, m)}, {'wire': ('wire_b', s - 1, m)}
    if kind == 'RECV_B':
      return {'wire': ('wire_b', s, m)}, {'value': ('drecv', s, m)}
    raise ScheduleError(f'Unknown action kind {kind!r} in {action}; kinds are '
                        f'{COMPUTE_KINDS + TRANSFER_KINDS}.')

  def _input_key(self, s: int, m: int) -> Key:
    if s == 0:
      return ('input', 0, m)
    return ('recv', s, m) if self.has('RECV_F', s, m) else ('y', s - 1, m)

  def _output_grad_key(self, s: int, m: int, seeded: bool) -> Key:
    if s == self.last:  # The loss (its own F's output), or given gradients.
      return ('seed', s, m) if seeded else ('y', s, m)
    return ('drecv', s, m) if self.has('RECV_B', s, m) else ('dx', s + 1, m)

  @functools.cached_property
  def _producers(self) -> dict[Key, tuple[int, Action]]:
    made: dict[Key, tuple[int, Action]] = {}
    for d, ops in enumerate(self.actions):
      for a in ops:
        for key in self.io(a)[1].values():
          if key in made:
            raise ScheduleError(
                f'{key[0]} of stage {key[1]}, micro-batch {key[2]} is made '
                f'twice, by {made[key][1]} (device {made[key][0]}) and by {a} '
                f'(device {d}); each action runs once.')
          made[key] = (d, a)
    return made

  def producer(self, key: Key) -> tuple[int, Action] | None:
    """The (device, action) that makes `key` (None: given, or missing)."""
    return self._producers.get(key)

  def dependencies(self, device: int, action: Action
                  ) -> list[tuple[int, Action]]:
    """The (device, action) pairs that make what `action` reads."""
    del device  # An action's reads say it all.
    out = []
    for key in self.io(action)[0].values():
      if key[0] not in EXTERNAL_FAMILIES and key in self._producers:
        if self._producers[key] not in out:
          out.append(self._producers[key])
    return out

  # ---- Transfers -----------------------------------------------------------
  def with_transfers(self, crosses: Callable[[int, int], bool] | None = None,
                     lookahead: int = RECV_LOOKAHEAD) -> 'Schedule':
    """This schedule with SEND/RECV actions for each boundary that crosses
    processes (`transfers.insert`)."""
    from lingvo_pipe.pipeline import transfers  # pylint: disable=C0415
    return transfers.insert(self, crosses, lookahead)

  def transfer_buffers(self, stage: int) -> dict[str, int]:
    """Boundary buffers `stage` holds at once on each side
    (`transfers.buffers`)."""
    from lingvo_pipe.pipeline import transfers  # pylint: disable=C0415
    return transfers.buffers(self, stage)

  def first_backward(self, s: int, m: int) -> Action:
    """The action that reads (s, m)'s output gradient: R, B or I."""
    for kind in ('R', 'B', 'I'):
      if self.has(kind, s, m):
        return Action(kind, m, s)
    raise ScheduleError(f'Stage {s} has no backward of micro-batch {m}.')


# ---- Timing on paper ---------------------------------------------------------
def run_times(schedule: Schedule, op_time: Callable[[int, Action], float],
              transfer_time: float | Callable[[int, int], float] = 0.0,
              link_busy: Callable[[int, int], float] | None = None
             ) -> list[list[tuple[float, float]]]:
  """(start, end) of every compute action when each device runs its list in
  order: an action starts once its device is free and what it reads is
  made, + the transfer time when that crosses devices.

  Args:
    schedule: the schedule (its transfer actions take no device time).
    op_time: duration of an action on a device.
    transfer_time: per micro-batch device-to-device transfer time, or a
      callable (from device, to device) → seconds (`links.Cluster`).
    link_busy: if given, (from, to) → the part of a transfer's time during
      which its link carries nothing else (bytes ÷ bandwidth): transfers in
      one direction then queue, in the order their readers take them; the
      rest of `transfer_time` (latency) overlaps.

  Returns:
    Per device, the (start, end) of each compute action of
    `schedule.compute()`.

  Raises:
    ScheduleError: devices that wait on each other forever (`Deadlock`
      names the first stuck action of each device).
  """
  schedule = schedule.compute()
  hop = transfer_time if callable(transfer_time) else (
      lambda src, dst: float(transfer_time))
  deps = [[schedule.dependencies(d, a) for a in ops]
          for d, ops in enumerate(schedule)]
  done: dict[tuple[int, Action], float] = {}
  times: list[list[tuple[float, float]]] = [[] for _ in schedule]
  free = [0.0] * schedule.num_devices
  arrivals: dict[tuple[int, Action, int], float] = {}  # Each transfer once.
  link_free: dict[tuple[int, int], float] = {}

  def _arrival(src: int, made: Action, dst: int) -> float:
    if src == dst:
      return done[(src, made)]
    if (src, made, dst) not in arrivals:
      begin = done[(src, made)]
      if link_busy is not None:  # One transfer at a time per direction.
        begin = max(begin, link_free.get((src, dst), 0.0))
        link_free[(src, dst)] = begin + link_busy(src, dst)
      arrivals[(src, made, dst)] = begin + hop(src, dst)
    return arrivals[(src, made, dst)]

  while True:
    progressed = False
    for d, ops in enumerate(schedule):
      while len(times[d]) < len(ops):
        i = len(times[d])
        if any(dep not in done for dep in deps[d][i]):
          break
        start = max([free[d]] + [_arrival(pd, p, d) for pd, p in deps[d][i]])
        end = start + op_time(d, ops[i])
        times[d].append((start, end))
        done[(d, ops[i])] = free[d] = end
        progressed = True
    if all(len(t) == len(ops) for t, ops in zip(times, schedule)):
      return times
    if not progressed:
      raise Deadlock(schedule, [
          (d, len(times[d])) for d, ops in enumerate(schedule)
          if len(times[d]) < len(ops)])


class Deadlock(ScheduleError):
  """Actions that wait, directly or not, on actions queued behind them."""

  def __init__(self, schedule: Schedule, stuck: list[tuple[int, int]]
              ) -> None:
    self.schedule = schedule
    self.stuck = stuck  # (device, index in its list) of each first stuck one.
    names = ', '.join(f'device {d}: {schedule[d][i]}' for d, i in stuck)
    super().__init__('The schedule cannot finish; these actions wait on '
                     f'actions that never run first: {names}.')


def clock_cycles(schedule: Schedule) -> list[list[int]]:
  """The tick each compute action starts at when every one takes one tick.

  >>> s = Schedule.from_lists('g', [[('F', 0), ('F', 1), ('B', 1), ('B', 0)],
  ...                               [('F', 0), ('F', 1), ('B', 1), ('B', 0)]])
  >>> clock_cycles(s)
  [[0, 1, 4, 5], [1, 2, 3, 4]]
  """
  times = run_times(schedule, lambda d, a: 1.0)
  return [[int(start) for start, _ in ops] for ops in times]


def ticked_order(schedule: Schedule) -> list[tuple[int, int, Action]]:
  """(tick, device, action) of every action, in emission order.

  The compute actions by the unit-cost clock, ties broken by device (each
  action's inputs exist when it is emitted); each transfer action sits
  next to the compute action it is attached to in its device's list, with
  that action's tick: a recv just before the compute action that follows
  it, a send just after the one that precedes it.
  """
  ticks = clock_cycles(schedule)
  compute = schedule.compute()
  before: dict[tuple[int, Action], list[Action]] = {}
  after: dict[tuple[int, Action], list[Action]] = {}
  for d, ops in enumerate(schedule):
    pending: list[Action] = []
    last: Action | None = None
    for a in ops:
      if a.kind.startswith('RECV_'):
        pending.append(a)
      elif a.kind.startswith('SEND_'):
        if last is None:
          raise ScheduleError(f'Device {d} starts with {a}: a send follows '
                              'the action that made its value.')
        after.setdefault((d, last), []).append(a)
      else:
        if pending:
          before[(d, a)] = pending
          pending = []
        last = a
    if pending:
      raise ScheduleError(f'Device {d} ends with {pending[0]}: a recv needs a '
                          'compute action after it that reads it.')
  order = []
  for t, d, a in sorted((t, d, a) for d, ops in enumerate(compute)
                        for a, t in zip(ops, ticks[d])):
    order += [(t, d, r) for r in before.get((d, a), [])]
    order.append((t, d, a))
    order += [(t, d, s) for s in after.get((d, a), [])]
  return order


def emission_order(schedule: Schedule) -> list[tuple[int, Action]]:
  """Every (device, action) in an order one Python thread can emit them
  (`ticked_order` without the ticks)."""
  return [(d, a) for _, d, a in ticked_order(schedule)]


def keys_of(schedule: Schedule, pairs: Iterable[tuple[int, Action]],
            seeded: bool = False, writes: bool = True) -> set[Key]:
  """Every key the actions of `pairs` write (or read)."""
  return {key for _, a in pairs
          for key in schedule.io(a, seeded)[1 if writes else 0].values()}
