"""The executor: one loop over a step's actions, emitting each on its device.

    for (device, action) in emission order (actions.emission_order):
      if this process runs action's stage:
        values = [what the action reads]      # its declared keys
        written = run(action, values)         # F, R, B, I, W, SEND_*, RECV_*
        store written under its declared keys

What an action reads and writes is its declaration (`Schedule.io`); the
executor reads and writes exactly those keys, so the data flow the loop
planner and the simulator see is the one that runs. Values live with
their stage (`stage.StageState`); the caller's micro-batches (inputs,
labels, seeds) come from a `Feed`. Each device's order is data: a compute
action's call takes the device's previous action's outputs (`after`); a
recv is posted behind them (its position in the list says which: the
transfer pass put it `RECV_LOOKAHEAD` actions before its reader); a send
goes as soon as its value exists and nothing waits on it but the step's
end. In a traced step, the periodic middle of the order runs as
`tf.while_loop`s (`loops.py` plans them, `looping.py` emits them): the
same actions over carried state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.pipeline import actions as actions_lib
from lingvo_pipe.pipeline import boundary
from lingvo_pipe.pipeline import dependency
from lingvo_pipe.pipeline import looping
from lingvo_pipe.pipeline import loops
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import placement as placement_lib
from lingvo_pipe.pipeline.actions import Action, Key, Schedule
from lingvo_pipe.pipeline.stage import (Clock, Stage, StageBodies, StageState,
                                        differentiable, float_leaves, leaves,
                                        pack)

Specs = Callable[[int], Any]  # Stage s → per-micro-batch spec of its input.

# The fewest iterations worth a loop: shorter runs are emitted one by one.
MIN_LOOP_ITERATIONS = 2
# Micro-batches of each stage per loop iteration (whole periods of the
# steady state; at least one). Each iteration has a fixed bookkeeping cost
# for every carried value (docs/benchmarks.md, overheads); the
# micro-batches of one iteration share it.
LOOP_UNROLL = 4


class ExecutorError(errors.LingvoPipeError):
  """A stage list, schedule or placement the executor cannot run."""


@dataclasses.dataclass
class Feed:
  """The caller's values per micro-batch: stage 0's inputs, the last
  stage's labels, and the gradients of its outputs (None: not given)."""
  input: microbatch.MicroBatches | None = None
  label: microbatch.MicroBatches | None = None
  seed: microbatch.MicroBatches | None = None
  _stacked: dict[str, Any] = dataclasses.field(default_factory=dict)

  def read(self, family: str, m: int, index: tf.Tensor | None,
           after: list[tf.Tensor]) -> Any:
    """Micro-batch m of `family`; in a loop (`index` given), a gather of
    micro-batch `index`, made once `after` exists: gathers that depend on
    the loop counter alone ran up to `parallel_iterations` iterations
    ahead, and held that many micro-batches of inputs."""
    values = getattr(self, family)
    if values is None:
      raise ExecutorError(f'The step reads {family} of micro-batch {m}, which '
                          'the caller did not give.')
    if index is None:
      return values[m]
    if family not in self._stacked:
      raise ExecutorError(f'{family} was not stacked before the loop.')
    with tf.control_dependencies(after):
      at = tf.identity(index)
    return tf.nest.map_structure(
        lambda t: None if t is None else _gather(t, at),
        self._stacked[family])


  def stack(self, families: set[str]) -> None:
    """Stacks the given families once, outside any loop, for loops to
    index."""
    for family in sorted(families):
      values = getattr(self, family)
      if values is not None and family not in self._stacked:
        self._stacked[family] = values.stacked()


