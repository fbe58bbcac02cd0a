"""The engine: executes a `schedule.Schedule`, one op at a time, in one graph.

    walk the schedule in dependency order (schedule.emission_order):
      F(s, m)    stage s's forward of micro-batch m, on s's device
      R+B(s, m)  its recompute (if s recomputes) and backward
    each op waits for the previous op of its device (the schedule's order)
    and for the ops `schedule.dependencies` names (the data it reads).

Two entry points share the walker:

* `run` — differentiable under an ordinary outer `tf.GradientTape`: a
  `tf.custom_gradient` whose forward emits every F, and whose gradient
  function emits the rest. That needs a schedule in which every device runs
  all its forwards before any backward (GPipe).
* `run_with_loss` — the last stage also computes each micro-batch's loss,
  so backwards can start while forwards still run (1F1B, interleaved):
  the forward of the custom gradient emits the whole schedule, and its
  gradient function only scales the gradients it already has.

The loss is a weighted mean: each micro-batch's `loss_fn` returns metrics
`{name: (value, weight)}`; the step's value is Σ value·weight / Σ weight.
Each backward is seeded with d(value·weight) = 1 and the accumulated
gradients are divided by Σ weight at the end, which is exact for any split
into micro-batches (the weights are counts: they must not depend on theta).

What one op computes, and why each detail is there, is in `stage_ops.py`.
Timing, when `fprop_context.scope(timeline=[])` is open, wraps each op.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import stage_ops
from lingvo_pipe.pipeline.stage_ops import Stage, chained, float_leaves

__all__ = ['EngineError', 'Stage', 'run', 'run_with_loss']

LossFn = Callable[[Any, Any], dict[str, tuple[tf.Tensor, tf.Tensor]]]


class EngineError(errors.LingvoPipeError):
  """A schedule or stage list the engine cannot run as asked."""


def _index(m: int) -> tf.Tensor:
  """Micro-batch index m as a tensor that Grappler will not constant-fold.

  A constant argument makes Grappler specialise the called stage function
  per value — M optimised copies of every stage body, which made the first
  call of a K=1, M=8 Transformer step take ~20 s instead of ~1 s.
  """
  return tf.compat.v1.placeholder_with_default(tf.constant(m, tf.int32), [])


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


def _leaves(nest: Any) -> list[tf.Tensor]:
  return [t for t in tf.nest.flatten(nest) if t is not None]


class _Walker:
  """Emits the ops of one schedule and holds what they exchange."""

  def __init__(self, stages: Sequence[Stage], schedule: schedule_lib.Schedule,
               batch_size: Any, batch_dim: int) -> None:
    if len(stages) != schedule.num_stages:
      raise EngineError(
          f'{len(stages)} stages but the {schedule.name} schedule has '
          f'{schedule.num_stages} (devices × chunks); build one per stage.')
    ctx = fprop_context.current()
    self.schedule = schedule
    self.stages = list(stages)
    self.batch_dim = batch_dim
    self.step = tf.compat.v1.placeholder_with_default(
        tf.cast(ctx.step, tf.int64), [])  # Not folded: see _index.
    self.timeline = ctx.timeline
    num_micro = schedule.num_micro_batches
    micro_size = batch_size // num_micro
    clock = stage_ops.Clock(ctx.timeline is not None)

    def _scope(m: Any, stats: StatsCollector | None, step: Any) -> Any:
      return fprop_context.scope(
          training=True, step=step, micro_batch_index=m,
          num_micro_batches=num_micro, batch_axis=batch_dim,
          first_example=m * micro_size, global_batch_size=batch_size,
          stats=stats)

    self.ops = [stage_ops.StageOps(stage, _scope, clock,
                                   schedule.recomputes(s))
                for s, stage in enumerate(stages)]
    self.thetas: list[Any] = []
    self.x: dict[tuple[int, int], Any] = {}  # Stage inputs (boundaries).
    self.y: dict[tuple[int, int], Any] = {}  # Stage outputs.
    self.dx: dict[tuple[int, int], Any] = {}  # Gradients of stage inputs.
    self.seed: dict[int, list[tf.Tensor]] = {}  # Last stage's output grads.
    self.side: list[Any] | None = None  # Labels, per micro-batch.
    self.tapes: dict[tuple[int, int], tf.GradientTape] = {}
    self.acc: list[Any] = [None] * len(stages)
    self.chain: list[list[tf.Tensor]] = [[] for _ in range(len(schedule))]
    self.stats = [StatsCollector() for _ in stages]
    self.fused: set[tuple[int, int]] = set()

  @property
  def last(self) -> int:
    return len(self.stages) - 1

  def emit(self, ops: Sequence[tuple[int, schedule_lib.Op]]) -> None:
    """Emits `ops` ((device, op) pairs in dependency order)."""
    for d, op in ops:
      s, m = self.schedule.stage(d, op), op.micro_batch
      if op.kind == 'B' and (s, m) in self.fused:
        continue  # Emitted with its R.
      with tf.name_scope(f'stage{s}_{op.kind}{m}'):
        if op.kind == 'F':
          self._forward(s, m, d)
        else:
          self._backward(s, m, d)

  def _record(self, s: int, m: int, kinds: str,
              times: list[tf.Tensor]) -> None:
    if self.timeline is not None:
      for i, kind in enumerate(kinds):
        self.timeline.append((s, m, kind, times[i], times[i + 1]))

  def _after(self, d: int) -> list[tf.Tensor]:
    # Never empty, so a body is traced once, not once more for its first call.
    return self.chain[d] or [tf.zeros([])]

  def _input(self, s: int, m: int) -> Any:
    """F(s, m)'s input, placed on s's device once (R reads it again)."""
    with tf.device(self.stages[s].device):
      return chained(self.y[(s - 1, m)], [])

  def _forward(self, s: int, m: int, d: int) -> None:
    ops, theta = self.ops[s], self.thetas[s]
    x = self.x[(s, m)] if s == 0 else self._input(s, m)
    side = self.side[m] if s == self.last and self.side else None
    if ops.recomputes:
      y, stats, times = ops.forward(theta, x, side, self._after(d),
                                    _index(m), self.step)
      _unordered(times)
    else:  # Inline: the backward needs this tape.
      x, y, stats, times, self.tapes[(s, m)] = ops.kept_forward(
          theta, x, side, self._after(d), m, self.step)
    self.x[(s, m)], self.y[(s, m)] = x, y
    with tf.device(self.stages[s].device):
      self.stats[s].merge(stats)
    self._record(s, m, 'F', times)
    self.chain[d] = _leaves(y) or self._after(d)

  def _output_grads(self, s: int, m: int) -> list[tf.Tensor]:
    """Gradients of F(s, m)'s float outputs, on s's device."""
    if s == self.last:
      grads = self.seed[m]
    else:
      grads = float_leaves(self.dx[(s + 1, m)])
    with tf.device(self.stages[s].device):
      return [tf.identity(g) for g in grads]

  def _backward(self, s: int, m: int, d: int) -> None:
    ops, theta, x = self.ops[s], self.thetas[s], self.x[(s, m)]
    dys = self._output_grads(s, m)
    side = self.side[m] if s == self.last and self.side else None
    if ops.recomputes:
      acc = self.acc[s]
      if acc is None:
        with tf.device(self.stages[s].device):
          acc = tf.nest.map_structure(tf.zeros_like, theta)
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
    self.chain[d] = _leaves((dx, self.acc[s]))

  def input_grads(self) -> list[Any]:
    return [self.dx[(0, m)] for m in range(self.schedule.num_micro_batches)]

  def stage_stats(self) -> list[dict[str, Any]]:
    return [c.stats for c in self.stats]


def _read_thetas(stages: Sequence[Stage]) -> list[Any]:
  """Each stage's weights, read on its own device."""
  thetas = []
  for stage in stages:
    with tf.device(stage.device):
      thetas.append(tf.nest.map_structure(tf.identity, stage.theta))
  return thetas


