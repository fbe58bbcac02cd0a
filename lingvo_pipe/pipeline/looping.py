"""A planned loop (`loops.Loop`) emitted as one `tf.while_loop`.

The body emits the loop's actions through the executor, exactly as
outside a loop, into a fresh `StepState` whose stages start from the
carried state. What crosses iterations (`_Carry`):

* per local device, a token: a scalar that exists once the device's last
  action has finished (`dependency.token`), the order from one iteration
  to the next;
* per local stage, the accumulated gradients and the statistics' sums;
* delay lines: a family's latest values, newest first, for a value the
  body made in an earlier iteration (1F1B's saved inputs: as many as a
  stage holds, so the memory bound stays);
* TensorArrays a family's values are written to, by micro-batch index,
  when read after the loop;
* a token of this process's sends, and the timeline's stamps when a step
  is recorded.

A value made before the loop is read by index from an `Array` written
before it. After the loop its outputs become the outer state: tokens,
sums, the delay lines' values under their keys, the arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from lingvo_pipe.pipeline import actions as actions_lib
from lingvo_pipe.pipeline import dependency
from lingvo_pipe.pipeline import loops
from lingvo_pipe.pipeline.stage import StageState, leaves, pack


class Array:
  """A family's values by micro-batch in TensorArrays (one per leaf)."""

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
      return pack(self.structure, [a.read(m) for a in self.arrays])

  def stack(self) -> Any:
    """Every value, stacked on a new first axis (all must be written)."""
    with tf.device(self.device):
      return pack(self.structure, [a.stack() for a in self.arrays])

  def fill(self, stage: StageState, num: int) -> None:
    """Writes the values of the family that `stage` holds and this array
    lacks (made one by one, before or after a loop)."""
    for m in range(num):
      if m not in self.keys and (self.family, m) in stage.values:
        self.write(m, stage.values[(self.family, m)])
        self.keys.add(m)

  def with_arrays(self, arrays: list[Any]) -> 'Array':
    """This array over other TensorArray flows (a loop's carried ones)."""
    out = Array.__new__(Array)
    out.__dict__.update(self.__dict__, arrays=list(arrays))
    return out

  family = ''


@dataclasses.dataclass
class Frame:
  """The loop whose body is being emitted, and its iteration counter."""
  loop: loops.Loop
  i: tf.Tensor

  def index(self, m: int) -> tf.Tensor:
    return tf.constant(m) + self.loop.step * self.i


def _array(state: Any, family: loops.Family, example: Any, num: int,
           device: str) -> Array:
  """The array of `family` in `state`, made on first use."""
  if family not in state.arrays:
    array = Array(example, num, device)
    array.family = family[0]
    state.arrays[family] = array
  return state.arrays[family]


def emit_loop(ex: Any, loop: loops.Loop, state: Any, feed: Any,
              seeded: bool) -> Any:
  """Emits `loop` into `state` (the executor's StepState) as one
  `tf.while_loop`; afterwards every value and sum is where emitting the
  actions one by one would have left it."""
  num = ex.schedule.num_micro_batches
  for family in sorted(f for f in loop.indexed if f[1] in state.stages):
    st = state.stages[family[1]]
    ms = sorted(m for (f, m) in st.values if f == family[0])
    if ms:
      _array(state, family, st.values[(family[0], ms[0])], num,
             st.device).fill(st, num)
  feed.stack({key[0] for _, a in loop.ops if a.stage in state.stages
              for key in ex.schedule.io(a, seeded)[0].values()
              if key[0] in actions_lib.EXTERNAL_FAMILIES})
  carry = _Carry(ex, loop, state)
  initial = carry.initial()

  def _body(i: tf.Tensor, *flat: Any) -> list[Any]:
    carried = pack(initial, flat)
    inner = carry.inner(carried, Frame(loop, i))
    ex.emit(loop.ops, inner, feed, seeded)
    return [i + 1] + leaves(carry.outputs(inner, carried, i))

  with tf.name_scope(f'loop{len(state.arrays)}'), dependency.free_loop_body():
    result = tf.while_loop(
        lambda i, *_: i < loop.count, _body,
        [tf.constant(0)] + leaves(initial),
        parallel_iterations=max(10, 2 * len(ex.stages)))
  carry.install(pack(initial, result[1:]))
  return state


