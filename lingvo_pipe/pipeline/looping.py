"""Loops over a schedule's steady state: what the walker's loops carry.

`loops.plan` says which runs of ops become a `tf.while_loop` and what each
carries; this module holds the values (`Store` by key, `Array` by index,
`MicroBatches` of the caller's tensors) and `Looping`, the part of the
`Walker` that emits a loop. A loop body calls the walker's own `_forward`
and `_backward`: only where each value comes from changes.

* A value the body made in an earlier iteration comes from a delay line:
  the family's latest values, carried as loop variables.
* A value made before the loop is read by index from a TensorArray.
* Each device's order crosses iterations as a token, a scalar that exists
  once the device's last op has finished (`_token`); accumulated gradients
  and statistics are carried.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import loops
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import schedule as schedule_lib


class WalkerError(errors.LingvoPipeError):
  """A stage list or placement the walker cannot run; names the fix."""


@dataclasses.dataclass
class Frame:
  """The loop whose body is being emitted: its iteration counter, and the
  delay lines it carries (family → latest values, newest first)."""
  loop: loops.Loop
  i: tf.Tensor
  delay: dict[loops.Family, list[Any]]


def _gather(stacked: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
  with tf.device(stacked.device):
    return tf.gather(stacked, index)


def _index(m: int) -> tf.Tensor:
  """Micro-batch index m as a tensor that Grappler will not constant-fold.

  A constant argument makes Grappler specialise the called stage function
  per value — M optimised copies of every stage body, which made the first
  call of a K=1, M=8 Transformer step take ~20 s instead of ~1 s.
  """
  return opaque(tf.constant(m, tf.int32))


def opaque(x: tf.Tensor) -> tf.Tensor:
  """`x`, hidden from Grappler's constant folding.

  Grappler's function optimizer specialises a call that has a constant
  input: one optimised copy of the stage body per call site. The loss
  seeds (ones and zeros), the first accumulator (zeros) and the first
  op's `after` (a zero) fold to constants, so every backward of the last
  stage got its own copy: the first call of a K=2 step (12 × Transformer
  layer, model dim 128) took 22 s instead of 8 s at M=32, 6.9 s instead of
  4.2 s at M=8, and its steps ran 7% slower.
  """
  return tf.compat.v1.placeholder_with_default(x, x.shape)


def leaves(nest: Any) -> list[tf.Tensor]:
  return [t for t in tf.nest.flatten(nest) if t is not None]


def _pack(structure: Any, tensors: Sequence[Any]) -> Any:
  """Inverse of `leaves`: `structure` with its non-None leaves replaced."""
  it = iter(tensors)
  return tf.nest.pack_sequence_as(
      structure, [None if t is None else next(it)
                  for t in tf.nest.flatten(structure)])


# The fewest iterations worth a loop: shorter runs are emitted op by op.
MIN_LOOP_ITERATIONS = 2
# Micro-batches of each stage per loop iteration (whole periods of the
# schedule's steady state: one period of the interleaved schedule holds K
# of them; at least one period per iteration). Each iteration
# costs a fixed ~0.3 ms on one core (the loop's bookkeeping for every
# carried value: accumulated gradients, delay lines, arrays): at K=2,
# M=64, 16 × FC 512 with 16-example micro-batches, one period per
# iteration made steps 6–8% slower than emitting every op; the
# micro-batches of one iteration share it.
LOOP_UNROLL = 4


class Store(dict):
  """Values of one family by (stage, micro-batch); a key it lacks is asked
  of `resolve(family, key)` (a TensorArray, a loop's delay line)."""

  def __init__(self, family: str,
               resolve: Callable[[str, tuple[int, int]], Any]) -> None:
    super().__init__()
    self.family = family
    self.resolve = resolve

  def __missing__(self, key: tuple[int, int]) -> Any:
    value = self[key] = self.resolve(self.family, key)
    return value


class Array:
  """A family's values by micro-batch in TensorArrays (one per leaf), for
  reads by index (a loop over values made before it) or after a loop."""

  def __init__(self, example: Any, size: int, device: str) -> None:
    self.structure = example
    self.device = device
    with tf.device(self.device):
      self.arrays = [tf.TensorArray(t.dtype, size=size, element_shape=t.shape,
                                    clear_after_read=False)
                     for t in leaves(example)]
    self.keys: set[int] = set()

  def write(self, m: Any, value: Any) -> None:
    with tf.device(self.device):
      self.arrays = [a.write(m, t) for a, t in zip(self.arrays, leaves(value))]

  def read(self, m: Any) -> Any:
    with tf.device(self.device):
      return _pack(self.structure, [a.read(m) for a in self.arrays])

  def stack(self) -> Any:
    """Every value, stacked on a new first axis (all must be written)."""
    with tf.device(self.device):
      return _pack(self.structure, [a.stack() for a in self.arrays])


class MicroBatches:
  """The micro-batches of a nest, sliced when asked: op-by-op emission
  slices the ones it reads, and a loop indexes the whole nest stacked (so
  neither costs a slice per micro-batch it does not read)."""

  def __init__(self, whole: Any, num_micro_batches: int, batch_dim: int,
               device: str) -> None:
    self.whole = whole
    self.num = num_micro_batches
    self.batch_dim = batch_dim
    self.device = device
    self._parts: dict[int, Any] = {}

  def __len__(self) -> int:
    return self.num

  def __getitem__(self, m: int) -> Any:
    if m not in self._parts:
      with tf.device(self.device):
        self._parts[m] = microbatch.one(self.whole, self.num,
                                        self.batch_dim, m)
    return self._parts[m]

  def stacked(self) -> Any:
    with tf.device(self.device):
      return microbatch.stack(self.whole, self.num, self.batch_dim)


class Looping:
  """The walker's loops (mixed into `walker.Walker`, whose attributes they
  use: schedule, stages, placement, timeline, the stores, acc, stats,
  done, and segments, _arrays, _stacked, _zeros, _loop)."""

  def can_loop(self) -> bool:
    """Whether this walker may emit loops: in one traced process with no
    timeline (stage processes and timestamps emit every op)."""
    return (not tf.executing_eagerly() and self.timeline is None and
            not self.placement.multi_process)

  def plan(self, order: Sequence[tuple[int, schedule_lib.Op]]) -> None:
    """Emits `order` (the step's ops, which the following `emit` calls give
    in turn) with its periodic runs as loops (`loops.plan`)."""
    final = [(name, s, m) for name, s in (('y', self.last), ('dx', 0))
             for m in range(self.schedule.num_micro_batches)]
    self.segments = loops.plan(self.schedule, order, self._io, final,
                               MIN_LOOP_ITERATIONS, LOOP_UNROLL)

  def _io(self, d: int, op: schedule_lib.Op
         ) -> tuple[list[loops.Key], list[loops.Key]]:
    """The keys op reads and writes (`loops.py`)."""
    s, m = self.schedule.stage(d, op), op.micro_batch
    rebuilt = self.schedule.rebuilds(s, m)
    # Stage 0's recompute reads its input again by index (_backward): kept
    # for it, a loop's gathered copy would double GPipe's input memory.
    saved = [('x', s, m)] if s > 0 or not rebuilt else []
    if op.kind == 'F':
      reads = [('y', s - 1, m)] if s > 0 else []
      return reads, saved + [('y', s, m)] + (
          [] if rebuilt else [('tape', s, m)])
    if op.kind == 'B' and rebuilt:
      return [], []  # Emitted with its R.
    reads = list(saved)
    if s < self.last:
      reads.append(('dx', s + 1, m))
    elif self.seeds is None:
      reads.append(('y', s, m))
    if not rebuilt:
      reads += [('tape', s, m), ('y', s, m)]
    return reads, [('dx', s, m)]

  # Loops.

  def _resolve(self, family: str, key: tuple[int, int]) -> Any:
    """A value no op of this graph made: from a TensorArray, or (in a loop
    body) a delay line or a TensorArray by index."""
    s, m = key
    frame = self._loop
    if frame is not None:
      if (family, s) in frame.loop.made:
        return frame.delay[(family, s)][-frame.loop.value((family, s), m) - 1]
      return self._arrays[(family, s)].read(self._mi(m))
    array = self._arrays.get((family, s))
    if array is None or m not in array.keys:
      raise KeyError((family, s, m))
    return array.read(m)

  def _store(self, family: str) -> Store:
    return getattr(self, family)

  def _indexed(self, family: loops.Family) -> None:
    """Writes every value of `family` made so far op by op to its array."""
    name, s = family
    store = self._store(name)
    ms = sorted(m for (t, m) in store if t == s)
    if not ms:
      return
    if family not in self._arrays:
      self._arrays[family] = Array(store[(s, ms[0])],
                                    self.schedule.num_micro_batches,
                                    self.stages[s].device)
    array = self._arrays[family]
    for m in ms:
      if m not in array.keys:
        array.write(m, store[(s, m)])
        array.keys.add(m)

  def _micro(self, name: str, m: int, d: int) -> Any:
    """Micro-batch m of `inputs`, `side` or `seeds` (m + i in a loop),
    read by device d's next op.

    In a loop the read is a copy (a gather), made once device d's previous
    op has finished: gathers that depend on the loop counter alone ran
    up to `parallel_iterations` iterations ahead, and held that many
    micro-batches of inputs (1F1B, K=2, M=32: 40 MiB instead of 11).
    """
    values = getattr(self, name)
    if self._loop is None:
      return values[m]
    if name not in self._stacked:
      raise WalkerError(f'{name} was not stacked before the loop.')
    with tf.control_dependencies(self._after(d)):
      index = tf.identity(self._mi(m))
    return tf.nest.map_structure(
        lambda t: None if t is None else _gather(t, index),
        self._stacked[name])

  def _stack(self) -> None:
    """The per-micro-batch lists a loop picks from, stacked (once)."""
    for name in ('inputs', 'side', 'seeds'):
      values = getattr(self, name)
      if isinstance(values, MicroBatches) and name not in self._stacked:
        self._stacked[name] = values.stacked()

  def _device(self, d: int) -> str:
    return self.stages[self.schedule.stage(d, schedule_lib.Op('F', 0))].device

  def _token(self, d: int) -> tf.Tensor:
    """A scalar that exists once device d's last op has finished: what
    carries a device's order from one iteration to the next."""
    with tf.device(self._device(d)), tf.control_dependencies(self._after(d)):
      return tf.identity(self._zero(d))

  def _zero(self, d: int) -> tf.Tensor:
    if d not in self._zeros:
      with tf.device(self._device(d)):
        self._zeros[d] = opaque(tf.zeros([]))
    return self._zeros[d]

  def _emit_loop(self, loop: loops.Loop) -> None:
    """`loop` as one `tf.while_loop`; afterwards every value and state is
    where op-by-op emission would have left it."""
    for family in sorted(loop.indexed):
      self._indexed(family)
    self._stack()
    devices = sorted({d for d, _ in loop.ops})
    kinds = [(self.schedule.stage(d, op), op) for d, op in loop.ops]
    forwards = sorted({s for s, op in kinds if op.kind == 'F'})
    backwards = sorted({s for s, op in kinds if op.kind != 'F'
                        and not (op.kind == 'B' and self.schedule.rebuilds(
                            s, op.micro_batch))})
    delay = {}
    for family, length in sorted(loop.delays.items()):
      name, s = family
      # Slot k: the family's (k+1)-th latest value before the loop. Slots
      # no iteration reads before the loop refills them may hold anything
      # of the right shape: the latest value.
      before = [loop.made[family] - loop.direction * (1 + k)
                for k in range(length)]
      store = self._store(name)
      delay[family] = [store[(s, m)] if (s, m) in store
                       or self._in_array(family, m) else store[(s, before[0])]
                       for m in before]
    for family in sorted(loop.arrays):
      if family not in self._arrays:
        name, s = family
        example = self._store(name)[
            (s, loop.made[family] - loop.direction)]
        self._arrays[family] = Array(example, self.schedule.num_micro_batches,
                                      self.stages[s].device)
    state = {
        'token': [self._token(d) for d in devices],
        'acc': [self.acc[s] for s in backwards],
        'stats': [self.stats[s].stats for s in forwards],
        'delay': delay,
        'arrays': [self._arrays[f].arrays for f in sorted(loop.arrays)],
    }
    structure = state
    flat = tf.nest.flatten(state)
    tensors = [t for t in flat if t is not None]

    def _install(st: dict[str, Any]) -> None:
      """Makes carried state `st` the walker's (in the body, and after)."""
      for d, token in zip(devices, st['token']):
        self.done[d] = [[token]]
      for s, acc in zip(backwards, st['acc']):
        self.acc[s] = acc
      for s, stats in zip(forwards, st['stats']):
        self.stats[s] = StatsCollector(stats)
      for family, arrays in zip(sorted(loop.arrays), st['arrays']):
        self._arrays[family].arrays = arrays

    def _body(i: tf.Tensor, *carried: Any) -> list[Any]:
      st = _pack(structure, carried)
      outer = (self.x, self.y, self.dx, self.tapes, list(self.acc),
               list(self.stats), list(self.done))
      self._loop = Frame(loop, i, st['delay'])
      self.x, self.y, self.dx = (Store(n, self._resolve)
                                 for n in ('x', 'y', 'dx'))
      self.tapes = {}
      _install(st)
      self._emit_ops(loop.ops)
      new_delay = {}
      for family, slots in st['delay'].items():
        name, s = family
        newest = [self._store(name)[(s, m)]
                  for m in reversed(loop.made_in_body(family))]
        new_delay[family] = (newest + slots)[:len(slots)]
      new_arrays = []
      for family in sorted(loop.arrays):
        name, s = family
        for m in loop.made_in_body(family):
          self._arrays[family].write(self._mi(m), self._store(name)[(s, m)])
        new_arrays.append(self._arrays[family].arrays)
      out = {
          'token': [self._token(d) for d in devices],
          'acc': [self.acc[s] for s in backwards],
          'stats': [self.stats[s].stats for s in forwards],
          'delay': new_delay,
          'arrays': new_arrays,
      }
      (self.x, self.y, self.dx, self.tapes, self.acc, self.stats,
       self.done) = outer
      self._loop = None
      return [i + 1] + leaves(out)

    with tf.name_scope(f'loop{len(self._arrays)}'):
      result = tf.while_loop(
          lambda i, *_: i < loop.count, _body,
          [tf.constant(0)] + tensors,
          parallel_iterations=max(10, 2 * len(self.stages)))
    st = _pack(structure, result[1:])
    _install(st)
    for family in sorted(loop.arrays):
      self._arrays[family].keys.update(
          loop.micro_batch(m, i) for i in loop.iterations()
          for m in loop.made_in_body(family))
    for family, slots in st['delay'].items():
      name, s = family
      made = loop.count * loop.unroll  # Values the loop made.
      for k, value in enumerate(slots[:made]):
        key = loop.made[family] + loop.direction * (made - 1 - k)
        self._store(name)[(s, key)] = value

  def _in_array(self, family: loops.Family, m: int) -> bool:
    array = self._arrays.get(family)
    return array is not None and m in array.keys

  def _mi(self, m: int) -> tf.Tensor:
    """Micro-batch m's index as a tensor (m + i in iteration i of a loop)."""
    if self._loop is None:
      return _index(m)
    return tf.constant(m) + self._loop.loop.step * self._loop.i

  def stacked(self, family: str, s: int) -> Any:
    """Every micro-batch's value of (family, s), stacked on a new axis 0."""
    array = self._arrays.get((family, s))
    if array is not None:
      self._indexed((family, s))
      if len(array.keys) == self.schedule.num_micro_batches:
        return array.stack()
    store = self._store(family)
    values = [store[(s, m)] for m in range(self.schedule.num_micro_batches)]
    with tf.device(self.stages[s].device):
      return tf.nest.map_structure(
          lambda *ts: None if ts[0] is None else tf.stack(ts), *values)

  def concat(self, family: str, s: int) -> Any:
    """Every micro-batch's value of (family, s), joined along the batch."""
    with tf.device(self.stages[s].device):
      if (family, s) in self._arrays:  # Made in a loop.
        microbatch.check_batched(self._arrays[(family, s)].structure,
                                 self.batch_dim)
        return microbatch.unstack(self.stacked(family, s), self.batch_dim)
      store = self._store(family)
      return microbatch.concat(
          [store[(s, m)] for m in range(self.schedule.num_micro_batches)],
          self.batch_dim)