def _pack_args(inputs: Any, thetas: list[Any], args: Sequence[tf.Tensor]
              ) -> tuple[Any, list[Any]]:
  """Inverse of flattening (inputs, *thetas) into one argument list."""
  n = len(tf.nest.flatten(inputs))
  xs = tf.nest.pack_sequence_as(inputs, list(args[:n]))
  out, pos = [], n
  for theta in thetas:
    k = len(tf.nest.flatten(theta))
    out.append(tf.nest.pack_sequence_as(theta, list(args[pos:pos + k])))
    pos += k
  return xs, out


def _forward_prefix(schedule: schedule_lib.Schedule
                   ) -> tuple[list[Any], list[Any]]:
  """Emission order split into every F, then every R/B (GPipe-like only)."""
  for d, ops in enumerate(schedule):
    kinds = ''.join(op.kind for op in ops)
    if 'F' in kinds.lstrip('F'):
      raise EngineError(
          f'schedule={schedule.name!r} runs a backward on device {d} before '
          'its last forward, so the loss must be inside the pipeline: use '
          'PipeliningLayer.FPropLoss (or schedule=\'gpipe\' with FProp).')
  order = schedule_lib.emission_order(schedule)
  return ([o for o in order if o[1].kind == 'F'],
          [o for o in order if o[1].kind != 'F'])


