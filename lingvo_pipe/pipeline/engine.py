"""The engine: one training step of a schedule, as a differentiable op.

    split inputs (and labels) into M micro-batches          (microbatch.py)
    run the schedule's actions, in one process or several   (executor.py)
    return the outputs (or the loss and metrics); their gradient is the
    gradients the backward actions accumulated

Two entry points:

* `run` — differentiable under an ordinary outer `tf.GradientTape`: a
  `tf.custom_gradient` whose forward runs every F, and whose gradient
  function runs the rest with the outer tape's output gradients as seeds.
  That needs a schedule in which every device runs all its forwards before
  any backward (GPipe).
* `run_with_loss` — the last stage also computes each micro-batch's loss,
  so backwards can start while forwards still run (1F1B, interleaved, any
  schedule): the forward of the custom gradient runs the whole schedule,
  and its gradient function only scales the gradients it already has.

The loss is a weighted mean: each micro-batch's `loss_fn` returns metrics
`{name: (value, weight)}`; the step's value is Σ value·weight / Σ weight.
Each backward is seeded with d(value·weight) = 1 and the accumulated
gradients are divided by Σ weight at the end, which is exact for any split
into micro-batches (the weights are counts: they must not depend on theta).

With stage processes each process runs its own stages' actions, with the
transfers of `Schedule.with_transfers` between them; metrics are reduced
over every task (the step's barrier), and each stage's gradients and
statistics over its replicas.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.pipeline import executor as executor_lib
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import placement as placement_lib
from lingvo_pipe.pipeline.actions import Schedule, emission_order, keys_of
from lingvo_pipe.pipeline.executor import Executor, Feed, Specs
from lingvo_pipe.pipeline.stage import Stage, differentiable

__all__ = ['EngineError', 'Stage', 'TiedLeaf', 'run', 'run_with_loss']

LossFn = Callable[[Any, Any], dict[str, tuple[tf.Tensor, tf.Tensor]]]
EngineError = executor_lib.ExecutorError  # A schedule or stages it cannot run.


def _hiding_none(stages: Sequence[Stage]) -> list[Stage]:
  """Stages whose inputs and outputs hide their None leaves (each layer
  still gets and returns them): see `microbatch.hide_none`."""

  def _wrap(fprop: Callable[..., Any]) -> Callable[..., Any]:
    return lambda theta, x, *side: microbatch.hide_none(fprop(
        theta, *(microbatch.show_none(a) for a in (x, *side))))
  return [Stage(_wrap(s.fprop), s.theta, s.device, s.inline) for s in stages]


def _read_thetas(stages: Sequence[Stage], local: Sequence[int]) -> list[Any]:
  """Each local stage's weights, read on its own device."""
  thetas = []
  for s in local:
    with tf.device(stages[s].device):
      thetas.append(tf.nest.map_structure(tf.identity, stages[s].theta))
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


def _phases(schedule: Schedule) -> tuple[list[Any], list[Any]]:
  """Emission order split into every F, then every R/B (GPipe-like only)."""
  for d, ops in enumerate(schedule.compute()):
    kinds = ''.join('F' if a.kind == 'F' else 'b' for a in ops)
    if 'F' in kinds.lstrip('F'):
      raise EngineError(
          f'schedule={schedule.name!r} runs a backward on device {d} before '
          'its last forward, so the loss must be inside the pipeline: use '
          'PipeliningLayer.FPropLoss (or schedule=\'gpipe\' with FProp).')
  order = emission_order(schedule)
  return ([o for o in order if o[1].kind == 'F'],
          [o for o in order if o[1].kind != 'F'])


def _merge_stats(stats: list[dict[str, Any]]) -> None:
  collector = fprop_context.current().stats
  if collector is not None:
    for stage_stats in stats:
      collector.merge(stage_stats)


def _outputs(schedule: Schedule, family: str, stage: int) -> list[Any]:
  return [(family, stage, m) for m in range(schedule.num_micro_batches)]


