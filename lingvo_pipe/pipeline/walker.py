"""The walker: emits a schedule's ops, and holds what they pass each other.

For each (device, op) in dependency order it emits the op if its device is
local (`placement.py`) and skips it otherwise. What an op reads comes from
the op that made it: a tensor when both ran here, a collective recv when the
producer ran in another process — posted a few ops of this device ahead of
its reader (`RECV_LOOKAHEAD`), which is what bounds the activations a 1F1B
stage holds. What an op
makes for another process is sent as soon as it exists; no later op waits
on a send (a send completes only when its receiver is ready, and two stages
that each waited on their own send would wait for ever).

In one process the steady state of a schedule is a loop (`loops.py`): the
walker emits a few periods of ops as the body of a `tf.while_loop`, so that
tracing and the graph stay the same size for any M. The body runs the
same `_forward` and `_backward` as every other op; only where a value
comes from changes (`looping.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import looping
from lingvo_pipe.pipeline import loops
from lingvo_pipe.pipeline import placement as placement_lib
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import stage_ops
from lingvo_pipe.pipeline.looping import MicroBatches, leaves
from lingvo_pipe.pipeline.looping import opaque as _opaque
from lingvo_pipe.pipeline.stage_ops import Stage, chained, float_leaves

Specs = Callable[[int], Any]  # Stage s → per-micro-batch spec of its input.

# A recv is posted behind the op RECV_LOOKAHEAD + 1 ops of its device before
# its reader, so the transfer overlaps the RECV_LOOKAHEAD ops between. A recv
# posted after its send waits a gRPC round trip for the data; one posted
# before it gets the data as soon as it is sent. At K=2, 16 × FC 512, batch
# 1024, recompute always, 1F1B steps took (medians of 15; 3 alternated runs)
# 0.17 s with 1 op ahead, 0.15 s with 3, 0.15–0.16 s with 4, at M=16; at
# M=8 0.144 s with 1 and 0.127 s with 3 (GPipe 0.133 and 0.132). Each op
# ahead may hold one more boundary buffer per recv: far less than the
# micro-batch of activations a 1F1B stage holds per op in flight.
RECV_LOOKAHEAD = 3


WalkerError = looping.WalkerError


def _unordered(outputs: Sequence[tf.Tensor]) -> None:
  """Exempts the ops producing `outputs` from tf.function's ordering.

  With a timeline the stage bodies hold `tf.timestamp()`, a stateful op, so
  their calls become stateful, and tf.function's automatic control
  dependencies chain every stateful op in program order — all stages in one
  sequence, no overlap. The calls are already ordered by data; mark them
  independent instead.
  """
  if not outputs or tf.executing_eagerly():
    return
  manager = getattr(outputs[0].graph, 'experimental_acd_manager', None)
  if manager is not None:
    for op in {t.op for t in outputs}:
      manager.run_independently(op)


class Walker(looping.Looping):
  """Emits the ops of one schedule and holds what they exchange."""

  def __init__(self, stages: Sequence[Stage], schedule: schedule_lib.Schedule,
               batch_size: Any, batch_dim: int,
               placement: placement_lib.Placement | None = None,
               specs: Specs | None = None) -> None:
    """Args:
      stages: one per (virtual) stage of `schedule`.
      schedule: what to run.
      batch_size: this replica's batch size (int or scalar tensor).
      batch_dim: the batch dimension of every boundary tensor.
      placement: which devices are local (default: all).
      specs: stage s → its input's per-micro-batch spec, for the recvs of a
        stage whose producer runs in another process.
    """
    if len(stages) != schedule.num_stages:
      raise WalkerError(
          f'{len(stages)} stages but the {schedule.name} schedule has '
          f'{schedule.num_stages} (devices × chunks); build one per stage.')
    ctx = fprop_context.current()
    self.schedule = schedule
    self.stages = list(stages)
    self.placement = placement or placement_lib.Placement(
        placement_lib.collective.Peers.local(), schedule.num_devices)
    self.specs = specs
    self.step = _opaque(tf.cast(ctx.step, tf.int64))  # See looping._index.
    self.timeline = ctx.timeline
    num_micro = schedule.num_micro_batches
    micro_size = batch_size // num_micro
    # Dropout masks follow each example's index in the global batch.
    offset = self.placement.replica * batch_size
    total = batch_size * self.placement.num_replicas

    def _scope(m: Any, stats: StatsCollector | None, step: Any) -> Any:
      return fprop_context.scope(
          training=True, step=step, micro_batch_index=m,
          num_micro_batches=num_micro, batch_axis=batch_dim,
          first_example=offset + m * micro_size, global_batch_size=total,
          stats=stats)

    clock = stage_ops.Clock(ctx.timeline is not None)
    self.ops = [stage_ops.StageOps(stage, _scope, clock) for stage in stages]
    self.thetas: list[Any] = []
    # Per micro-batch, from the caller: stage 0's inputs, the last stage's
    # labels, and (for `engine.run`) the gradients of its outputs; None:
    # the last stage computes a loss and seeds its own backward.
    self.batch_dim = batch_dim
    self.inputs: MicroBatches | None = None
    self.side: MicroBatches | None = None
    self.seeds: MicroBatches | list[Any] | None = None
    # What ops pass each other, by (stage, micro-batch).
    self.x = looping.Store('x', self._resolve)  # Stage inputs (boundaries).
    self.y = looping.Store('y', self._resolve)  # Stage outputs.
    self.dx = looping.Store('dx', self._resolve)  # Gradients of stage inputs.
    self.tapes: dict[tuple[int, int], tf.GradientTape] = {}
    self.acc: list[Any] = [None] * len(stages)
    # Each device's latest ops' outputs, oldest first: the last one is what
    # its next op waits on, the first where a recv is posted.
    self.done: list[list[list[tf.Tensor]]] = [[] for _ in range(len(schedule))]
    self.stats = [StatsCollector() for _ in stages]
    self.tokens: list[tf.Tensor] = []  # Sends; the step's end waits on them.
    # Loops (see `plan`): what is left to emit, the TensorArrays families
    # were written to, and the loop being emitted (None: none).
    self.segments: list[loops.Segment] | None = None
    self._zeros: dict[int, tf.Tensor] = {}
    self._arrays: dict[loops.Family, looping.Array] = {}
    self._stacked: dict[str, Any] = {}
    self._loop: looping.Frame | None = None

  @property
  def last(self) -> int:
    return len(self.stages) - 1

  def device_of(self, s: int) -> int:
    return self.schedule.place(s)[0]

  def is_local(self, s: int) -> bool:
    return self.placement.is_local(self.device_of(s))

  def local_stages(self) -> list[int]:
    return [s for s in range(len(self.stages)) if self.is_local(s)]

  def emit(self, ops: Sequence[tuple[int, schedule_lib.Op]]) -> None:
    """Emits the local ones of `ops` ((device, op) in dependency order);
    after `plan`, the next len(ops) ops of the plan, loops as loops."""
    if self.segments is None:
      self._emit_ops(ops)
      return
    left = len(ops)
    while left:
      segment = self.segments.pop(0)
      if isinstance(segment, loops.Loop):
        self._emit_loop(segment)
        left -= len(segment.ops) * segment.count
      else:
        self._emit_ops(segment[:left])
        if len(segment) > left:
          self.segments.insert(0, segment[left:])
        left -= min(left, len(segment))
      if left < 0:
        raise WalkerError('A loop crosses the end of the ops to emit.')

  def _emit_ops(self, ops: Sequence[tuple[int, schedule_lib.Op]]) -> None:
    for d, op in ops:
      s, m = self.schedule.stage(d, op), op.micro_batch
      if not self.placement.is_local(d) or (
          op.kind == 'B' and self.schedule.rebuilds(s, m)):
        continue  # Another process's, or emitted with its R.
      with tf.name_scope(f'stage{s}_{op.kind}{m}'):
        if op.kind == 'F':
          self._forward(s, m, d)
        else:
          self._backward(s, m, d)

  def _record(self, s: int, m: int, kinds: str,
              times: list[tf.Tensor]) -> None:
    """Appends one record per kind; `times` holds a [start, end] bracket
    per kind (R and B of a recomputing backward are two brackets)."""
    if self.timeline is not None:
      for i, kind in enumerate(kinds):
        self.timeline.append((s, m, kind, times[2 * i], times[2 * i + 1]))

  def _after(self, d: int) -> list[tf.Tensor]:
    # Never empty, so a body is traced once, not once more for its first call.
    return (self.done[d] or [[]])[-1] or [_opaque(tf.zeros([]))]

  def _advance(self, d: int, tensors: list[tf.Tensor]) -> None:
    """Device d's next op waits on `tensors`."""
    self.done[d] = (self.done[d] + [tensors])[-(RECV_LOOKAHEAD + 1):]

  def _send(self, value: Any, s: int, key: tuple[Any, ...]) -> None:
    """Sends `value` to stage s's process, if that is another one."""
    if not self.is_local(s):
      token = self.placement.peers.send(
          value, self.placement.task(self.device_of(s)), key)
      if token is not None:
        self.tokens.append(token)

  def _recv(self, spec: Any, s: int, key: tuple[Any, ...], d: int) -> Any:
    """What stage s's process sent with `key`, received by device d.

    The recv is posted behind device d's op RECV_LOOKAHEAD + 1 ops before
    the reader (at the step's start if there is none), so the transfer
    overlaps the ops between: a few boundary buffers more per stage, and
    1F1B's bound on the micro-batches a stage holds stays.
    """
    if self.specs is None:
      raise WalkerError(f'Stage {s} runs in another process; the walker '
                        'needs the boundary specs to receive from it.')
    done = self.done[d]
    return self.placement.peers.recv(
        spec, self.placement.task(self.device_of(s)), key,
        after=done[0] if len(done) > RECV_LOOKAHEAD else [])

  def _input(self, s: int, m: int, d: int) -> Any:
    """F(s, m)'s input, placed on s's device once (R reads it again)."""
    if s == 0:
      return self._micro('inputs', m, d)
    if not self.is_local(s - 1):
      return self._recv(self.specs(s), s - 1, ('F', s, m), d)
    with tf.device(self.stages[s].device):
      return chained(self.y[(s - 1, m)], [])

  def _forward(self, s: int, m: int, d: int) -> None:
    ops, theta = self.ops[s], self.thetas[s]
    x = self._input(s, m, d)
    side = (self._micro('side', m, d) if s == self.last and self.side
            else None)
    if self.schedule.rebuilds(s, m):
      y, stats, times = ops.forward(theta, x, side, self._after(d),
                                    self._mi(m), self.step)
      _unordered(times)
    else:  # Kept, inline: the backward needs this tape.
      x, y, stats, times, self.tapes[(s, m)] = ops.kept_forward(
          theta, x, side, self._after(d),
          m if self._loop is None else self._mi(m), self.step)
    self.x[(s, m)], self.y[(s, m)] = x, y
    with tf.device(self.stages[s].device):
      self.stats[s].merge(stats)
    self._record(s, m, 'F', times)
    self._advance(d, leaves(y) or self._after(d))
    if s < self.last:
      self._send(y, s + 1, ('F', s + 1, m))

  def _output_grads(self, s: int, m: int, d: int) -> list[tf.Tensor]:
    """Gradients of F(s, m)'s float outputs, on s's device."""
    if s == self.last:
      with tf.device(self.stages[s].device):
        if self.seeds is not None:
          grads = [_opaque(g) for g in self._micro('seeds', m, d)]
        else:  # The loss: d(Σ value·weight) = 1, d(metrics) = 0.
          outputs = float_leaves(self.y[(s, m)])
          grads = [_opaque(g) for g in [tf.ones_like(outputs[0])] +
                   [tf.zeros_like(t) for t in outputs[1:]]]
    elif not self.is_local(s + 1):
      spec = [t for t in tf.nest.flatten(self.specs(s + 1))
              if t is not None and stage_ops.differentiable(t)]
      grads = self._recv(spec, s + 1, ('B', s, m), d)
    else:
      grads = float_leaves(self.dx[(s + 1, m)])
    with tf.device(self.stages[s].device):
      return [tf.identity(g) for g in grads]

  def _backward(self, s: int, m: int, d: int) -> None:
    ops, theta = self.ops[s], self.thetas[s]
    if s == 0 and self.schedule.rebuilds(s, m):
      x = self._micro('inputs', m, d)  # The slice F read (Looping._io).
    else:
      x = self.x[(s, m)]
    dys = self._output_grads(s, m, d)
    side = (self._micro('side', m, d) if s == self.last and self.side
            else None)
    if self.schedule.rebuilds(s, m):  # R+B, one call.
      acc = self.acc[s]
      if acc is None:
        with tf.device(self.stages[s].device):
          acc = tf.nest.map_structure(
              lambda t: _opaque(tf.zeros_like(t)), theta)
      dx, self.acc[s], times = ops.backward(
          theta, x, side, dys, self._after(d), self._mi(m), self.step, acc)
      _unordered(times)
      self._record(s, m, 'RB', times)
    else:
      dx, self.acc[s], times = ops.kept_backward(
          self.tapes.pop((s, m)), theta, x, self.y[(s, m)], dys,
          self._after(d), self.acc[s])
      self._record(s, m, 'B', times)
    it = iter(dx)
    self.dx[(s, m)] = tf.nest.pack_sequence_as(
        x, [next(it) if stage_ops.differentiable(v) else None
            for v in tf.nest.flatten(x)])
    self._advance(d, leaves((dx, self.acc[s])))
    if s > 0:
      self._send(list(dx), s - 1, ('B', s - 1, m))

  def stage_stats(self) -> list[dict[str, Any]]:
    return [c.stats for c in self.stats]
