"""Which runs of a schedule repeat, and what a loop over them carries.

A schedule's emission order (`schedule.emission_order`: the unit-cost
clock, tick by tick) is mostly periodic. In GPipe's forward every tick of
the steady state runs F(k, m − k) on each device k, and the next tick the
same ops of micro-batch m + 1; in 1F1B two ticks run one F and one B per
device; GPipe's backward shifts by −1 and the interleaved schedule by K.
Emitted one op per (stage, micro-batch), tracing and graph size grow with
M. `plan` finds the periodic runs, so that the executor emits each as one
`tf.while_loop` whose body is a few periods: iteration i runs the body's
ops with micro-batch indices shifted by i × the body's shift.

Everything here is plain Python about keys; the executor owns the tensors.
What an action reads and writes is its declaration (`Schedule.io`: keys
(family, stage, micro-batch)); a `tape` (a kept forward's) cannot leave
the iteration that made it. The caller's values (inputs, labels, seeds)
are read by index everywhere, and a transfer's wire carries no value, so
neither is planned here. What a loop body reads that it did not make in
the same iteration comes

* from a *delay line*, if the loop makes that family: a key made δ
  iterations earlier is slot δ − 1 of a buffer of the latest values,
  carried from iteration to iteration (1F1B's saved stage inputs: the
  buffer is as long as the micro-batches a stage holds, so the memory
  bound stays); or
* by index from a *TensorArray*, if the family was made before the loop
  (GPipe's backward reads the inputs its forward saved).

What is read after a loop comes from the delay line's last values when it
is recent, else from a TensorArray that the loop writes.

The first period of a run is emitted as ordinary ops: after it, every
carried value (accumulated gradients, statistics, each device's last op)
exists and has the shape the loop carries.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, Sequence

from lingvo_pipe.pipeline import actions as actions_lib
from lingvo_pipe.pipeline.actions import LOCAL_FAMILIES, Action, Schedule

Key = actions_lib.Key  # (family, stage, micro-batch)
Family = tuple[str, int]  # (family, stage)
IO = Callable[[int, Action], tuple[list[Key], list[Key]]]  # (reads, writes)
_UNPLANNED = actions_lib.EXTERNAL_FAMILIES + actions_lib.WIRE_FAMILIES


def io_of(schedule: Schedule, seeded: bool = False) -> IO:
  """(reads, writes) of each action as the planner sees them: the
  schedule's declarations less the caller's values and the wires."""
  def _io(d: int, a: Action) -> tuple[list[Key], list[Key]]:
    del d
    reads, writes = schedule.io(a, seeded)
    return ([k for k in reads.values() if k[0] not in _UNPLANNED],
            [k for k in writes.values() if k[0] not in _UNPLANNED])
  return _io


@dataclasses.dataclass
class Loop:
  """`count` iterations of `ops` (iteration 0's, absolute micro-batches).

  A body holds `unroll` periods of the run: each iteration has a fixed cost
  (the loop's bookkeeping, per carried value), which the periods share.

  Attributes:
    ops: (device, op) of iteration 0, in emission order.
    count: iterations; iteration i runs each op with micro-batch
      m + step · i.
    direction: +1, or −1 for a run of descending micro-batches (GPipe's
      backward): each period's micro-batches are the previous one's
      + direction.
    unroll: periods per iteration; step = direction · unroll.
    made: family → the micro-batch its first value in iteration 0 is of
      (the family's values are that + direction · j, j < unroll).
    delays: family → how many of its latest values the loop carries.
    arrays: families the loop writes to a TensorArray (read after it).
    indexed: families the loop reads by index, all made before it.
  """
  ops: list[tuple[int, Action]]
  count: int
  direction: int = 1
  unroll: int = 1
  made: dict[Family, int] = dataclasses.field(default_factory=dict)
  delays: dict[Family, int] = dataclasses.field(default_factory=dict)
  arrays: set[Family] = dataclasses.field(default_factory=set)
  indexed: set[Family] = dataclasses.field(default_factory=set)

  @property
  def step(self) -> int:
    return self.direction * self.unroll

  def iterations(self) -> range:
    return range(self.count)

  def micro_batch(self, m: int, i: int) -> int:
    """Template micro-batch m in iteration i."""
    return m + self.step * i

  def value(self, family: Family, m: int) -> int:
    """The index of (family, m) among the loop's values of the family, in
    the order it makes them (negative: made before the loop)."""
    return self.direction * (m - self.made[family])

  def made_in_body(self, family: Family) -> list[int]:
    """The template micro-batches of the family's values, in order."""
    return [self.made[family] + self.direction * j
            for j in range(self.unroll)]


Segment = list[tuple[int, Action]] | Loop


def _signature(schedule: Schedule, block: Sequence[tuple[int, Action]],
               shift: int) -> tuple[tuple[int, str, int, int, bool], ...]:
  """What a tick runs, its micro-batches shifted; with whether each
  action's micro-batch is rebuilt (a kept one reads and writes other
  keys)."""
  return tuple((d, a.kind, a.stage, a.micro_batch + shift,
                schedule.rebuilds(a.stage, a.micro_batch))
               for d, a in block)


def _periodic_runs(schedule: Schedule,
                   blocks: list[list[tuple[int, Action]]], t: int,
                   max_period: int) -> tuple[int, int, int]:
  """(period, repetitions, shift) of the longest periodic run from tick t:
  each period runs the previous one's ops with micro-batches + shift (±1;
  up to ±K where a period runs K micro-batches of each chunk, as the
  interleaved schedule does)."""
  best = (0, 0, 1)
  shifts = [sign * k for k in range(1, len(schedule) + 1) for sign in (1, -1)]
  for period, step in itertools.product(range(1, max_period + 1), shifts):
    if t + 2 * period > len(blocks):
      break
    first = [_signature(schedule, blocks[t + j], 0) for j in range(period)]
    reps = 1
    while t + (reps + 1) * period <= len(blocks) and all(
        _signature(schedule, blocks[t + reps * period + j], -step * reps)
        == first[j] for j in range(period)):
      reps += 1
    if reps > 1 and period * reps > best[0] * best[1]:
      best = (period, reps, step)
  return best


def _ticks(schedule: Schedule, order: Sequence[tuple[int, Action]]
          ) -> list[list[tuple[int, Action]]]:
  """`order` cut into its ticks (emission order is sorted by tick)."""
  tick_of = {(d, a): t for t, d, a in actions_lib.ticked_order(schedule)}
  blocks: list[list[tuple[int, Action]]] = []
  last = None
  for item in order:
    if tick_of[item] != last:
      blocks.append([])
      last = tick_of[item]
    blocks[-1].append(item)
  return blocks


def _valid(loop: Loop, io: IO) -> bool:
  """Whether every read of the body is made in it earlier, or δ ≥ 1 ago
  by it (a delay line), or before the loop altogether (by index)."""
  made_here: set[Key] = set()
  read_here: set[Key] = set()
  made: dict[Family, list[int]] = {}
  for d, op in loop.ops:
    for family, stage, m in io(d, op)[1]:
      made.setdefault((family, stage), []).append(m)
  for family, ms in made.items():
    if ms != [ms[0] + loop.direction * j for j in range(loop.unroll)]:
      return False  # Not one value per period, in order.
  loop.made = {family: ms[0] for family, ms in made.items()}
  for d, op in loop.ops:
    reads, writes = io(d, op)
    for key in reads:
      family = key[:2]
      if key in made_here:
        read_here.add(key)
        continue
      if family[0] in LOCAL_FAMILIES:
        return False
      if family in made and loop.value(family, key[2]) >= 0:
        return False  # Made later in this iteration.
    made_here.update(writes)
  if any(key[0] in LOCAL_FAMILIES and key not in read_here
         for key in made_here):
    return False  # A tape read in a later iteration, or after the loop.
  return True


def _find(schedule: Schedule, order: Sequence[tuple[int, Action]],
          io: IO, min_count: int, unroll: int) -> list[Segment]:
  blocks = _ticks(schedule, order)
  max_period = 4 * schedule.num_chunks * max(1, len(schedule)) + 4
  segments: list[Segment] = []
  plain: list[tuple[int, Action]] = []
  t = 0
  while t < len(blocks):
    period, reps, shift = _periodic_runs(schedule, blocks, t, max_period)
    # The first period is emitted op by op (see the module docstring); the
    # periods left over after whole iterations follow the loop op by op.
    # `unroll` bounds the micro-batches per iteration, not the periods.
    u = max(1, min(unroll // abs(shift), (reps - 1) // max(1, min_count)))
    count = (reps - 1) // u
    if count >= min_count:
      body = blocks[t + period:t + period * (1 + u)]
      loop = Loop([item for b in body for item in b], count,
                  1 if shift > 0 else -1, u * abs(shift))
      if _valid(loop, io):
        plain += [item for b in blocks[t:t + period] for item in b]
        segments += [plain, loop]
        plain = []
        t += period * (1 + count * u)
        continue
    plain += blocks[t]
    t += 1
  segments.append(plain)
  return [s for s in segments if isinstance(s, Loop) or s]


def _producers(segments: Sequence[Segment], io: IO
              ) -> dict[Key, tuple[int, int]]:
  """Key → (segment index, index among the loop's values of its family;
  -1 op by op) of the op that makes it."""
  made = {}
  for i, seg in enumerate(segments):
    if isinstance(seg, Loop):
      for family in seg.made:
        for it in seg.iterations():
          for m in seg.made_in_body(family):
            key = family + (seg.micro_batch(m, it),)
            made[key] = (i, seg.value(family, key[2]))
    else:
      for d, op in seg:
        for key in io(d, op)[1]:
          made[key] = (i, -1)
  return made


def _reads(segments: Sequence[Segment], io: IO, final: Iterable[Key]
          ) -> Iterable[tuple[int, Key, Loop | None]]:
  """(segment index, key read, the loop reading it by template or None)."""
  for i, seg in enumerate(segments):
    if isinstance(seg, Loop):
      made_here: set[Key] = set()
      for d, op in seg.ops:
        reads, writes = io(d, op)
        for key in reads:
          if key not in made_here:
            yield i, key, seg
        made_here.update(writes)
    else:
      for d, op in seg:
        for key in io(d, op)[0]:
          yield i, key, None
  for key in final:
    yield len(segments), key, None


def plan(schedule: Schedule, order: Sequence[tuple[int, Action]],
         final_reads: Iterable[Key], min_count: int, unroll: int = 1,
         max_delay: int | None = None, seeded: bool = False
        ) -> list[Segment]:
  """`order` as plain runs of actions and loops, with what each carries.

  Args:
    schedule: the schedule `order` comes from.
    order: (device, action) in emission order (a phase of the step).
    final_reads: keys read after the last action (the step's outputs, and
      what a later phase reads).
    min_count: the fewest iterations worth a loop.
    unroll: the most micro-batches of each stage in one iteration (at
      least one period of the run).
    max_delay: the longest delay line a read after a loop may use before
      the loop writes a TensorArray instead (default: 2 × stages + 2).
    seeded: the last stage's backward reads given output gradients.
  """
  io = io_of(schedule, seeded)
  if max_delay is None:
    max_delay = 2 * schedule.num_stages + 2
  segments = _find(schedule, order, io, min_count, unroll)
  made = _producers(segments, io)
  ages: dict[tuple[int, Family], list[int]] = {}  # Reads after a loop.
  final = [k for k in final_reads if k[0] not in _UNPLANNED]
  for i, key, reader in _reads(segments, io, final):
    family = key[:2]
    before = [key]
    if reader is not None:
      # What iteration it reads: made by the loop itself (a delay line),
      # else before it (by index if the family is not the loop's).
      keys = [family + (reader.micro_batch(key[2], it),)
              for it in reader.iterations()]
      if family in reader.made:
        delay = -reader.value(family, key[2])
        reader.delays[family] = max(reader.delays.get(family, 0), delay)
        before = [k for k in keys if made.get(k, (None,))[0] != i]
      else:
        reader.indexed.add(family)
        for k in keys:
          where = made.get(k)
          if where is not None and isinstance(segments[where[0]], Loop):
            segments[where[0]].arrays.add(family)
        continue
    for k in before:
      where = made.get(k)
      if where is not None and isinstance(segments[where[0]], Loop) and (
          where[0] < i):
        loop = segments[where[0]]
        ages.setdefault((where[0], family), []).append(
            loop.count * loop.unroll - 1 - where[1])
  for (at, family), read in ages.items():
    loop = segments[at]
    if max(read) < max_delay and family not in loop.arrays:
      loop.delays[family] = max(loop.delays.get(family, 0), max(read) + 1)
    else:
      loop.arrays.add(family)
  return segments