@tf.autograph.experimental.do_not_convert  # Graph code already.
def run(stages: list[Stage], inputs: tuple[Any, ...], schedule: Schedule,
        batch_dim: int = 0, loop: bool = True) -> Any:
  """Pipelined, differentiable forward of `stages` over `inputs`.

  Args:
    stages: The composite stages in order; stage s's outputs are stage s+1's
      inputs (a tuple of nests of tensors).
    inputs: Positional inputs of stage 0; every leaf has the batch on
      `batch_dim`.
    schedule: A schedule whose devices run all forwards first (GPipe).
    batch_dim: The batch dimension of every leaf.
    loop: Emit the schedule's steady state as loops where it can; False
      emits every action.

  Returns:
    The last stage's outputs for the whole batch (micro-batches
    concatenated). Statistics added by layers are summed over micro-batches
    and merged into the caller's `fprop_context` collector, if any.
  """
  forward, backward = _phases(schedule)
  num_micro, last = schedule.num_micro_batches, len(stages) - 1
  stages, inputs = _hiding_none(stages), microbatch.hide_none(inputs)
  ex = Executor(stages, schedule, microbatch.batch_size(
      inputs, batch_dim, 'pipeline'), batch_dim, loop=loop)
  local = ex.local_stages()
  thetas = _read_thetas(stages, local)
  structure: list[Any] = []

  @tf.custom_gradient
  def _pipelined(*flat: tf.Tensor) -> Any:
    xs, stage_thetas = _pack_args(inputs, thetas, flat)
    feed = Feed(input=microbatch.MicroBatches(xs, num_micro, batch_dim,
                                              stages[0].device))
    state = ex.new_state(dict(zip(local, stage_thetas)))
    # What the backward phase reads of the forward's values, kept.
    kept = (keys_of(schedule, backward, seeded=True, writes=False) &
            keys_of(schedule, forward))
    state = ex.run(forward, state, feed,
                   _outputs(schedule, 'y', last) + sorted(kept), seeded=True)
    out = ex.concat(state, 'y', last)
    stats = [state.stages[s].stats for s in local]
    structure.extend([out, stats])

    def _grad(*dys: tf.Tensor) -> list[tf.Tensor | None]:
      dy = tf.nest.pack_sequence_as(out, list(dys[:len(tf.nest.flatten(out))]))
      with tf.device(stages[-1].device):
        dy = tf.nest.map_structure(
            lambda g, y: tf.zeros_like(y) if g is None else g, dy, out)
      feed.seed = microbatch.MicroBatches(
          [g for g, y in zip(tf.nest.flatten(dy), tf.nest.flatten(out))
           if differentiable(y)], num_micro, batch_dim, stages[-1].device)
      done = ex.run(backward, state, feed, _outputs(schedule, 'dx', 0),
                    seeded=True)
      dx = ex.concat(done, 'dx', 0)
      return ([g if differentiable(x) else None
               for g, x in zip(tf.nest.flatten(dx), tf.nest.flatten(inputs))]
              + [g for s in local
                 for g in tf.nest.flatten(done.stages[s].acc)])

    return tf.nest.flatten(out) + tf.nest.flatten(stats), _grad

  flat = _pipelined(*(tf.nest.flatten(inputs) + tf.nest.flatten(thetas)))
  out, stats = structure
  n_out = len(tf.nest.flatten(out))
  _merge_stats(tf.nest.pack_sequence_as(stats, flat[n_out:]))
  return microbatch.show_none(tf.nest.pack_sequence_as(out, flat[:n_out]))


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
  return Stage(_fprop, stage.theta, stage.device, stage.inline)


def _metric_sums(metrics: dict[str, tuple[tf.Tensor, tf.Tensor]]
                ) -> dict[str, tf.Tensor]:
  """{name: (values, weights)}, one of each per micro-batch (stacked) →
  {name: [Σ value·weight, Σ weight]}."""
  out = {}
  for name, (value, weight) in metrics.items():
    weight = tf.cast(weight, tf.float32)
    out[name] = tf.stack([tf.reduce_sum(tf.cast(value, tf.float32) * weight),
                          tf.reduce_sum(weight)])
  return out


def _metric_names(loss_fn: LossFn, out_spec: Any, labels: Any) -> list[str]:
  """The names loss_fn returns, by tracing it on specs (another process runs
  the last stage, and all processes reduce the metrics together)."""
  label_spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape, t.dtype), labels)
  out_spec = out_spec[0] if len(out_spec) == 1 else out_spec
  traced = tf.function(
      lambda y, side: loss_fn(*microbatch.show_none((y, side))),
      autograph=False).get_concrete_function(out_spec, label_spec)
  return sorted(traced.structured_outputs)