def _gather(stacked: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
  with tf.device(stacked.device):
    return tf.gather(stacked, index)


@dataclasses.dataclass
class StepState:
  """What a step's actions have made so far, in this process.

  Attributes:
    stages: each local stage's state.
    after: per local device, what its next compute action waits on.
    sends: send tokens; the step's end waits on them.
    records: timeline records (stage, m, kind, start, end) when recorded.
    arrays: (family, stage) → `looping.Array`: values written by index
      (read by a loop, or made by one and read after it).
    loop: the loop whose body this is (`looping.Frame`), or None.
  """
  stages: dict[int, StageState]
  after: dict[int, list[tf.Tensor]]
  sends: list[tf.Tensor] = dataclasses.field(default_factory=list)
  records: list[Any] = dataclasses.field(default_factory=list)
  arrays: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict)
  loop: Any = None

  def index(self, m: int) -> tf.Tensor:
    """Micro-batch m's index (m + step · i in iteration i of a loop)."""
    if self.loop is None:
      return dependency.index(m)
    return self.loop.index(m)


class Executor:
  """Emits the actions of one step of `schedule` in this process."""

  def __init__(self, stages: Sequence[Stage], schedule: Schedule,
               batch_size: Any, batch_dim: int,
               placement: placement_lib.Placement | None = None,
               specs: Specs | None = None, loop: bool = True) -> None:
    """Args:
      stages: one per stage of `schedule`.
      schedule: what to run; with stage processes, its transfers inserted.
      batch_size: this replica's batch size (int or scalar tensor).
      batch_dim: the batch dimension of every boundary tensor.
      placement: which devices are local (default: all).
      specs: stage s → its input's per-micro-batch spec, for recvs.
      loop: emit the steady state as loops where the plan finds them.
    """
    if len(stages) != schedule.num_stages:
      raise ExecutorError(
          f'{len(stages)} stages but the {schedule.name} schedule has '
          f'{schedule.num_stages}; build one per stage.')
    ctx = fprop_context.current()
    self.schedule = schedule
    self.stages = list(stages)
    self.placement = placement or placement_lib.Placement(
        placement_lib.collective.Peers.local(), schedule.num_devices)
    self.specs = specs
    self.batch_dim = batch_dim
    self.step = dependency.opaque(tf.cast(ctx.step, tf.int64))
    self.timeline = ctx.timeline
    self.recording = ctx.timeline is not None
    self.loop = loop and not tf.executing_eagerly()
    num_micro = schedule.num_micro_batches
    micro_size = batch_size // num_micro
    # Dropout masks follow each example's index in the global batch.
    offset = self.placement.replica * batch_size
    total = batch_size * self.placement.num_replicas

    def _scope(m: Any, stats: Any, step: Any) -> Any:
      return fprop_context.scope(
          training=True, step=step, micro_batch_index=m,
          num_micro_batches=num_micro, batch_axis=batch_dim,
          first_example=offset + m * micro_size, global_batch_size=total,
          stats=stats)

    clock = Clock(self.recording)
    self.bodies = {s: StageBodies(stage, _scope, clock)
                   for s, stage in enumerate(self.stages) if self.is_local(s)}
    self._zeros: dict[int, tf.Tensor] = {}

  # ---- Facts ---------------------------------------------------------------
  @property
  def last(self) -> int:
    return len(self.stages) - 1

  def is_local(self, stage: int) -> bool:
    return self.placement.is_local(self.schedule.device_of(stage))

  def local_stages(self) -> list[int]:
    return [s for s in range(len(self.stages)) if self.is_local(s)]

  def device(self, d: int) -> str:
    return self.stages[self.schedule.stages_of(d)[0]].device

  def zero(self, d: int) -> tf.Tensor:
    """A scalar zero on device d, hidden from constant folding."""
    if d not in self._zeros:
      with tf.device(self.device(d)):
        self._zeros[d] = dependency.opaque(tf.zeros([]))
    return self._zeros[d]

  def new_state(self, thetas: dict[int, Any]) -> StepState:
    """The state before a step's first action (`thetas`: local stages')."""
    state = StepState(
        stages={s: StageState(self.bodies[s], thetas[s])
                for s in self.local_stages()},
        after={d: [] for d in range(self.schedule.num_devices)
               if self.placement.is_local(d)})
    for s, st in state.stages.items():
      st.resolve = _from_arrays(state, s)
    return state

  # ---- Emission ------------------------------------------------------------
  def run(self, order: Sequence[tuple[int, Action]], state: StepState,
          feed: Feed, final_reads: Sequence[Key] = (),
          seeded: bool = False) -> StepState:
    """Emits `order` (a phase of the step, in emission order) into `state`;
    its periodic runs as loops when tracing. `final_reads`: keys read after
    it (outputs, and what a later phase reads)."""
    if not self.loop:
      self.emit(order, state, feed, seeded)
    else:
      segments = loops.plan(self.schedule, order, final_reads,
                            MIN_LOOP_ITERATIONS, LOOP_UNROLL, seeded=seeded)
      for segment in segments:
        if isinstance(segment, loops.Loop):
          state = looping.emit_loop(self, segment, state, feed, seeded)
        else:
          self.emit(segment, state, feed, seeded)
    if self.timeline is not None:  # The caller's sink (fprop_context).
      self.timeline.extend(state.records)
      state.records.clear()
    return state

  def emit(self, order: Sequence[tuple[int, Action]], state: StepState,
           feed: Feed, seeded: bool) -> None:
    """Emits the local actions of `order`, one by one."""
    for d, a in order:
      if not self.is_local(a.stage):
        continue
      reads, writes = self.schedule.io(a, seeded)
      values = {role: (key, self._read(key, state, feed, d))
                for role, key in reads.items()}
      with tf.name_scope(f'stage{a.stage}_{a.kind}{a.micro_batch}'):
        made = _HANDLERS[a.kind](self, d, a, values, state)
      if set(made) != set(writes):
        raise ExecutorError(f'{a} made {sorted(made)}, but declares '
                            f'{sorted(writes)} (actions.py).')
      for role, (family, s, m) in writes.items():
        if family not in actions_lib.WIRE_FAMILIES:  # No value: an edge.
          state.stages[s].values[(family, m)] = made[role]

  def _read(self, key: Key, state: StepState, feed: Feed, d: int) -> Any:
    family, s, m = key
    if family in actions_lib.EXTERNAL_FAMILIES:
      index = None if state.loop is None else state.index(m)
      return feed.read(family, m, index, self._after(state, d))
    if family in actions_lib.WIRE_FAMILIES:
      return None
    return state.stages[s].get(family, m)

  def _after(self, state: StepState, d: int) -> list[tf.Tensor]:
    """What device d's next compute action waits on (never empty, so that
    a traced body is traced once, not once more for its first call)."""
    return state.after[d] or [self.zero(d)]

  def _record(self, state: StepState, a: Action, kinds: str,
              times: list[tf.Tensor]) -> None:
    """One record per kind; `times` holds a [start, end] bracket each."""
    if self.recording:
      m = a.micro_batch if state.loop is None else state.index(a.micro_batch)
      for i, kind in enumerate(kinds):
        state.records.append((a.stage, m, kind, times[2 * i],
                              times[2 * i + 1]))

  # ---- Actions ---------------------------------------------------------------
  def _forward(self, d: int, a: Action, r: dict[str, Any],
               state: StepState) -> dict[str, Any]:
    s, m = a.stage, a.micro_batch
    st = state.stages[s]
    (_, x), side = r['x'], r.get('side', (None, None))[1]
    if s > 0 and 'x' in r and r['x'][0][0] == 'y':  # Placed once; R reads it.
      with tf.device(st.device):
        x = dependency.chained(x, [])
    after = self._after(state, d)
    if self.schedule.rebuilds(s, m):
      y, stats, times = st.bodies.forward(st.theta, x, side, after,
                                          state.index(m), self.step)
      dependency.independent(times)
      made = {'y': y, 'x': x} if s > 0 else {'y': y}
    elif self.schedule.splits(s, m):  # Kept as values for its I.
      y, stats, saved, times = st.bodies.split_forward(
          st.theta, x, side, after, state.index(m), self.step)
      dependency.independent(times)
      made = {'y': y, 'saved': saved}
    else:  # Kept, inline: its backward needs this tape.
      x, y, stats, times, tape = st.bodies.kept_forward(
          st.theta, x, side, after, state.index(m), self.step)
      made = {'y': y, 'tape': tape, 'x': x}
    st.merge_stats(stats)
    self._record(state, a, 'F', times)
    state.after[d] = leaves(y) or after
    return made

  def _output_grads(self, a: Action, r: dict[str, Any], st: StageState
                   ) -> list[tf.Tensor]:
    """Gradients of the stage's float outputs, on its device."""
    (family, _, _), value = r['dy']
    with tf.device(st.device):
      if family == 'y':  # The loss: d(Σ value·weight) = 1, d(metrics) = 0.
        outputs = float_leaves(value)
        grads = [dependency.opaque(g) for g in [tf.ones_like(outputs[0])] +
                 [tf.zeros_like(t) for t in outputs[1:]]]
      elif family == 'seed':
        grads = [dependency.opaque(g) for g in value]
      else:  # Received (a list), or the next stage's dx (a nest).
        grads = float_leaves(value)
      del a
      return [tf.identity(g) for g in grads]

  def _recompute(self, d: int, a: Action, r: dict[str, Any],
                 state: StepState) -> dict[str, Any]:
    """R, with the backward that follows it, as one call (the recompute
    must see the incoming gradient, and the two share the tape): its B
    then only hands on the input gradient made here."""
    s, m = a.stage, a.micro_batch
    st = state.stages[s]
    x, side = r['x'][1], r.get('side', (None, None))[1]
    if self.schedule.splits(s, m):  # R+I: dx, and what W will read.
      dx, kept, times = st.bodies.split_backward(
          st.theta, x, side, self._output_grads(a, r, st),
          self._after(state, d), state.index(m), self.step)
      dependency.independent(times)
      self._record(state, a, 'RI', times)
      state.after[d] = leaves((dx, kept))
      return {'act': (_input_grads(x, dx), kept)}
    dx, st.acc, times = st.bodies.backward(
        st.theta, x, side, self._output_grads(a, r, st), self._after(state, d),
        state.index(m), self.step, st.first_acc())
    dependency.independent(times)
    self._record(state, a, 'RB', times)
    state.after[d] = leaves((dx, st.acc))
    return {'act': _input_grads(x, dx)}

  def _backward(self, d: int, a: Action, r: dict[str, Any],
                state: StepState) -> dict[str, Any]:
    if 'act' in r:  # Computed with its R.
      return {'dx': r['act'][1]}
    st = state.stages[a.stage]
    after = self._after(state, d)
    x = r['x'][1]
    dx, st.acc, times = st.bodies.kept_backward(
        r['tape'][1], st.theta, x, r['y'][1], self._output_grads(a, r, st),
        after, st.acc)
    self._record(state, a, 'B', times)
    state.after[d] = leaves((dx, st.acc))
    return {'dx': _input_grads(x, dx)}

  def _send(self, d: int, a: Action, r: dict[str, Any],
            state: StepState) -> dict[str, Any]:
    s, m = a.stage, a.micro_batch
    forward = a.kind == 'SEND_F'
    to = s + 1 if forward else s - 1
    value = r['value'][1] if forward else float_leaves(r['value'][1])
    token = boundary.send(
        self.placement.peers, value,
        self.placement.task(self.schedule.device_of(to)),
        'F' if forward else 'B', to if forward else s - 1, state.index(m),
        None if self.specs is None else self._wire_spec(forward, to))
    if token is not None:
      state.sends.append(token)
      if state.loop is not None:
        state.after[d] = dependency.behind_send(state.after[d], token)
    return {'wire': None}

  def _recv(self, d: int, a: Action, r: dict[str, Any],
            state: StepState) -> dict[str, Any]:
    del r
    s, m = a.stage, a.micro_batch
    if self.specs is None:
      raise ExecutorError(f'Stage {s} reads from another process; the '
                          'executor needs the boundary specs to receive.')
    forward = a.kind == 'RECV_F'
    spec = self._wire_spec(forward, s)
    peer = s - 1 if forward else s + 1
    value = boundary.recv(
        self.placement.peers, spec,
        self.placement.task(self.schedule.device_of(peer)),
        'F' if forward else 'B', s, state.index(m), after=state.after[d])
    return {'value': value}

  def _wire_spec(self, forward: bool, s: int) -> Any:
    """What stage s receives: its input's spec, or (backward) the float
    leaves of its output's. The sender gives it too: inside a loop a value
    loses its static batch size, which the transfer's key needs."""
    if forward:
      return self.specs(s)
    return [t for t in tf.nest.flatten(self.specs(s + 1))
            if t is not None and differentiable(t)]

  def _input_grad(self, d: int, a: Action, r: dict[str, Any],
                  state: StepState) -> dict[str, Any]:
    """I: the input gradient, and what W will read (`w`)."""
    if 'act' in r:  # Computed with its R.
      dx, kept = r['act'][1]
      return {'dx': dx, 'w': kept}
    st = state.stages[a.stage]
    saved = r['saved'][1]
    dx, kept, times = st.bodies.input_grad(
        st.theta, saved, self._output_grads(a, r, st), self._after(state, d))
    dependency.independent(times)
    self._record(state, a, 'I', times)
    state.after[d] = leaves((dx, kept))
    return {'dx': _input_grads(st.bodies.input_structure(saved), dx),
            'w': kept}

  def _weight_grad(self, d: int, a: Action, r: dict[str, Any],
                   state: StepState) -> dict[str, Any]:
    """W: the stage's weight gradients of what I kept, into `acc`."""
    st = state.stages[a.stage]
    st.acc, times = st.bodies.weight_grad(
        st.theta, r['w'][1], self._after(state, d), st.first_acc())
    dependency.independent(times)
    self._record(state, a, 'W', times)
    state.after[d] = leaves(st.acc)
    return {}

  # ---- Results -----------------------------------------------------------
  def stacked(self, state: StepState, family: str, s: int) -> Any:
    """Every micro-batch's value of (family, s), stacked on a new axis 0."""
    array = state.arrays.get((family, s))
    num = self.schedule.num_micro_batches
    if array is not None:
      array.fill(state.stages[s], num)
      if len(array.keys) == num:
        return array.stack()
    values = [state.stages[s].get(family, m) for m in range(num)]
    with tf.device(self.stages[s].device):
      return tf.nest.map_structure(
          lambda *ts: None if ts[0] is None else tf.stack(ts), *values)

  def concat(self, state: StepState, family: str, s: int) -> Any:
    """Every micro-batch's value of (family, s), joined along the batch."""
    with tf.device(self.stages[s].device):
      array = state.arrays.get((family, s))
      if array is not None:  # Made in a loop.
        microbatch.check_batched(array.structure, self.batch_dim)
        return microbatch.unstack(self.stacked(state, family, s),
                                  self.batch_dim)
      return microbatch.concat(
          [state.stages[s].get(family, m)
           for m in range(self.schedule.num_micro_batches)], self.batch_dim)


