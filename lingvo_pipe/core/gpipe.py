"""PipeliningLayer: GPipe pipeline parallelism as an ordinary layer.

    p = gpipe.PipeliningLayer.Params().Set(
        name='net', layers=[fc0, bn0, fc1, softmax], num_stages=2,
        num_micro_batches=8, input_shapes=[[64, 784]])
    net = p.Instantiate()
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=step):
        logits = net.FProp(net.theta, images)            # GPipe
      loss = ...
    grads = tape.gradient(loss, net.trainable_variables)   # exact

    # Any schedule ('gpipe', '1f1b', 'interleaved'): the last stage also
    # computes each micro-batch's loss.
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=step):
        metrics = net.FPropLoss(net.theta, (images,), labels, loss_fn)
    grads = tape.gradient(metrics['loss'][0], net.trainable_variables)

The algorithm (Huang et al., 2019; Narayanan et al., 2019):

    plan    = costs per layer (FPropMeta flops, p.costs, or parameters),
              the exact min-max cut into K·v stages (plan.py)
    place   stage s's variables on the device the schedule maps it to
            (s mod K, or zb_v's V: device d holds stages d and 2K−1−d)
    train:  split the batch into M micro-batches and run the schedule's
            ops — F, R, B (or I and W) of each stage and micro-batch, on
            its device, in the schedule's order (engine.py); keep only each
            stage's input boundary, recompute in backward, accumulate
            gradients over micro-batches; one synchronous update follows.
    eval:   the whole batch, stage after stage, no recompute.

Training equals unpipelined training for any K, M and schedule up to float
rounding, with one documented exception: BatchNorm normalises each
micro-batch by its own statistics, while its moving averages see the whole
batch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import tied_weights
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import devices as devices_lib
from lingvo_pipe.pipeline import engine
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import placement as placement_lib
from lingvo_pipe.pipeline import plan as plan_lib
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import simulator

PipelineError = plan_lib.PlanError  # Bad pipeline params or inputs.
layer_metas = plan_lib.layer_metas


def _as_tuple(out: Any) -> tuple[Any, ...]:
  return out if isinstance(out, tuple) else (out,)


class _RemoteLayer(base_layer.BaseLayer):
  """Stands in for a layer that another stage process holds and runs."""

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    raise PipelineError(f'{self.path} runs in another stage process.')


class PipeliningLayer(base_layer.BaseLayer):
  """A sequence of layers cut into K stages and run as a pipeline."""

  @classmethod
  def Params(cls) -> Any:
    p = super().Params()
    p.Define('layers', [], 'The sequence: layer Params with unique names '
             '(variables are keyed by them); each layer\'s outputs (a tuple '
             '= several positional inputs) feed the next.')
    p.Define('num_stages', 1, 'K: devices; the schedule says which stages '
             'each runs (the built-in ones: stage s on devices[s mod K]; zb_v: '
             'device d holds stages d and 2K−1−d).')
    p.Define('split_points', None, 'Optional K·v−1 increasing layer indices '
             'where stages 1.. start; overrides the partitioner.',
             value_type=list)
    p.Define('costs', None, 'Per-layer costs for the partitioner: a list '
             '(e.g. measured seconds), \'profile\' (measure each layer\'s '
             'forward + backward now, PipeDream-style), or None: FPropMeta '
             'flops with input_shapes, else parameter counts.',
             value_type=(list, str))
    p.Define('input_shapes', None, 'Shapes of the first layer\'s positional '
             'inputs for one mini-batch, e.g. [[64, 28, 28, 1]]; FPropMeta '
             'costs, shape checks and the simulator need them.',
             value_type=list)
    p.Define('input_dtypes', None, 'Dtypes of those inputs (e.g. '
             '[\'int32\'] for token ids), for costs=\'profile\'; None = '
             'float32.', value_type=list)
    p.Define('num_micro_batches', 1, 'M: micro-batches per mini-batch; '
             'M ≥ 4·K keeps the bubble (K−1)/(M+K−1) small. \'auto\': the '
             'largest micro-batch that fits memory_budget_bytes (M ≥ 4·K '
             'when possible).')
    p.Define('micro_batch_size', None, 'Alternative to num_micro_batches: '
             'examples per micro-batch (M = N / micro_batch_size).',
             value_type=int)
    p.Define('recompute', 'always', 'always: keep only stage inputs and '
             'recompute in backward (GPipe); needed: always, but a micro-'
             'batch whose backward directly follows its forward on the '
             'device keeps its activations (same peak, less time); '
             'except_last: the last stage keeps its activations; never: '
             'keep everything.')
    p.Define('schedule', 'gpipe', 'gpipe: all forwards, then all backwards '
             '(M micro-batches of activations per stage); 1f1b: PipeDream-'
             'flush, at most K−k in flight on stage k; interleaved: 1f1b over '
             'v chunks per device, bubble ÷ v; zb_h1: 1f1b with each backward '
             'split into I (input gradient) and W (weight gradients), W '
             'filling the bubble (÷ 3); zb_v: 2K stages in a V, device d '
             'holding stages d and 2K−1−d, bubble ÷ 6 at 1f1b\'s memory '
             '(docs/guide_k_m.md). Or a schedule written as text '
             '(one row per device, e.g. "device 0: F0 F1 R1 B1 R0 B0"; '
             'docs/design.md) or a file holding one. All but gpipe need the '
             'loss in the pipeline (FPropLoss).')
    p.Define('virtual_stages_per_device', 2, 'v, with schedule='
             '\'interleaved\': each device holds v non-adjacent stages.')
    p.Define('memory_budget_bytes', None, 'Bytes one device may use: the '
             'memory preflight (FPropMeta bytes, the schedule, optimizer '
             'slots) refuses a config over it before the first step; needed '
             'by num_micro_batches=\'auto\'.', value_type=(int, float))
    p.Define('memory_optimizer', None, 'The optimizer whose slots the '
             'preflight counts (sgd, adam, rmsprop; None: no slots); '
             'PipelinedTask sets it from task.train.optimizer.', value_type=str)
    p.Define('devices', None, 'Device of each stage, e.g. ["/GPU:0", '
             '"/GPU:1"] or "/job:worker/task:1/device:CPU:0"; None = local '
             'accelerators, else logical CPU devices.', value_type=list)
    p.Define('inline_stage_calls', None, 'Let TensorFlow inline each call '
             'of a stage body: one optimised copy of the stage per micro-'
             'batch, so faster steps (K=2 stage processes: 3–14%) but a '
             'slower first step at large M. None: only in a multi-process '
             'run (stage processes, replicas), where each process runs one '
             'stage.', value_type=bool)
    p.Define('loop_steady_state', True, 'Trace the periodic middle of the '
             'schedule (its steady state) as a tf.while_loop over micro-'
             'batches, so that tracing time and graph size do not grow with '
             'M (in one process, on stage processes, recorded or not). '
             'Stages that keep their activations (no recompute) loop only '
             'where their tapes stay in one iteration. False: emit every '
             'action.')
    p.Define('batch_dim', 0, 'Batch dimension of every tensor that crosses '
             'a stage boundary (1 for time-major [T, B, ...]).')
    p.Define('tied_weights', [], 'Weights that layers share, each '
             'tied_weights.tie(weight, owner, transpose): one variable in '
             'checkpoints, gradients summed over both uses (and, on stage '
             'processes, over the copies each owning stage holds).')
    return p

  def __init__(self, params: Any) -> None:
    super().__init__(params)
    self._plan = plan_lib.make_plan(self.params, self.path)
    self._tied = tied_weights.TiedWeights(tied_weights.resolve(
        list(self.params.tied_weights), self._plan.names, self.path),
                                          self.path)
    self._placement = placement_lib.Placement.current(self.params.num_stages,
                                                      self.path)
    self._devices = self._Devices()
    self._CreateStages()
    self._schedules: dict[int, schedule_lib.Schedule] = {}
    # FPropMeta by input shapes (length buckets); not checkpointed.
    object.__setattr__(self, '_metas', {})

  # ---- Construction --------------------------------------------------------
  def _Devices(self) -> list[str]:
    p, k = self.params, self.params.num_stages
    if self._placement.multi_process:  # Device d runs in its own process.
      peers = self._placement.peers
      return [peers.task_device(self._placement.task(d)) for d in range(k)]
    if p.devices is None:
      for kind in ('GPU', 'TPU'):
        if len(tf.config.list_logical_devices(kind)) >= k:
          return devices_lib.default_devices(k)
      try:
        devices_lib.configure_logical_cpus(k)
      except devices_lib.DeviceError:
        pass  # Runtime already started; default_devices explains or shares.
      return devices_lib.default_devices(k)
    if len(p.devices) < k:
      raise PipelineError(
          f'{self.path}: {k} stages but only {len(p.devices)} devices '
          f'{list(p.devices)}; give one device per stage.')
    devices_lib.check_devices(list(p.devices[:k]), self.path)
    return list(p.devices[:k])

  def _CreateStages(self) -> None:
    """Builds every layer on its stage's device; with stage processes,
    only this process's layers (the others stand in, with no variables;
    a tied weight whose owner is elsewhere is a copy, `tied_weights`)."""
    stages = [self._StageOf(i) for i in range(len(self.params.layers))]
    layers = [lp if self.is_local(s) else
              _RemoteLayer.Params().Set(name=name)
              for lp, s, name in zip(self.params.layers, stages,
                                     self._plan.names)]
    with base_layer.sharing_variables(
        self._tied.creator(self._Probe) if self._tied.ties else None):
      built = self.CreateChildren(
          'layers', layers, devices=[self.stage_device(s) for s in stages],
          keys=list(self._plan.names))
    self._tied.check_built(lambda i: self.is_local(stages[i]), built)

  def _StageOf(self, i: int) -> int:
    return int(np.searchsorted(self._plan.boundaries, i, side='right')) - 1

  def _Probe(self, i: int) -> base_layer.BaseLayer:
    """Layer i built on its own (untracked): what its variables would be."""
    name = self._plan.names[i]
    with self._Building(name):
      return self._ChildParams(name, self.params.layers[i]).Instantiate()

  # ---- Facts ---------------------------------------------------------------
  @property
  def plan(self) -> plan_lib.Plan:
    return self._plan

  @property
  def boundaries(self) -> list[int]:
    """[0, b1, …, L]: stage s holds layers [b[s], b[s+1])."""
    return list(self._plan.boundaries)

  @property
  def devices(self) -> list[str]:
    return list(self._devices)

  def stage_device(self, stage: int) -> str:
    return self._devices[self._plan.stage_devices[stage]]

  def is_local(self, stage: int) -> bool:
    """Whether this process runs `stage` (always, in one process)."""
    return self._placement.is_local(self._plan.stage_devices[stage])

  @property
  def placement(self) -> placement_lib.Placement:
    return self._placement

  @property
  def tied(self) -> tied_weights.TiedWeights:
    """p.tied_weights in this process: its variables and copies."""
    return self._tied

  def LayerThetas(self, theta: NestedMap) -> list[NestedMap]:
    """Each layer's theta as it reads it (tied weights transposed where
    they are): for code that calls layers outside the pipeline (decoding)."""
    return [self._tied.view(i, th) for i, th in enumerate(theta.layers)]

  @property
  def metas(self) -> list[base_layer.LayerMeta] | None:
    return None if self._plan.metas is None else list(self._plan.metas)

  @property
  def report(self) -> Any:
    return self._plan.report

  def Inspect(self) -> str:
    """The partition report and the simulated schedule of one step."""
    return self._plan.to_text()

  def Simulate(self, flops_per_second: float = 1e11,
               schedule: str | None = None) -> simulator.SimResult:
    """Predicted step of this partition (needs p.input_shapes)."""
    return self._plan.simulate(flops_per_second, schedule)

  def Summaries(self) -> dict[str, float]:
    """Partition imbalance and bubble, for the trainer's TensorBoard."""
    m = self._plan.num_micro_batches() or 1
    return {'pipeline/partition_imbalance': self.report.imbalance,
            'pipeline/bubble_fraction':
                self.report.bubble_fraction(m, self._plan.num_chunks)}

  # ---- Computing -------------------------------------------------------------
  def _StageFProp(self, s: int, thetas: list[NestedMap],
                  inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    first, last = self._plan.boundaries[s], self._plan.boundaries[s + 1]
    x = inputs
    for i, theta in zip(range(first, last), thetas):
      theta = self._tied.view(i, theta)
      x = _as_tuple(self.children.layers[i].FProp(theta, *x))
      self._CheckOutputs(i, x)
    return x

  def _CheckOutputs(self, i: int, outputs: tuple[Any, ...]) -> None:
    """Outputs are tensors (or None) of FPropMeta's shapes (batch aside)."""
    name = self.params.layers[i].cls.__name__
    for leaf in tf.nest.flatten(outputs):
      if leaf is not None and not tf.is_tensor(leaf):
        raise PipelineError(
            f'{self.path}.layers[{i}] ({name}) returned {type(leaf).__name__} '
            f'{leaf!r:.40}; a pipelined layer returns tensors (or None, or '
            'nests of them): convert it, or compute it outside the pipeline.')
    if self._plan.metas is None:
      return
    want = [w for w in tf.nest.flatten(self._plan.metas[i].out_shapes)
            if w is not None]
    got = [t.shape for t in tf.nest.flatten(outputs) if t is not None]
    bd = self.params.batch_dim

    def _strip(s: tf.TensorShape) -> list[Any]:
      dims = s.as_list() if s.rank is not None else []
      return dims[:bd] + dims[bd + 1:]

    if len(want) != len(got) or any(
        not tf.TensorShape(_strip(w)).is_compatible_with(_strip(g))
        for w, g in zip(want, got)):
      raise PipelineError(
          f'{self.path}.layers[{i}] ({name}): outputs have shapes '
          f'{[str(g) for g in got]} but its FPropMeta predicts '
          f'{[str(w) for w in want]}; fix {name}.FPropMeta or '
          'p.input_shapes.')

  def _Stages(self, theta: NestedMap) -> list[engine.Stage]:
    stages = []
    bounds = self._plan.boundaries
    inline = self.params.inline_stage_calls
    if inline is None:
      inline = self._placement.multi_process
    for s in range(self._plan.num_stages):
      stages.append(engine.Stage(
          fprop=lambda th, x, s=s: self._StageFProp(s, th, x),
          theta=list(theta.layers[bounds[s]:bounds[s + 1]]),
          device=self.stage_device(s), inline=inline))
    return stages

  def _Schedule(self, inputs: tuple[Any, ...]) -> schedule_lib.Schedule:
    p = self.params
    n = microbatch.batch_size(inputs, p.batch_dim, self.path)
    m = self._ReplicaMicroBatches(n)
    if m not in self._schedules:
      try:
        self._schedules[m] = self._plan.schedule(m)
      except schedule_lib.ScheduleError as e:
        raise PipelineError(f'{self.path}: {e}') from None
    return self._schedules[m]

  def _ReplicaMicroBatches(self, n: Any) -> int | None:
    """M of this replica's batch of `n` examples.

    num_micro_batches (or micro_batch_size) describes the global batch, so
    the micro-batches, and with them BatchNorm's statistics, are the same
    for any number of replicas R: each replica runs M ÷ R of them.
    """
    r = self._placement.num_replicas
    if r == 1 or not isinstance(n, int):
      return self._plan.num_micro_batches(n)
    m = self._plan.num_micro_batches(n * r)
    if m % r:
      raise PipelineError(
          f'{self.path}: num_micro_batches={m} (of the global batch of '
          f'{n * r}) does not split over {r} replicas; use a multiple of '
          f'{r}, so that each replica runs the same micro-batches as one '
          'process would.')
    return m // r

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    """Pipelined forward (training) or stage after stage (inference).

    Differentiable under an outer tape with schedule='gpipe'; the other
    schedules interleave backwards with forwards and need `FPropLoss`.
    """
    stages = self._Stages(theta)
    if self._placement.multi_process:
      raise PipelineError(
          f'{self.path}: FProp runs every stage in this process; with stage '
          'processes train with FPropLoss (PipelinedTask does) and evaluate '
          'in one process (the evaler).')
    if not fprop_context.current().training:
      x = tuple(inputs)
      for stage in stages:  # Inference: whole batch, no micro-batches.
        with tf.device(stage.device):
          x = stage.fprop(stage.theta, x)
      return x[0] if len(x) == 1 else x
    try:
      out = engine.run(stages, tuple(inputs), self._Schedule(inputs),
                       self.params.batch_dim, self.params.loop_steady_state)
    except engine.EngineError as e:
      raise PipelineError(f'{self.path}: {e}') from None
    return out[0] if len(out) == 1 else out

  def FPropLoss(self, theta: NestedMap, inputs: tuple[Any, ...], labels: Any,
                loss_fn: Callable[[Any, Any], dict[str, Any]]
               ) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
    """The step with the loss in the last stage: any schedule.

    Args:
      theta: this layer's theta.
      inputs: the first layer's positional inputs (a tuple).
      labels: a nest with the batch on p.batch_dim, given to `loss_fn`.
      loss_fn: (last layer's outputs, labels) of one micro-batch →
        {'loss': (value, weight), ...}: weighted means, as tasks'
        ComputeLoss returns them.

    Returns:
      {name: (weighted mean over the batch, Σ weight)}; the loss value is
      differentiable under an outer tape. Outside training: `loss_fn` of
      the whole batch's outputs.
    """
    if not fprop_context.current().training:
      return loss_fn(self.FProp(theta, *inputs), labels)
    stages = self._Stages(theta)
    schedule = self._Schedule(inputs)
    if self._placement.multi_process:
      self._CheckStatic(inputs)
    try:
      return engine.run_with_loss(
          stages, tuple(inputs), labels, loss_fn, schedule,
          self.params.batch_dim, self._placement,
          lambda s: self._BoundarySpec(s, inputs, schedule.num_micro_batches),
          self.params.loop_steady_state, self._TiedLeaves())
    except engine.EngineError as e:
      raise PipelineError(f'{self.path}: {e}') from None

  def _CheckStatic(self, inputs: tuple[Any, ...]) -> None:
    """Stage processes receive tensors of the shape this step's inputs
    imply (FPropMeta): every task must know it from the step alone."""
    for i, leaf in enumerate(tf.nest.flatten(inputs)):
      if not tf.TensorShape(leaf.shape).is_fully_defined():
        raise PipelineError(
            f'{self.path}: input {i} of this step has shape {leaf.shape}; '
            'stage processes exchange tensors whose shape every task knows '
            'from the step: make every batch one fixed shape (pad to a '
            'fixed length), or a few (length buckets, each of one shape).')

  def _TiedLeaves(self) -> list[engine.TiedLeaf]:
    """The tied weights among this process's stage thetas, each with the
    tasks holding a copy (its owning stages' devices × replicas)."""
    place, bounds = self._placement, self._plan.boundaries
    if not place.multi_process or not self._tied.ties:
      return []
    k, out = len(self._devices), []
    for s in range(self._plan.num_stages):
      if not self.is_local(s):
        continue
      thetas = [self.children.layers[i].theta
                for i in range(bounds[s], bounds[s + 1])]
      for leaf, owner in self._tied.leaves(bounds[s], thetas):
        devices = sorted({self._StageOf(i) % k
                          for i in self._tied.owning_layers(owner)})
        if len(devices) > 1:
          out.append(engine.TiedLeaf(s, leaf, owner, tuple(
              r * k + d for r in range(place.num_replicas) for d in devices)))
    return out

  def _BoundarySpec(self, stage: int, inputs: tuple[Any, ...],
                    num_micro_batches: int) -> Any:
    """Per-micro-batch TensorSpecs of stage `stage`'s input (the outputs
    of its previous layer; `stage` = #stages: the last layer's outputs),
    from FPropMeta of this step's inputs: what a stage process receives
    before any tensor. Each task reads the same global batch, so all
    agree on the shapes, one per length bucket."""
    shapes = tuple(tf.nest.map_structure(lambda x: x.shape, inputs))
    key = tuple(tuple(s.as_list()) for s in tf.nest.flatten(shapes))
    if key not in self._metas:
      self._metas[key] = plan_lib.layer_metas(list(self.params.layers),
                                              shapes, self.path)
    meta = self._metas[key][self._plan.boundaries[stage] - 1]
    bd = self.params.batch_dim
    micro = microbatch.batch_size(inputs, bd, self.path) // num_micro_batches
    leaves = []
    for shape, dtype in zip(tf.nest.flatten(meta.out_shapes),
                            meta.out_dtypes):
      if shape is None:  # A None leaf: nothing crosses.
        leaves.append(None)
        continue
      dims = shape.as_list()
      dims[bd] = micro
      leaves.append(tf.TensorSpec(dims, dtype))
    return tf.nest.pack_sequence_as(meta.out_shapes, leaves)

  @classmethod
  def FPropMeta(cls, p: Any, *input_shapes: Any) -> base_layer.LayerMeta:
    metas = layer_metas(list(p.layers), input_shapes, p.name or 'pipeline')
    total = metas[0]
    for meta in metas[1:]:
      total = total + meta
    return total