@tf.autograph.experimental.do_not_convert  # Graph code already.
def run_with_loss(stages: list[Stage], inputs: tuple[Any, ...], labels: Any,
                  loss_fn: LossFn, schedule: Schedule, batch_dim: int = 0,
                  placement: placement_lib.Placement | None = None,
                  specs: Specs | None = None, loop: bool = True,
                  ties: Sequence['TiedLeaf'] = ()
                 ) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
  """The whole step of any schedule: forwards, losses, backwards.

  Args:
    stages: As for `run` (only the local ones are read).
    inputs: As for `run`: this replica's batch.
    labels: A nest with the batch on `batch_dim`, split like the inputs and
      given to `loss_fn` on the last stage (never differentiated).
    loss_fn: (last stage's outputs, labels) of one micro-batch →
      {'loss': (value, weight), other metrics...}, each a weighted mean.
    schedule: Any schedule (compute actions only: the transfers between
      processes are inserted here).
    batch_dim: The batch dimension of every leaf.
    placement: Which devices run here (default: all). With several
      processes, the metrics are reduced over every task, and each stage's
      gradients and statistics over its replicas.
    specs: Stage s → its input's per-micro-batch spec (s = #stages: the
      last stage's output); needed when stages run in other processes.
    loop: As for `run`.
    ties: The local theta leaves that are copies of a weight tied across
      stage processes (`_tied_sums`).

  Returns:
    {name: (weighted mean over the batch of every replica, Σ weight)}.
    `loss`'s value is differentiable under an outer tape (the local thetas
    and the float inputs); the other metrics are not.
  """
  num_micro, last = schedule.num_micro_batches, len(stages) - 1
  placement = placement or placement_lib.Placement(
      placement_lib.collective.Peers.local(), schedule.num_devices)
  if placement.multi_process:
    schedule = schedule.with_transfers()
  stages = _hiding_none(stages[:-1] + [_loss_stage(stages[-1], loss_fn)])
  inputs, labels = microbatch.hide_none(inputs), microbatch.hide_none(labels)
  if specs is not None:
    specs = lambda s, given=specs: microbatch.hide_none(given(s))
  ex = Executor(stages, schedule, microbatch.batch_size(
      inputs, batch_dim, 'pipeline'), batch_dim, placement, specs, loop)
  local = ex.local_stages()
  thetas = _read_thetas(stages, local)
  structure: list[Any] = []

  @tf.custom_gradient
  def _step(*flat: tf.Tensor) -> Any:
    xs, local_thetas = _pack_args(inputs, thetas, flat)
    feed = Feed(
        input=(microbatch.MicroBatches(xs, num_micro, batch_dim,
                                       stages[0].device)
               if ex.is_local(0) else None),
        label=(microbatch.MicroBatches(labels, num_micro, batch_dim,
                                       stages[last].device)
               if ex.is_local(last) else None))
    state = ex.run(emission_order(schedule),
                   ex.new_state(dict(zip(local, local_thetas))), feed,
                   _outputs(schedule, 'y', last) +
                   _outputs(schedule, 'dx', 0))
    sums = _reduced_metrics(ex, state, loss_fn, labels, specs, batch_dim)
    metrics = {name: (v[0] / tf.maximum(v[1], 1e-30), v[1])
               for name, v in sums.items()}
    scale = 1.0 / tf.maximum(metrics['loss'][1], 1e-30)
    grads = _scaled_grads(ex, state, scale, ties)
    dx_leaves = _input_grads(ex, state, inputs, scale)
    stats = [state.stages[s].stats for s in local]
    if placement.num_replicas > 1:  # BatchNorm sums over every replica.
      stats = placement.peers.all_reduce(
          stats, placement.replica_tasks(), ('stats', placement.device))
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


def _reduced_metrics(ex: Executor, state: Any, loss_fn: LossFn, labels: Any,
                     specs: Specs | None, batch_dim: int
                    ) -> dict[str, tf.Tensor]:
  """{name: [Σ value·weight, Σ weight]} over the batch of every replica.

  With several processes this all-reduce over every task is also the
  step's barrier: it waits for this process's sends, and no process starts
  its next step before all have finished this one.
  """
  last, placement = ex.last, ex.placement
  if ex.is_local(last):
    metrics = ex.stacked(state, 'y', last)[1]
    with tf.device(ex.stages[last].device):
      sums = _metric_sums(metrics)
  else:
    micro = microbatch.one(labels, ex.schedule.num_micro_batches,
                           batch_dim, 0)
    sums = {name: tf.zeros([2]) for name in _metric_names(
        loss_fn, specs(len(ex.stages)), micro)}
  if not placement.multi_process:
    return sums
  return placement.peers.barrier(sums, key=('metrics',), after=state.sends)