def _input_grads(x: Any, dx: Sequence[tf.Tensor]) -> Any:
  """The gradients of x's float leaves, in x's structure (None elsewhere)."""
  it = iter(dx)
  return tf.nest.pack_sequence_as(
      x, [next(it) if differentiable(v) else None
          for v in tf.nest.flatten(x)])


def _from_arrays(state: StepState, s: int) -> Callable[[str, int], Any]:
  """Outside loops: a value a loop made, from the array it wrote."""
  def _resolve(family: str, m: int) -> Any:
    array = state.arrays.get((family, s))
    if array is None or m not in array.keys:
      raise KeyError((family, s, m))
    return array.read(m)
  return _resolve


_HANDLERS = {
    'F': Executor._forward,  # pylint: disable=protected-access
    'R': Executor._recompute,  # pylint: disable=protected-access
    'B': Executor._backward,  # pylint: disable=protected-access
    'I': Executor._input_grad,  # pylint: disable=protected-access
    'W': Executor._weight_grad,  # pylint: disable=protected-access
    'SEND_F': Executor._send,  # pylint: disable=protected-access
    'SEND_B': Executor._send,  # pylint: disable=protected-access
    'RECV_F': Executor._recv,  # pylint: disable=protected-access
    'RECV_B': Executor._recv,  # pylint: disable=protected-access
}