def _merge_stats(stats: list[dict[str, Any]]) -> None:
  collector = fprop_context.current().stats
  if collector is not None:
    for stage_stats in stats:
      collector.merge(stage_stats)


@tf.autograph.experimental.do_not_convert  # Graph code already.
def run(stages: list[Stage], inputs: tuple[Any, ...],
        schedule: schedule_lib.Schedule, batch_dim: int = 0) -> Any:
  """Pipelined, differentiable forward of `stages` over `inputs`.

  Args:
    stages: The composite stages in order; stage s's outputs are stage s+1's
      inputs (a tuple of nests of tensors).
    inputs: Positional inputs of stage 0; every leaf has the batch on
      `batch_dim`.
    schedule: A schedule whose devices run all forwards first (GPipe).
    batch_dim: The batch dimension of every leaf.

  Returns:
    The last stage's outputs for the whole batch (micro-batches
    concatenated). Statistics added by layers are summed over micro-batches
    and merged into the caller's `fprop_context` collector, if any.
  """
  forward_ops, backward_ops = _forward_prefix(schedule)
  num_micro = schedule.num_micro_batches
  walker = _Walker(stages, schedule, microbatch.batch_size(
      inputs, batch_dim, 'pipeline'), batch_dim)
  thetas = _read_thetas(stages)
  args = tf.nest.flatten(inputs) + tf.nest.flatten(thetas)
  structure: list[Any] = []

  @tf.custom_gradient
  def _pipelined(*flat: tf.Tensor) -> Any:
    xs, walker.thetas = _pack_args(inputs, thetas, flat)
    with tf.device(stages[0].device):
      for m, x in enumerate(microbatch.split(xs, num_micro, batch_dim)):
        walker.x[(0, m)] = x
    walker.emit(forward_ops)
    with tf.device(stages[-1].device):
      out = microbatch.concat([walker.y[(walker.last, m)]
                               for m in range(num_micro)], batch_dim)
    stats = walker.stage_stats()
    structure.extend([out, stats])

    def _grad(*dys: tf.Tensor) -> list[tf.Tensor | None]:
      dy = tf.nest.pack_sequence_as(out, list(dys[:len(tf.nest.flatten(out))]))
      with tf.device(stages[-1].device):
        dy = tf.nest.map_structure(
            lambda g, y: tf.zeros_like(y) if g is None else g, dy, out)
        for m, part in enumerate(microbatch.split(dy, num_micro, batch_dim)):
          ys = tf.nest.flatten(walker.y[(walker.last, m)])
          walker.seed[m] = [g for g, y in zip(tf.nest.flatten(part), ys)
                            if stage_ops.differentiable(y)]
      walker.emit(backward_ops)
      with tf.device(stages[0].device):
        dx = microbatch.concat(walker.input_grads(), batch_dim)
      return ([g if stage_ops.differentiable(x) else None
               for g, x in zip(tf.nest.flatten(dx), tf.nest.flatten(inputs))]
              + [g for a in walker.acc for g in tf.nest.flatten(a)])

    return tf.nest.flatten(out) + tf.nest.flatten(stats), _grad

  flat = _pipelined(*args)
  out, stats = structure
  n_out = len(tf.nest.flatten(out))
  _merge_stats(tf.nest.pack_sequence_as(stats, flat[n_out:]))
  return tf.nest.pack_sequence_as(out, flat[:n_out])


def _loss_stage(stage: Stage, loss_fn: LossFn) -> Stage:
  """The last stage followed by the loss: outputs (Σ value·weight, metrics)."""

  def _fprop(theta: Any, x: tuple[Any, ...], labels: Any) -> tuple[Any, ...]:
    out = stage.fprop(theta, x)
    metrics = loss_fn(out[0] if len(out) == 1 else out, labels)
    if 'loss' not in metrics:
      raise EngineError(f'loss_fn returned {sorted(metrics)}; it must return '
                        "{'loss': (value, weight), ...} per micro-batch.")
    value, weight = metrics['loss']
    return value * tf.cast(weight, value.dtype), dict(metrics)
  return Stage(_fprop, stage.theta, stage.device)