def _scaled_grads(ex: Executor, state: Any, scale: tf.Tensor,
                  ties: Sequence['TiedLeaf'] = ()) -> list[tf.Tensor]:
  """Each local stage's accumulated gradients ÷ Σ weight, summed over the
  stage's replicas (one synchronous update for the whole global batch);
  tied weights' copies summed over all copies instead (`_tied_sums`)."""
  placement = ex.placement
  grads = []
  for s in ex.local_stages():
    with tf.device(ex.stages[s].device):
      grads.append([g * tf.cast(scale, g.dtype)
                    for g in tf.nest.flatten(state.stages[s].acc)])
  tied = _tied_sums(grads, ex.local_stages(), ties, placement)
  if placement.num_replicas > 1:
    grads = placement.peers.all_reduce(
        [[None if (i, j) in tied else g for j, g in enumerate(stage)]
         for i, stage in enumerate(grads)],
        placement.replica_tasks(), ('grads', placement.device))
  return [tied.get((i, j), g) for i, stage in enumerate(grads)
          for j, g in enumerate(stage)]


# ---- Tied weights across stage processes ------------------------------------
class TiedLeaf(NamedTuple):
  """A local stage's theta leaf that is one copy of a tied weight."""
  stage: int
  leaf: int  # Its index in tf.nest.flatten(that stage's theta).
  key: str  # The weight's name, alike in every process (its owner's path).
  tasks: tuple[int, ...]  # Every task holding a copy: its stages × replicas.


def _tied_sums(grads: list[list[tf.Tensor]], local: list[int],
               ties: Sequence[TiedLeaf],
               placement: placement_lib.Placement
              ) -> dict[tuple[int, int], tf.Tensor]:
  """The gradient of each tied weight, summed over all of its copies.

  A weight that stages in different processes share (an embedding and the
  softmax tied to it) is one copy per process. The copies must take the
  same update or they drift apart, so each copy's gradient is replaced by
  the sum over every copy (both owning stages, every replica): one
  all-reduce per weight over exactly those tasks. Every member gets the
  same bits, so the copies stay bit-identical. The caller's per-stage
  all-reduce over replicas leaves these leaves out: it would count them
  twice. A weight that two local stages use (interleaved) is summed here
  first; the sum goes to its first leaf, zeros to the others (the tape
  adds them up again).

  Args:
    grads: per local stage (in `local`'s order), its flat gradients.
    local: the local stages.
    ties: the tied leaves among them.
    placement: this process's placement (its peers do the all-reduce).

  Returns:
    {(index into `local`, leaf): the summed gradient}.
  """
  at: dict[str, list[tuple[int, int]]] = {}
  tasks: dict[str, tuple[int, ...]] = {}
  for tie in ties:
    at.setdefault(tie.key, []).append((local.index(tie.stage), tie.leaf))
    tasks[tie.key] = tie.tasks
  out = {}
  for key in sorted(at):  # The same order in every process.
    first = at[key][0]
    with tf.device(placement.peers.device):
      total = tf.add_n([grads[i][j] for i, j in at[key]])
      total = placement.peers.all_reduce(total, tasks[key], ('tied', key))
    out[first] = total
    out.update({p: tf.zeros_like(total) for p in at[key][1:]})
  return out


def _input_grads(ex: Executor, state: Any, inputs: Any,
                 scale: tf.Tensor) -> list[tf.Tensor | None]:
  """Gradients of the float inputs (where stage 0 runs here), ÷ Σ weight."""
  if not ex.is_local(0):
    return [None] * len(tf.nest.flatten(inputs))
  dx = ex.concat(state, 'dx', 0)
  return [g * tf.cast(scale, g.dtype) if differentiable(x)
          else None for g, x in zip(tf.nest.flatten(dx),
                                    tf.nest.flatten(inputs))]
