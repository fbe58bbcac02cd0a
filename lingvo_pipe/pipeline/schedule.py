"""Pipeline schedules as data: which op each device runs, in which order.

A schedule lists, for each device, the ops that device runs in one training
step, in order. The one object drives the engine (`engine.py` emits each op
on its device, in this order, in one process or in one process per device),
the simulator (`simulator.py`) and the tests, which check it as a picture:
under unit op costs, GPipe's forward pass is the fill-drain diagonal "device
k runs micro-batch m at tick k + m".

Op kinds, for micro-batch m of (virtual) stage s:

  F  forward. Needs F of (s-1, m): the stage's input activations.
  R  recompute: re-runs the forward to rebuild the activations that F threw
     away. With recompute, the backward of a micro-batch is R then B on that
     stage. R starts when the gradient of (s+1, m) has arrived, so at most
     one micro-batch's activations are alive per stage.
  B  backward. Needs B of (s+1, m) (the output gradient) or, on the last
     stage, its own F (the loss).

Schedules: 'gpipe' (all forwards, then all backwards), '1f1b'
(PipeDream-flush: K-k forwards in flight on device k instead of M) and
'interleaved' (Megatron's virtual stages: device d holds chunks c = 0..v-1,
which are stages s = c·K + d, and the bubble shrinks by v). Each op names
its chunk; chunk 0 is the only one outside 'interleaved'.

Recompute policies ('always', 'needed', 'except_last', 'never') decide
which stages have R ops; `Schedule.recomputes(stage)` is the one place that
says so. 'needed' is 'always' less each R that would directly follow its
own F on the device (the last micro-batch of GPipe on every stage, every
micro-batch of 1F1B's last stage): nothing runs between the two, so keeping
that forward's activations holds no more memory than rebuilding them at
once, and the R is only extra time on the critical path (torchgpipe's
'except_last' skips the last micro-batch's checkpoint for the same reason).
`Schedule.rebuilds(stage, m)` says which micro-batches have an R.

>>> [str(op) for op in gpipe_schedule(2, 2, 'never')[0]]
['F0', 'F1', 'B1', 'B0']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, NamedTuple, Sequence

from lingvo_pipe import errors

__all__ = [
    'Op', 'RECOMPUTE_POLICIES', 'SCHEDULES', 'Schedule', 'ScheduleError',
    'check_schedule', 'clock_cycles', 'dependencies', 'emission_order',
    'gpipe_schedule', 'interleaved_schedule', 'make_schedule',
    'one_f_one_b_schedule', 'run_times',
]

RECOMPUTE_POLICIES = ('always', 'needed', 'except_last', 'never')
SCHEDULES = ('gpipe', '1f1b', 'interleaved')


class ScheduleError(errors.LingvoPipeError):
  """A schedule that is malformed, or that cannot run to completion."""


class Op(NamedTuple):
  """One unit of work on a device: kind 'F', 'R' or 'B' of one micro-batch
  of one of the device's chunks (virtual stages)."""
  kind: str
  micro_batch: int
  chunk: int = 0

  def __str__(self) -> str:
    suffix = f'c{self.chunk}' if self.chunk else ''
    return f'{self.kind}{self.micro_batch}{suffix}'


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-device op lists, and what they were built for.

  Indexing and iterating give the op list of each device, so a schedule
  reads like the plain list of lists that the module functions also accept.
  """
  name: str
  ops: tuple[tuple[Op, ...], ...]
  num_micro_batches: int
  recompute: str
  num_chunks: int = 1

  def __getitem__(self, device: int) -> tuple[Op, ...]:
    return self.ops[device]

  def __len__(self) -> int:
    return len(self.ops)

  def __iter__(self) -> Iterator[tuple[Op, ...]]:
    return iter(self.ops)

  @property
  def num_devices(self) -> int:
    return len(self.ops)

  @property
  def num_stages(self) -> int:
    """Virtual stages: num_devices × num_chunks."""
    return len(self.ops) * self.num_chunks

  def stage(self, device: int, op: Op) -> int:
    """The (virtual) stage that `op` on `device` belongs to."""
    return op.chunk * len(self.ops) + device

  def place(self, stage: int) -> tuple[int, int]:
    """(device, chunk) of a stage."""
    return stage % len(self.ops), stage // len(self.ops)

  def recomputes(self, stage: int) -> bool:
    """Whether `stage`'s policy rebuilds activations (R) instead of keeping
    them; see `rebuilds` for the micro-batches that keep theirs anyway."""
    return _recomputes(stage, self.num_stages, self.recompute)

  def rebuilds(self, stage: int, micro_batch: int) -> bool:
    """Whether micro-batch m of `stage` has an R op (else its F is kept)."""
    device, chunk = self.place(stage)
    return (chunk, micro_batch) in self._rebuilt_per_device[device]

  @functools.cached_property
  def _rebuilt_per_device(self) -> list[set[tuple[int, int]]]:
    """Per device, (chunk, micro-batch) of its R ops (asked per op)."""
    return [_rebuilt(ops) for ops in self.ops]


def _check(num_stages: int, num_micro_batches: int, recompute: str) -> None:
  for name, value in (('num_stages', num_stages),
                      ('num_micro_batches', num_micro_batches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ScheduleError(f'{name} must be an int ≥ 1, got {value!r}.')
  if recompute not in RECOMPUTE_POLICIES:
    raise ScheduleError(f'recompute={recompute!r} is not one of '
                        f'{RECOMPUTE_POLICIES}.')


def _recomputes(stage: int, num_stages: int, recompute: str) -> bool:
  return recompute in ('always', 'needed') or (
      recompute == 'except_last' and stage < num_stages - 1)


def _backward(stage: int, num_stages: int, recompute: str, m: int,
              chunk: int = 0) -> list[Op]:
  if _recomputes(stage, num_stages, recompute):
    return [Op('R', m, chunk), Op('B', m, chunk)]
  return [Op('B', m, chunk)]


def _without_adjacent_r(ops: list[Op]) -> list[Op]:
  """`ops` less each R that directly follows its own F ('needed')."""
  out: list[Op] = []
  for op in ops:
    if not (op.kind == 'R' and out and
            out[-1] == Op('F', op.micro_batch, op.chunk)):
      out.append(op)
  return out


def _schedule(name: str, ops: list[list[Op]], num_micro_batches: int,
              recompute: str, num_chunks: int = 1) -> Schedule:
  if recompute == 'needed':
    ops = [_without_adjacent_r(o) for o in ops]
  return Schedule(name, tuple(tuple(o) for o in ops), num_micro_batches,
                  recompute, num_chunks)


def gpipe_schedule(num_stages: int, num_micro_batches: int,
                   recompute: str = 'always') -> Schedule:
  """GPipe fill-drain: all forwards in order, then backwards in reverse.

  Stage k runs F0 .. F(M-1), then [R(M-1)] B(M-1) .. [R0] B0; every
  stage holds all M micro-batches in flight.
  """
  _check(num_stages, num_micro_batches, recompute)
  out = []
  for k in range(num_stages):
    ops = [Op('F', m) for m in range(num_micro_batches)]
    for m in reversed(range(num_micro_batches)):
      ops += _backward(k, num_stages, recompute, m)
    out.append(ops)
  return _schedule('gpipe', out, num_micro_batches, recompute)


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int,
                         recompute: str = 'always') -> Schedule:
  """PipeDream-flush (1F1B): the same step time as GPipe, less memory.

  Stage k warms up with min(K-k-1, M) forwards, then alternates one forward
  and one backward, then drains the remaining backwards; one synchronous
  update follows the step, as in GPipe. A stage holds at most K-k
  micro-batches in flight instead of M.
  """
  _check(num_stages, num_micro_batches, recompute)
  out = []
  for k in range(num_stages):
    warmup = min(num_stages - k - 1, num_micro_batches)
    ops = [Op('F', m) for m in range(warmup)]
    for m in range(num_micro_batches - warmup):
      ops.append(Op('F', m + warmup))
      ops += _backward(k, num_stages, recompute, m)
    for m in range(num_micro_batches - warmup, num_micro_batches):
      ops += _backward(k, num_stages, recompute, m)
    out.append(ops)
  return _schedule('1f1b', out, num_micro_batches, recompute)


def interleaved_schedule(num_devices: int, num_micro_batches: int,
                         recompute: str = 'always',
                         num_chunks: int = 2) -> Schedule:
  """Interleaved 1F1B (Megatron-LM): v chunks per device, bubble ÷ v.

  Device d holds stages d, d+K, …, d+(v-1)·K. Forwards go in groups of K
  micro-batches per chunk (chunk 0 of micro-batches 0..K-1, then chunk 1
  of the same, …); device d warms up with 2·(K-d-1) + (v-1)·K forwards,
  then alternates one forward and one backward (backwards visit the chunks
  in reverse), then drains. M must be a multiple of K.
  """
  _check(num_devices, num_micro_batches, recompute)
  if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or (
      num_chunks < 1):
    raise ScheduleError(f'num_chunks must be an int ≥ 1, got {num_chunks!r}.')
  k, m_total, v = num_devices, num_micro_batches, num_chunks
  if m_total % k:
    raise ScheduleError(
        f'The interleaved schedule needs num_micro_batches to be a multiple '
        f'of the {k} devices, got {m_total}; use e.g. num_micro_batches='
        f'{k * max(1, round(m_total / k))}.')
  total = m_total * v

  def _pick(i: int, backward: bool) -> tuple[int, int]:
    chunk = (i // k) % v
    return (i // (k * v)) * k + i % k, (v - 1 - chunk if backward else chunk)

  out = []
  for d in range(k):
    warmup = min((k - d - 1) * 2 + (v - 1) * k, total)
    ops = [Op('F', *_pick(i, False)) for i in range(warmup)]
    for i in range(total):
      if warmup + i < total:
        ops.append(Op('F', *_pick(warmup + i, False)))
      m, c = _pick(i, True)
      ops += _backward(c * k + d, k * v, recompute, m, c)
    out.append(ops)
  return _schedule('interleaved', out, num_micro_batches, recompute, v)


def make_schedule(name: str, num_stages: int, num_micro_batches: int,
                  recompute: str = 'always', num_chunks: int = 1) -> Schedule:
  """The schedule called `name`; `num_stages` counts devices.

  `num_chunks` (virtual stages per device) applies to 'interleaved' only.
  """
  if name == 'gpipe':
    return gpipe_schedule(num_stages, num_micro_batches, recompute)
  if name == '1f1b':
    return one_f_one_b_schedule(num_stages, num_micro_batches, recompute)
  if name == 'interleaved':
    return interleaved_schedule(num_stages, num_micro_batches, recompute,
                                num_chunks)
  raise ScheduleError(f'schedule={name!r} is not one of {SCHEDULES}.')


def _rebuilt(ops: Sequence[Op]) -> set[tuple[int, int]]:
  """(chunk, micro-batch) of each R op on a device."""
  return {(op.chunk, op.micro_batch) for op in ops if op.kind == 'R'}


def dependencies(schedule: Sequence[Sequence[Op]], device: int,
                 op: Op) -> list[tuple[int, Op]]:
  """The (device, op) pairs that must finish before `op` starts on `device`."""
  return _dependencies(device, op, len(schedule), _num_chunks(schedule),
                       (op.chunk, op.micro_batch) in _rebuilt(
                           schedule[device]))


def _num_chunks(schedule: Sequence[Sequence[Op]]) -> int:
  return 1 + max((op.chunk for ops in schedule for op in ops), default=0)


def _dependencies(d: int, op: Op, num_devices: int, num_chunks: int,
                  rebuilt: bool) -> list[tuple[int, Op]]:
  m, c = op.micro_batch, op.chunk
  stage = c * num_devices + d
  last = num_devices * num_chunks - 1

  def _at(s: int, kind: str) -> tuple[int, Op]:
    return s % num_devices, Op(kind, m, s // num_devices)

  if op.kind == 'F':
    return [_at(stage - 1, 'F')] if stage > 0 else []
  # The output gradient; on the last stage, the loss from its own F.
  upstream = [_at(stage + 1, 'B')] if stage < last else []
  if op.kind == 'R':
    return [(d, Op('F', m, c))] + upstream
  return [(d, Op('R' if rebuilt else 'F', m, c))] + upstream


def check_schedule(schedule: Sequence[Sequence[Op]]) -> int:
  """Checks that every stage runs F and B of each micro-batch exactly once.

  R is optional per micro-batch (a kept forward has none) and appears at
  most once.

  Returns:
    The number of micro-batches M.

  Raises:
    ScheduleError: naming the device and the missing or extra ops.
  """
  if not schedule or not schedule[0]:
    raise ScheduleError('The schedule has no stages; give one op list per '
                        'device, e.g. gpipe_schedule(num_stages, M).')
  num_chunks = _num_chunks(schedule)
  num_micro_batches = sum(op.kind == 'F' for op in schedule[0]) // num_chunks
  expected, allowed = ({Op(kind, m, c) for c in range(num_chunks)
                        for m in range(num_micro_batches) for kind in kinds}
                       for kinds in ('FB', 'FRB'))
  for d, ops in enumerate(schedule):
    bad = [str(op) for op in ops if op.kind not in 'FRB' or len(op.kind) != 1]
    if bad:
      raise ScheduleError(f'Stage {d} has ops of unknown kind {bad}; kinds '
                          'are F, R and B.')
    if len(ops) != len(set(ops)) or not expected <= set(ops) <= allowed:
      missing = sorted(str(op) for op in expected - set(ops))
      extra = sorted({str(op) for op in ops if ops.count(op) > 1} |
                     {str(op) for op in set(ops) - allowed})
      raise ScheduleError(
          f'Stage {d} must run F and B (and R, if any) of micro-batches '
          f'0..{num_micro_batches - 1} exactly once; missing {missing}, '
          f'repeated or unexpected {extra}.')
  return num_micro_batches


def run_times(schedule: Sequence[Sequence[Op]],
              op_time: Callable[[int, Op], float],
              transfer_time: float | Callable[[int, int], float] = 0.0,
              link_busy: Callable[[int, int], float] | None = None
              ) -> list[list[tuple[float, float]]]:
  """(start, end) of every op when each device runs its list in order.

  An op starts once its device is free and its dependencies are done; a
  dependency on another device also pays `transfer_time` (activations or
  gradients crossing devices).

  Args:
    schedule: ops per device, e.g. from `gpipe_schedule`.
    op_time: duration of `op` on `device`.
    transfer_time: per micro-batch device-to-device transfer time, or a
      callable (from device, to device) → seconds (`links.Cluster`).
    link_busy: if given, (from, to) → the part of a transfer's time during
      which its link carries nothing else (bytes ÷ bandwidth): transfers
      in one direction then queue, in the order their readers take them;
      the rest of `transfer_time` (latency) overlaps.

  Returns:
    Same shape as `schedule`: the (start, end) of each op.

  Raises:
    ScheduleError: a malformed schedule (`check_schedule`), or devices that
      wait on each other forever (the message lists the stuck ops).
  """
  check_schedule(schedule)
  num_devices, num_chunks = len(schedule), _num_chunks(schedule)
  rebuilt = [_rebuilt(ops) for ops in schedule]
  done: dict[tuple[int, Op], float] = {}
  times: list[list[tuple[float, float]]] = [[] for _ in schedule]
  free = [0.0] * num_devices
  arrivals: dict[tuple[int, Op, int], float] = {}  # Each transfer, once.
  link_free: dict[tuple[int, int], float] = {}

  def arrival(s: int, o: Op, d: int) -> float:
    if s == d:
      return done[(s, o)]
    if (s, o, d) not in arrivals:
      begin = done[(s, o)]
      if link_busy is not None:  # One transfer at a time per direction.
        begin = max(begin, link_free.get((s, d), 0.0))
        link_free[(s, d)] = begin + link_busy(s, d)
      arrivals[(s, o, d)] = begin + (transfer_time(s, d) if callable(
          transfer_time) else transfer_time)
    return arrivals[(s, o, d)]

  while True:
    progressed = False
    for d, ops in enumerate(schedule):
      while len(times[d]) < len(ops):
        op = ops[len(times[d])]
        deps = _dependencies(d, op, num_devices, num_chunks,
                             (op.chunk, op.micro_batch) in rebuilt[d])
        if any(dep not in done for dep in deps):
          break
        start = max([free[d]] + [arrival(s, o, d) for s, o in deps])
        end = start + op_time(d, op)
        times[d].append((start, end))
        done[(d, op)] = free[d] = end
        progressed = True
    if all(len(t) == len(ops) for t, ops in zip(times, schedule)):
      return times
    if not progressed:
      stuck = [f'stage {d}: {ops[len(times[d])]}'
               for d, ops in enumerate(schedule) if len(times[d]) < len(ops)]
      raise ScheduleError('The schedule cannot finish; these ops wait on '
                          f'ops that never run first: {", ".join(stuck)}.')


def clock_cycles(schedule: Sequence[Sequence[Op]]) -> list[list[int]]:
  """The tick each op starts at when every op takes one tick.

  >>> clock_cycles(gpipe_schedule(2, 2, 'never'))
  [[0, 1, 4, 5], [1, 2, 3, 4]]
  """
  times = run_times(schedule, lambda d, op: 1.0)
  return [[int(start) for start, _ in ops] for ops in times]


def emission_order(schedule: Sequence[Sequence[Op]]) -> list[tuple[int, Op]]:
  """Every (device, op) in an order that respects all dependencies.

  The unit-cost clock, ties broken by device: the order in which a single
  Python thread can emit the ops (each op's inputs exist when it is
  emitted), and in which eager execution runs them.
  """
  ticks = clock_cycles(schedule)
  return [(d, op) for _, d, op in sorted(
      (t, d, op) for d, ops in enumerate(schedule)
      for op, t in zip(ops, ticks[d]))]
