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
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import placement as placement_lib
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import stage_ops
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


class WalkerError(errors.LingvoPipeError):
  """A stage list or placement the walker cannot run; names the fix."""


def _index(m: int) -> tf.Tensor:
  """Micro-batch index m as a tensor that Grappler will not constant-fold.

  A constant argument makes Grappler specialise the called stage function
  per value — M optimised copies of every stage body, which made the first
  call of a K=1, M=8 Transformer step take ~20 s instead of ~1 s.
  """
  return _opaque(tf.constant(m, tf.int32))


def _opaque(x: tf.Tensor) -> tf.Tensor:
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


def leaves(nest: Any) -> list[tf.Tensor]:
  return [t for t in tf.nest.flatten(nest) if t is not None]


class Walker:
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
    self.step = _opaque(tf.cast(ctx.step, tf.int64))  # See _index.
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
    self.x: dict[tuple[int, int], Any] = {}  # Stage inputs (boundaries).
    self.y: dict[tuple[int, int], Any] = {}  # Stage outputs.
    self.dx: dict[tuple[int, int], Any] = {}  # Gradients of stage inputs.
    self.seed: dict[int, list[tf.Tensor]] = {}  # Last stage's output grads.
    self.side: list[Any] | None = None  # Labels, per micro-batch.
    self.tapes: dict[tuple[int, int], tf.GradientTape] = {}
    self.acc: list[Any] = [None] * len(stages)
    # Each device's latest ops' outputs, oldest first: the last one is what
    # its next op waits on, the first where a recv is posted.
    self.done: list[list[list[tf.Tensor]]] = [[] for _ in range(len(schedule))]
    self.stats = [StatsCollector() for _ in stages]
    self.tokens: list[tf.Tensor] = []  # Sends; the step's end waits on them.
    self.fused: set[tuple[int, int]] = set()

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
    """Emits the local ones of `ops` ((device, op) in dependency order)."""
    for d, op in ops:
      s, m = self.schedule.stage(d, op), op.micro_batch
      if not self.placement.is_local(d) or (
          op.kind == 'B' and (s, m) in self.fused):
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
      return self.x[(0, m)]
    if not self.is_local(s - 1):
      return self._recv(self.specs(s), s - 1, ('F', s, m), d)
    with tf.device(self.stages[s].device):
      return chained(self.y[(s - 1, m)], [])

  def _forward(self, s: int, m: int, d: int) -> None:
    ops, theta = self.ops[s], self.thetas[s]
    x = self._input(s, m, d)
    side = self.side[m] if s == self.last and self.side else None
    if self.schedule.rebuilds(s, m):
      y, stats, times = ops.forward(theta, x, side, self._after(d),
                                    _index(m), self.step)
      _unordered(times)
    else:  # Kept, inline: the backward needs this tape.
      x, y, stats, times, self.tapes[(s, m)] = ops.kept_forward(
          theta, x, side, self._after(d), m, self.step)
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
        grads = [_opaque(g) for g in self.seed[m]]
    elif not self.is_local(s + 1):
      spec = [t for t in tf.nest.flatten(self.specs(s + 1))
              if t is not None and stage_ops.differentiable(t)]
      grads = self._recv(spec, s + 1, ('B', s, m), d)
    else:
      grads = float_leaves(self.dx[(s + 1, m)])
    with tf.device(self.stages[s].device):
      return [tf.identity(g) for g in grads]

  def _backward(self, s: int, m: int, d: int) -> None:
    ops, theta, x = self.ops[s], self.thetas[s], self.x[(s, m)]
    dys = self._output_grads(s, m, d)
    side = self.side[m] if s == self.last and self.side else None
    if self.schedule.rebuilds(s, m):  # R+B, one call.
      acc = self.acc[s]
      if acc is None:
        with tf.device(self.stages[s].device):
          acc = tf.nest.map_structure(
              lambda t: _opaque(tf.zeros_like(t)), theta)
      dx, self.acc[s], times = ops.backward(
          theta, x, side, dys, self._after(d), _index(m), self.step, acc)
      _unordered(times)
      self.fused.add((s, m))
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

  def input_grads(self) -> list[Any]:
    return [self.dx[(0, m)] for m in range(self.schedule.num_micro_batches)]

  def stage_stats(self) -> list[dict[str, Any]]:
    return [c.stats for c in self.stats]