class _Carry:
  """What one loop carries across iterations, in this process."""

  def __init__(self, ex: Any, loop: loops.Loop, state: Any) -> None:
    self.ex, self.loop, self.state = ex, loop, state
    mine = [(d, a) for d, a in loop.ops if a.stage in state.stages]
    self.devices = sorted({d for d, _ in mine})
    self.forwards = sorted({a.stage for _, a in mine if a.kind == 'F'})
    self.backwards = sorted({a.stage for _, a in mine
                             if a.kind in ('B', 'I', 'W')})
    self.delays = {f: n for f, n in sorted(loop.delays.items())
                   if f[1] in state.stages}
    self.arrays = sorted(f for f in loop.arrays if f[1] in state.stages)
    self.sends = any(a.kind.startswith('SEND_') for _, a in mine)
    self.records = ex.recording and any(
        a.kind in actions_lib.COMPUTE_KINDS for _, a in mine)
    self.slots: list[tuple[int, str]] = []  # A body's records: (stage, kind).

  def _token(self, d: int, after: list[tf.Tensor],
             by_data: bool = True) -> tf.Tensor:
    return dependency.token(self.ex.device(d), after or [self.ex.zero(d)],
                            self.ex.zero(d), by_data)

  def initial(self) -> dict[str, Any]:
    state, ex = self.state, self.ex
    num = ex.schedule.num_micro_batches
    for family in self.arrays:
      st = state.stages[family[1]]
      example = st.get(family[0], self.loop.made[family] - self.loop.direction)
      _array(state, family, example, num, st.device)
    return {
        'token': [self._token(d, state.after[d]) for d in self.devices],
        # Zeros where no backward ran yet (a W may come only in the loop).
        'acc': [state.stages[s].first_acc() for s in self.backwards],
        'stats': [state.stages[s].stats for s in self.forwards],
        'delay': {f: self._delay_line(f, n) for f, n in self.delays.items()},
        'arrays': [state.arrays[f].arrays for f in self.arrays],
        'sent': ([self._token(self.devices[0], list(state.sends), False)]
                 if self.sends else []),
        'records': ([tf.TensorArray(tf.float64, size=self.loop.count)]
                    if self.records else []),
    }

  def _delay_line(self, family: loops.Family, length: int) -> list[Any]:
    """Slot k: the family's (k+1)-th latest value before the loop. Slots no
    iteration reads before the loop refills them may hold anything of the
    right shape: the latest value."""
    name, s = family
    st = self.state.stages[s]
    before = [self.loop.made[family] - self.loop.direction * (1 + k)
              for k in range(length)]
    array = self.state.arrays.get(family)
    have = lambda m: (name, m) in st.values or (  # noqa: E731
        array is not None and m in array.keys)
    return [st.get(name, m if have(m) else before[0]) for m in before]

  def inner(self, carried: dict[str, Any], frame: Frame) -> Any:
    """The StepState a body starts from."""
    state, loop = self.state, self.loop
    acc = dict(zip(self.backwards, carried['acc']))
    stats = dict(zip(self.forwards, carried['stats']))
    stages = {}
    for s, st in state.stages.items():
      stages[s] = st.fork(self._resolver(s, carried['delay'], frame),
                          acc.get(s, st.acc), stats.get(s, st.stats))
    return type(state)(
        stages=stages,
        after={d: ([carried['token'][self.devices.index(d)]]
                   if d in self.devices else list(state.after[d]))
               for d in state.after},
        arrays=dict(state.arrays), loop=frame)

  def _resolver(self, s: int, delay: dict[loops.Family, list[Any]],
                frame: Frame) -> Any:
    loop, arrays = self.loop, self.state.arrays

    def _resolve(name: str, m: int) -> Any:
      family = (name, s)
      if family in loop.made:
        return delay[family][-loop.value(family, m) - 1]
      if family not in arrays:
        raise KeyError((name, s, m))
      return arrays[family].read(frame.index(m))
    return _resolve

  def outputs(self, inner: Any, carried: dict[str, Any],
              i: tf.Tensor) -> dict[str, Any]:
    """The carried state an iteration leaves for the next."""
    loop = self.loop
    delay = {}
    for family, slots in carried['delay'].items():
      name, s = family
      newest = [inner.stages[s].get(name, m)
                for m in reversed(loop.made_in_body(family))]
      delay[family] = (newest + slots)[:len(slots)]
    arrays = []
    for family, flows in zip(self.arrays, carried['arrays']):
      array = self.state.arrays[family].with_arrays(flows)
      for m in loop.made_in_body(family):
        array.write(inner.loop.index(m), inner.stages[family[1]].get(
            family[0], m))
      arrays.append(array.arrays)
    return {
        'token': [self._token(d, inner.after[d]) for d in self.devices],
        'acc': [inner.stages[s].acc for s in self.backwards],
        'stats': [inner.stages[s].stats for s in self.forwards],
        'delay': delay,
        'arrays': arrays,
        'sent': ([self._token(self.devices[0],
                              carried['sent'] + list(inner.sends), False)]
                 if self.sends else []),
        'records': ([carried['records'][0].write(i, self._stamps(inner))]
                    if self.records else []),
    }

  def _stamps(self, inner: Any) -> tf.Tensor:
    """[slots, 3] (micro-batch, start, end) of one iteration's records."""
    self.slots = [(s, kind) for s, _, kind, _, _ in inner.records]
    return tf.stack([tf.stack([tf.cast(m, tf.float64), start, end])
                     for _, m, _, start, end in inner.records])

  def install(self, final: dict[str, Any]) -> None:
    """Makes the loop's results the outer state's."""
    state, loop = self.state, self.loop
    for d, token in zip(self.devices, final['token']):
      state.after[d] = [token]
    for s, acc in zip(self.backwards, final['acc']):
      state.stages[s].acc = acc
    for s, stats in zip(self.forwards, final['stats']):
      state.stages[s].stats = stats
    for family, flows in zip(self.arrays, final['arrays']):
      state.arrays[family] = state.arrays[family].with_arrays(flows)
      state.arrays[family].keys = set(state.arrays[family].keys) | {
          loop.micro_batch(m, i) for i in loop.iterations()
          for m in loop.made_in_body(family)}
    made = loop.count * loop.unroll  # Values of each family the loop made.
    for family, slots in final['delay'].items():
      name, s = family
      for k, value in enumerate(slots[:made]):
        key = loop.made[family] + loop.direction * (made - 1 - k)
        state.stages[s].values[(name, key)] = value
    state.sends += final['sent']
    if final['records']:
      from lingvo_pipe.pipeline import timeline  # pylint: disable=C0415
      state.records.append(timeline.RecordBatch(
          list(self.slots), final['records'][0].stack(), loop.count))