def _mean_metrics(parts: list[dict[str, tuple[tf.Tensor, tf.Tensor]]]
                 ) -> tuple[dict[str, tuple[tf.Tensor, tf.Tensor]], tf.Tensor]:
  """Per-micro-batch (value, weight) → the step's (weighted mean, Σ weight)."""
  out = {}
  for name in parts[0]:
    weights = [tf.cast(p[name][1], tf.float32) for p in parts]
    total = tf.add_n(weights)
    sums = tf.add_n([tf.cast(p[name][0], tf.float32) * w
                     for p, w in zip(parts, weights)])
    out[name] = (sums / tf.maximum(total, 1e-30), total)
  return out, out['loss'][1]


@tf.autograph.experimental.do_not_convert  # Graph code already.
def run_with_loss(stages: list[Stage], inputs: tuple[Any, ...], labels: Any,
                  loss_fn: LossFn, schedule: schedule_lib.Schedule,
                  batch_dim: int = 0) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
  """The whole step of any schedule: forwards, losses, backwards.

  Args:
    stages: As for `run`.
    inputs: As for `run`.
    labels: A nest with the batch on `batch_dim`, split like the inputs and
      given to `loss_fn` on the last stage (never differentiated).
    loss_fn: (last stage's outputs, labels) of one micro-batch →
      {'loss': (value, weight), other metrics...}, each a weighted mean.
    schedule: Any schedule.
    batch_dim: The batch dimension of every leaf.

  Returns:
    {name: (weighted mean over the batch, Σ weight)}. `loss`'s value is
    differentiable under an outer tape (theta and the float inputs); the
    other metrics are not.
  """
  num_micro = schedule.num_micro_batches
  stages = stages[:-1] + [_loss_stage(stages[-1], loss_fn)]
  walker = _Walker(stages, schedule, microbatch.batch_size(
      inputs, batch_dim, 'pipeline'), batch_dim)
  thetas = _read_thetas(stages)
  structure: list[Any] = []

  @tf.custom_gradient
  def _step(*flat: tf.Tensor) -> Any:
    xs, walker.thetas = _pack_args(inputs, thetas, flat)
    with tf.device(stages[0].device):
      for m, x in enumerate(microbatch.split(xs, num_micro, batch_dim)):
        walker.x[(0, m)] = x
    with tf.device(stages[-1].device):
      walker.side = microbatch.split(labels, num_micro, batch_dim)
      for m in range(num_micro):
        walker.seed[m] = []  # Filled once F(last, m) exists: see _seed.
    _emit_with_seeds(walker, schedule_lib.emission_order(schedule))
    with tf.device(stages[-1].device):
      metrics, total_weight = _mean_metrics(
          [walker.y[(walker.last, m)][1] for m in range(num_micro)])
      scale = 1.0 / tf.maximum(total_weight, 1e-30)
    grads = []
    for stage, acc in zip(stages, walker.acc):
      with tf.device(stage.device):
        grads += [g * tf.cast(scale, g.dtype) for g in tf.nest.flatten(acc)]
    with tf.device(stages[0].device):
      dx = microbatch.concat(walker.input_grads(), batch_dim)
    dx_leaves = [g * tf.cast(scale, g.dtype) if stage_ops.differentiable(x)
                 else None for g, x in zip(tf.nest.flatten(dx),
                                           tf.nest.flatten(inputs))]
    stats = walker.stage_stats()
    structure.extend([metrics, stats])
    # Where the loss value is among the flat outputs (dicts flatten sorted).
    loss_at = tf.nest.flatten(
        {k: (k == 'loss', False) for k in metrics}).index(True)

    def _grad(*dys: tf.Tensor) -> list[tf.Tensor | None]:
      d_loss = dys[loss_at]  # Only the loss value is differentiable.
      return [None if g is None else g * tf.cast(d_loss, g.dtype)
              for g in dx_leaves + grads]

    return tf.nest.flatten(metrics) + tf.nest.flatten(stats), _grad

  flat = _step(*(tf.nest.flatten(inputs) + tf.nest.flatten(thetas)))
  metrics, stats = structure
  n_metrics = len(tf.nest.flatten(metrics))
  _merge_stats(tf.nest.pack_sequence_as(stats, flat[n_metrics:]))
  return tf.nest.pack_sequence_as(metrics, flat[:n_metrics])


def _emit_with_seeds(walker: _Walker, order: list[Any]) -> None:
  """Emits `order`; once F(last, m) exists, seeds its backward: d(Σ vw)=1."""
  for d, op in order:
    walker.emit([(d, op)])
    s = walker.schedule.stage(d, op)
    if op.kind == 'F' and s == walker.last:
      outputs = float_leaves(walker.y[(s, op.micro_batch)])
      with tf.device(walker.stages[s].device):
        walker.seed[op.micro_batch] = (
            [tf.ones_like(outputs[0])] +
            [tf.zeros_like(t) for t in outputs[1:]])
