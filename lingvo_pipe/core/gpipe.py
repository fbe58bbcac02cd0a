"""PipeliningLayer: GPipe pipeline parallelism as an ordinary layer.

    p = gpipe.PipeliningLayer.Params().Set(
        name='net', layers=[fc0, bn0, fc1, softmax], num_stages=2,
        num_micro_batches=8, input_shapes=[[64, 784]])
    net = p.Instantiate()
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=step):
        logits = net.FProp(net.theta, images)
      loss = ...
    grads = tape.gradient(loss, net.trainable_variables)   # exact

The algorithm (Huang et al., 2019):

    costs   = [FPropMeta(layer).flops for layer in layers]    # or p.costs
    stages  = partition(costs, K)          # exact min-max contiguous cut
    place stage k's variables on devices[k]
    train:  split the batch into M micro-batches; stage k runs forward on
            micro-batch m+1 while stage k+1 runs micro-batch m; keep only
            each stage's input boundary; in backward recompute each stage
            from its boundary, accumulate gradients over micro-batches
            (see engine.py for the graph).
    eval:   the whole batch, stage after stage, no recompute.

Training equals unpipelined training for any K and M up to float rounding,
with one documented exception: BatchNorm normalises each micro-batch by its
own statistics, while its moving averages see the whole batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import base_layer
from lingvo_pipe.pipeline import devices as devices_lib
from lingvo_pipe.core import fprop_context
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import engine
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.core.nested_map import NestedMap


class PipelineError(errors.LingvoPipeError):
  """Bad pipeline params or inputs; the message names the values and fix."""


def _as_tuple(out: Any) -> tuple[Any, ...]:
  return out if isinstance(out, tuple) else (out,)


def layer_metas(layer_params: list[Any], input_shapes: Any,
                where: str = 'pipeline') -> list[base_layer.LayerMeta]:
  """FPropMeta of each layer of a sequence, each fed the previous outputs."""
  shapes = _as_tuple(base_layer.as_shape(tuple(input_shapes)))
  metas = []
  for i, lp in enumerate(layer_params):
    try:
      meta = lp.cls.FPropMeta(lp, *shapes)
    except Exception as e:  # Re-raised with the position in the sequence.
      raise PipelineError(
          f'{where}.layers[{i}] ({lp.cls.__name__} {lp.name!r}) rejects its '
          f'input shapes {[str(s) for s in shapes]} (outputs of layer '
          f'{i - 1 if i else "input"}): {e}') from e
    metas.append(meta)
    shapes = meta.out_shapes
  return metas


class PipeliningLayer(base_layer.BaseLayer):
  """A sequence of layers cut into K stages and run as a GPipe pipeline."""

  @classmethod
  def Params(cls) -> Any:
    p = super().Params()
    p.Define('layers', [], 'The sequence: layer Params; each layer\'s '
             'outputs (a tuple = several positional inputs) feed the next.')
    p.Define('num_stages', 1, 'K: composite stages, stage k on devices[k].')
    p.Define('split_points', None, 'Optional K−1 increasing layer indices '
             'where stages 1..K−1 start; overrides the partitioner.')
    p.Define('costs', None, 'Optional per-layer costs for the partitioner '
             '(e.g. measured seconds); None uses FPropMeta flops.')
    p.Define('input_shapes', None, 'Shapes of the first layer\'s positional '
             'inputs for one mini-batch, e.g. [[64, 28, 28, 1]]; FPropMeta '
             'costs and shape checks need them.')
    p.Define('num_micro_batches', 1, 'M: micro-batches per mini-batch; '
             'M ≥ 4·K keeps the bubble (K−1)/(M+K−1) small.')
    p.Define('micro_batch_size', None, 'Alternative to num_micro_batches: '
             'examples per micro-batch (M = N / micro_batch_size).')
    p.Define('recompute', 'always', 'always: keep only stage inputs and '
             'recompute in backward (GPipe); except_last: the last stage '
             'keeps its activations; never: keep everything.')
    p.Define('devices', None, 'Device of each stage, e.g. ["/GPU:0", '
             '"/GPU:1"] or "/job:worker/task:1/device:CPU:0"; None = local '
             'accelerators, else logical CPU devices.')
    p.Define('batch_dim', 0, 'Batch dimension of every tensor that crosses '
             'a stage boundary.')
    return p

  def __init__(self, params: Any) -> None:
    super().__init__(params)
    p = self.params
    num_layers = len(p.layers)
    if not num_layers:
      raise PipelineError(f'{self.path}: p.layers is empty; give the '
                          'sequence of layer Params to pipeline.')
    if p.recompute not in engine.RECOMPUTE_POLICIES:
      raise PipelineError(f'{self.path}: recompute={p.recompute!r}; use one '
                          f'of {engine.RECOMPUTE_POLICIES}.')
    self._metas = (layer_metas(list(p.layers), p.input_shapes, self.path)
                   if p.input_shapes is not None else None)
    self._costs = self._Costs()
    self._boundaries = self._Partition()
    self._devices = self._Devices()
    self._CreateStages()
    self._report = partitioner.make_report(
        self._costs or [1.0] * num_layers, self._boundaries,
        layer_names=[f'{i}:{lp.name or lp.cls.__name__}'
                     for i, lp in enumerate(p.layers)],
        cost_unit='flops' if self._costs and p.costs is None else 'cost')

  # ---- Construction --------------------------------------------------------
  def _Costs(self) -> list[float] | None:
    p = self.params
    if p.costs is not None:
      if len(p.costs) != len(p.layers):
        raise PipelineError(
            f'{self.path}: p.costs has {len(p.costs)} entries but there are '
            f'{len(p.layers)} layers; give one cost per layer.')
      return [float(c) for c in p.costs]
    if self._metas is not None:
      return [float(m.flops) for m in self._metas]
    return None

  def _Partition(self) -> list[int]:
    p = self.params
    num_layers, k = len(p.layers), p.num_stages
    if k < 1 or k > num_layers:
      raise PipelineError(
          f'{self.path}: num_stages={k} but there are {num_layers} layers; '
          f'use 1 ≤ num_stages ≤ {num_layers}.')
    if p.split_points is not None:
      return partitioner.check_split_points(list(p.split_points), num_layers,
                                            k)
    if k == 1:
      return [0, num_layers]
    if self._costs is None:
      raise PipelineError(
          f'{self.path}: cannot balance {k} stages without costs. Set '
          'p.input_shapes (FPropMeta flops), p.costs, or p.split_points.')
    return partitioner.partition(self._costs, k)

  def _Devices(self) -> list[str]:
    p, k = self.params, self.params.num_stages
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
    p = self.params
    stage_of = np.searchsorted(self._boundaries, np.arange(len(p.layers)),
                               side='right') - 1
    self.CreateChildren('layers', list(p.layers),
                        devices=[self._devices[s] for s in stage_of])

  # ---- Facts ---------------------------------------------------------------
  @property
  def boundaries(self) -> list[int]:
    """[0, b1, …, L]: stage k holds layers [b[k], b[k+1])."""
    return list(self._boundaries)

  @property
  def devices(self) -> list[str]:
    return list(self._devices)

  @property
  def metas(self) -> list[base_layer.LayerMeta] | None:
    return self._metas

  @property
  def report(self) -> partitioner.PartitionReport:
    return self._report

  def Inspect(self) -> str:
    """The partition report and the simulated schedule of one step."""
    text = self._report.to_text(
        num_micro_batches=self.params.num_micro_batches)
    if self._metas is not None:
      text += ('\nPredicted step (1e11 flop/s per device, backward = 2 × '
               'forward):\n' + self.Simulate().to_text())
    return text

  # ---- Computing -------------------------------------------------------------
  def _StageFProp(self, k: int, thetas: list[NestedMap],
                  inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    first, last = self._boundaries[k], self._boundaries[k + 1]
    x = inputs
    for i, theta in zip(range(first, last), thetas):
      x = _as_tuple(self.children.layers[i].FProp(theta, *x))
      self._CheckShapes(i, x)
    return x

  def _CheckShapes(self, i: int, outputs: tuple[Any, ...]) -> None:
    """Real output shapes must match FPropMeta's (batch dim excepted)."""
    if self._metas is None:
      return
    want = tf.nest.flatten(self._metas[i].out_shapes)
    got = [t.shape for t in tf.nest.flatten(outputs)]
    bd = self.params.batch_dim

    def _strip(s: tf.TensorShape) -> list[Any]:
      dims = s.as_list() if s.rank is not None else []
      return dims[:bd] + dims[bd + 1:]

    if len(want) != len(got) or any(
        not tf.TensorShape(_strip(w)).is_compatible_with(_strip(g))
        for w, g in zip(want, got)):
      name = self.params.layers[i].cls.__name__
      raise PipelineError(
          f'{self.path}.layers[{i}] ({name}): outputs have shapes '
          f'{[str(g) for g in got]} but its FPropMeta predicts '
          f'{[str(w) for w in want]}; fix {name}.FPropMeta or '
          'p.input_shapes.')

  def _Stages(self, theta: NestedMap) -> list[engine.Stage]:
    stages = []
    for k in range(self.params.num_stages):
      first, last = self._boundaries[k], self._boundaries[k + 1]
      stages.append(engine.Stage(
          fprop=lambda th, x, k=k: self._StageFProp(k, th, x),
          theta=list(theta.layers[first:last]), device=self._devices[k]))
    return stages

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    p = self.params
    stages = self._Stages(theta)
    if not fprop_context.current().training:
      x = tuple(inputs)
      for stage in stages:  # Inference: whole batch, no micro-batches.
        with tf.device(stage.device):
          x = stage.fprop(stage.theta, x)
      return x[0] if len(x) == 1 else x
    n = microbatch.batch_size(inputs, p.batch_dim, self.path)
    m = microbatch.num_micro_batches(n, p.num_micro_batches,
                                     p.micro_batch_size, self.path)
    out = engine.run(stages, tuple(inputs), m, p.recompute, p.batch_dim)
    return out[0] if len(out) == 1 else out

  @classmethod
  def FPropMeta(cls, p: Any, *input_shapes: Any) -> base_layer.LayerMeta:
    metas = layer_metas(list(p.layers), input_shapes, p.name or 'pipeline')
    total = metas[0]
    for meta in metas[1:]:
      total = total + meta
    return total

  def Simulate(self, flops_per_second: float = 1e11,
               schedule: str = 'gpipe') -> simulator.SimResult:
    """Predicted step of this partition (needs p.input_shapes)."""
    p = self.params
    if self._metas is None:
      raise PipelineError(f'{self.path}: set p.input_shapes to simulate.')
    input_bytes = base_layer.LayerMeta.build(
        p, 0, base_layer.as_shape(tuple(p.input_shapes)), 0).out_bytes
    costs = simulator.stage_costs_from_layers(
        [m.flops for m in self._metas], [m.out_bytes for m in self._metas],
        [m.param_bytes for m in self._metas], input_bytes, self._boundaries,
        p.num_micro_batches, flops_per_second)
    return simulator.simulate(costs, p.num_micro_batches, p.recompute,
                              schedule)
