"""What a pipeline will do, from its Params alone: costs, cut, schedule.

Planning needs no devices and no variables, so `--mode=inspect_params`
prints the partition of a paper-sized config (8 stages of AmoebaNet-D(18,
256)) on a laptop. A plan is:

    costs       per layer: p.costs if given ('profile': measured forward +
                backward seconds of each layer, PipeDream's profiling
                pass), else FPropMeta flops if p.input_shapes is set, else
                parameter counts (DeepSpeed's default);
    boundaries  the exact min-max cut into K·v (virtual) stages, or
                p.split_points;
    schedule    `schedule.make_schedule(p.schedule, K, M, p.recompute, v)`,
                with M from `num_micro_batches` — the one place that reads
                p.num_micro_batches and p.micro_batch_size, checks the
                memory preflight (p.memory_budget_bytes) and picks M for
                num_micro_batches='auto' (memory.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import base_layer
from lingvo_pipe.pipeline import memory
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import placement
from lingvo_pipe.pipeline import profile
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import schedule_text
from lingvo_pipe.pipeline import simulator

__all__ = ['Plan', 'PlanError', 'layer_metas', 'make_plan']


class PlanError(errors.LingvoPipeError):
  """Pipeline params that cannot be planned; the message names the fix."""


def _as_tuple(out: Any) -> tuple[Any, ...]:
  return out if isinstance(out, tuple) else (out,)


def check_layers(layer_params: Any, where: str) -> list[Any]:
  """p.layers as a list of layer Params with unique names, or PlanError."""
  if not isinstance(layer_params, (list, tuple)) or not layer_params:
    raise PlanError(f'{where}: p.layers is {layer_params!r}; give a non-empty '
                    'list of layer Params (e.g. [FCLayer.Params().Set(...)]).')
  seen: dict[str, int] = {}
  for i, lp in enumerate(layer_params):
    cls = getattr(lp, 'cls', None)
    if not (isinstance(cls, type) and issubclass(cls, base_layer.BaseLayer)
            and hasattr(lp, 'Instantiate')):
      raise PlanError(
          f'{where}.layers[{i}] is {type(lp).__name__} {lp!r:.60}, not layer '
          'Params; pass e.g. FCLayer.Params().Set(name=...), not a built '
          'layer, a class or a string.')
    name = lp.name or f'layer{i}'
    if not re.fullmatch(r'[A-Za-z_]\w*', name):
      raise PlanError(
          f'{where}.layers[{i}] is named {name!r}; a pipeline layer\'s name '
          'keys its variables and path: use letters, digits and _.')
    if name in seen:
      raise PlanError(
          f'{where}.layers[{seen[name]}] and layers[{i}] are both named '
          f'{name!r}; pipeline layers are keyed by name in checkpoints: give '
          'each a unique p.name.')
    seen[name] = i
  return list(layer_params)


def layer_names(layer_params: list[Any]) -> list[str]:
  """The name each layer is keyed by (its path is `<pipeline>.<name>`)."""
  return [lp.name or f'layer{i}' for i, lp in enumerate(layer_params)]


def layer_metas(layer_params: list[Any], input_shapes: Any,
                where: str = 'pipeline') -> list[base_layer.LayerMeta]:
  """FPropMeta of each layer of a sequence, each fed the previous outputs."""
  shapes = _as_tuple(base_layer.as_shape(tuple(input_shapes)))
  metas = []
  for i, lp in enumerate(layer_params):
    try:
      meta = lp.cls.FPropMeta(lp, *shapes)
    except Exception as e:  # Re-raised with the position in the sequence.
      raise PlanError(
          f'{where}.layers[{i}] ({lp.cls.__name__} {lp.name!r}) rejects its '
          f'input shapes {[str(s) for s in shapes]} (outputs of layer '
          f'{i - 1 if i else "input"}): {e}') from e
    metas.append(meta)
    shapes = meta.out_shapes
  return metas


def _parameter_counts(layer_params: list[Any]) -> list[float]:
  """Parameters of each layer, built one at a time on the CPU and freed."""
  counts = []
  with tf.device('/device:CPU:0'):
    for lp in layer_params:
      layer = lp.Instantiate()
      counts.append(float(sum(v.shape.num_elements()
                              for v in layer.variables)))
      del layer
  return counts


@dataclasses.dataclass(frozen=True)
class Plan:
  """A pipeline's partition and schedule, computed from Params alone."""
  where: str
  names: tuple[str, ...]
  metas: tuple[base_layer.LayerMeta, ...] | None
  costs: tuple[float, ...]
  cost_unit: str
  boundaries: tuple[int, ...]
  num_devices: int
  num_chunks: int
  report: partitioner.PartitionReport
  params: Any
  stage_devices: tuple[int, ...]  # Stage → device (the schedule's map).
  # Per layer, W's share of its backward (costs='profile': measured, for
  # the zero-bubble schedules' I and W); None: the simulator's rule.
  weight_shares: tuple[float, ...] | None = None

  @property
  def num_stages(self) -> int:
    """Virtual stages: devices × chunks."""
    return len(self.boundaries) - 1

  def batch_size(self) -> int | None:
    """The static batch size of p.input_shapes, if known."""
    p = self.params
    if p.input_shapes is None:
      return None
    shape = next((s for s in tf.nest.flatten(base_layer.as_shape(
        tuple(p.input_shapes))) if s is not None), tf.TensorShape(None))
    dims = shape.as_list() if shape.rank is not None else []
    return dims[p.batch_dim] if len(dims) > p.batch_dim else None

  def num_micro_batches(self, batch_size: Any = None) -> int | None:
    """M for `batch_size` (default: input_shapes'), checked; None if unknown.

    The one reader of p.num_micro_batches and p.micro_batch_size; with
    p.memory_budget_bytes it also checks (or, for 'auto', chooses) M
    against the memory preflight.
    """
    p = self.params
    n = batch_size if batch_size is not None else self.batch_size()
    auto = p.num_micro_batches == 'auto'
    if n is None or not isinstance(n, int):
      if p.micro_batch_size is not None or auto:
        return None
      return p.num_micro_batches
    if auto:
      return self._preflight(n, None)
    m = microbatch.num_micro_batches(n, p.num_micro_batches,
                                     p.micro_batch_size, self.where)
    if p.memory_budget_bytes is not None:
      self._preflight(n, m)
    return m

  def _preflight(self, batch_size: int, num_micro_batches: int | None) -> int:
    """Checks M against p.memory_budget_bytes, or chooses it (None)."""
    p = self.params
    if p.memory_budget_bytes is None or p.input_shapes is None:
      raise PlanError(
          f"{self.where}: num_micro_batches='auto' picks M from a memory "
          'budget: set p.memory_budget_bytes and p.input_shapes.')
    metas = self.metas_for(batch_size)
    kwargs = dict(input_bytes=self.input_bytes(batch_size),
                  schedule=p.schedule, recompute=p.recompute,
                  optimizer=p.memory_optimizer,
                  whole_batch_io=p.schedule == 'gpipe',
                  num_chunks=self.num_chunks,
                  stage_processes=placement.peers().num_tasks > 1)
    try:
      if num_micro_batches is None:
        return memory.choose_micro_batches(
            metas, list(self.boundaries), batch_size, p.memory_budget_bytes,
            **kwargs)
      memory.check_budget(metas, list(self.boundaries), num_micro_batches,
                          p.memory_budget_bytes, **kwargs)
    except memory.PreflightError as e:
      raise PlanError(f'{self.where}: {e}') from None
    return num_micro_batches

  def _shapes_for(self, batch_size: int | None) -> Any:
    """p.input_shapes with the batch dimension set to `batch_size`."""
    p = self.params
    shapes = base_layer.as_shape(tuple(p.input_shapes))
    if batch_size is None:
      return shapes

    def _set(s: tf.TensorShape | None) -> tf.TensorShape | None:
      if s is None:  # A None leaf.
        return None
      dims = s.as_list()
      dims[p.batch_dim] = batch_size
      return tf.TensorShape(dims)
    return tf.nest.map_structure(_set, shapes)

  def metas_for(self, batch_size: int) -> list[base_layer.LayerMeta]:
    """FPropMeta of every layer at this batch size."""
    if batch_size == self.batch_size() and self.metas is not None:
      return list(self.metas)
    return layer_metas(list(self.params.layers), self._shapes_for(batch_size),
                       self.where)

  def input_bytes(self, batch_size: int | None = None) -> int:
    """Bytes of the first layer's inputs for one mini-batch."""
    return base_layer.LayerMeta.build(
        self.params, 0, self._shapes_for(batch_size), 0).out_bytes

  def schedule(self, num_micro_batches: int) -> schedule_lib.Schedule:
    p = self.params
    return schedule_lib.make_schedule(p.schedule, self.num_devices,
                                      num_micro_batches, p.recompute,
                                      self.num_chunks)

  def simulate(self, flops_per_second: float = 1e11,
               schedule: str | None = None) -> simulator.SimResult:
    """The predicted step (needs p.input_shapes: FPropMeta bytes, flops).

    Op times come from FPropMeta flops at `flops_per_second`, or, when the
    costs are measured seconds (costs='profile'), from those.
    """
    p = self.params
    m = self.num_micro_batches()
    if self.metas is None or m is None:
      raise PlanError(f'{self.where}: set p.input_shapes (with the batch '
                      'size) to simulate a step.')
    work = [float(x.flops) for x in self.metas]
    if self.cost_unit == 'seconds':  # Forward + backward of a micro-batch.
      work, flops_per_second = [c * m / 3 for c in self.costs], 1.0
    costs = simulator.stage_costs_from_layers(
        work, [x.out_bytes for x in self.metas],
        [x.param_bytes for x in self.metas], self.input_bytes(),
        list(self.boundaries), m, flops_per_second,
        layer_weight_shares=self.weight_shares)
    return simulator.simulate(costs, m, p.recompute, schedule or p.schedule,
                              num_chunks=self.num_chunks)

  def to_text(self) -> str:
    """The partition report and, with input shapes, the simulated step."""
    m = self.num_micro_batches()
    p = self.params
    name = (p.schedule if p.schedule in schedule_lib.SCHEDULES else
            'written (text)')
    lines = [f'schedule={name}, recompute={p.recompute}, '
             f'{self.num_devices} devices × {self.num_chunks} chunk(s)',
             self.report.to_text(num_micro_batches=m,
                                 num_chunks=self.num_chunks)]
    if self.cost_unit == 'parameters':
      lines.append('costs: parameter counts (no input_shapes or costs were '
                   'given; set p.input_shapes for FPropMeta flops)')
    if self.cost_unit == 'seconds':
      lines.append('costs: measured forward + backward seconds per layer '
                   "(p.costs='profile'), one micro-batch each")
    if self.metas is not None and m is not None:
      speed = ('measured layer times' if self.cost_unit == 'seconds' else
               '1e11 flop/s per device')
      lines.append(f'Predicted step ({speed}, backward = 2 × forward):\n' +
                   self.simulate().to_text())
    elif m is None:
      lines.append('M is unknown until the batch size is: set the batch '
                   'dimension of p.input_shapes.')
    if m is not None:
      lines.append(f'The schedule, one row per device (M={m}):\n' +
                   self.schedule(m).to_text())
    return '\n'.join(lines)


def _profiled_costs(p: Any, layers: list[Any], where: str,
                    inputs: Any) -> tuple[list[float], list[float]]:
  """p.costs='profile': each layer's measured seconds (profile.py), and
  the share of its backward that is W (the weight gradients)."""
  if inputs is None:
    if p.input_shapes is None:
      raise PlanError(f"{where}: costs='profile' runs each layer on inputs "
                      'of p.input_shapes (and p.input_dtypes): set them.')
    inputs = profile.synthetic_inputs(p.input_shapes, p.input_dtypes)
  m = p.num_micro_batches if isinstance(p.num_micro_batches, int) else 1
  if p.micro_batch_size is not None:
    n = tf.nest.flatten(inputs)[0].shape[p.batch_dim]
    m = max(1, n // p.micro_batch_size)
  try:
    profiles = profile.profile_layers(layers, tuple(inputs), m,
                                      batch_dim=p.batch_dim)
  except (profile.ProfileError, microbatch.MicroBatchError) as e:
    raise PlanError(f'{where}: {e}') from None
  n = len(profiles)
  both = _agreed(profile.costs_from_profiles(profiles) +
                 [x.weight_share for x in profiles])
  return both[:n], both[n:]


def _agreed(costs: list[float]) -> list[float]:
  """The same costs in every process of a run.

  Each stage process profiles on its own, and timings differ from one
  process to the next; cut from them, the processes could disagree on the
  stages and wait on each other's transfers for ever. The mean over every
  task (one all-reduce, whose result is the same bits everywhere) is what
  each of them partitions.
  """
  peers = placement.peers()
  if peers.num_tasks == 1:
    return costs

  @tf.function(autograph=False)
  def mean(x: tf.Tensor) -> tf.Tensor:
    return peers.all_reduce(x, range(peers.num_tasks), ('profile_costs',),
                            op='mean')

  return [float(c) for c in mean(tf.constant(costs, tf.float64)).numpy()]


def _written_schedule(p: Any, where: str) -> schedule_lib.Schedule | None:
  """p.schedule parsed, if it is a schedule's text or file; None for a
  built-in name; PlanError for anything else."""
  if p.schedule in schedule_lib.SCHEDULES:
    return None
  if not isinstance(p.schedule, str) or not schedule_lib.is_text(p.schedule):
    raise PlanError(
        f'{where}: schedule={p.schedule!r:.80}; use one of '
        f'{schedule_lib.SCHEDULES}, a schedule\'s text (one row per device, '
        'e.g. "device 0: F0 F1 R1 B1 R0 B0") or a file holding one.')
  try:
    m = (p.num_micro_batches if isinstance(p.num_micro_batches, int) and
         p.micro_batch_size is None else None)
    written = schedule_text.load(p.schedule, p.num_stages, m)
  except schedule_lib.ScheduleError as e:
    raise PlanError(f'{where}: {e}') from None
  if p.recompute != 'always':
    raise PlanError(
        f'{where}: recompute={p.recompute!r} with a written schedule: its R '
        'actions say what is recomputed; leave recompute at \'always\'.')
  if written.num_stages % written.num_devices or any(
      len(written.stages_of(d)) != written.num_stages // written.num_devices
      for d in range(written.num_devices)):
    counts = [len(written.stages_of(d)) for d in range(written.num_devices)]
    raise PlanError(f'{where}: the written schedule puts {counts} stages on '
                    'its devices; give every device the same number.')
  return written


def make_plan(p: Any, where: str, profile_inputs: Any = None) -> Plan:
  """The plan of PipeliningLayer Params `p` (no variables; no devices
  unless p.costs='profile', which runs each layer once on one device).

  Args:
    p: PipeliningLayer Params.
    where: the layer path, for messages.
    profile_inputs: with p.costs='profile', a real mini-batch to profile on
      (else inputs of p.input_shapes and p.input_dtypes).
  """
  layers = check_layers(p.layers, where)
  if p.recompute not in schedule_lib.RECOMPUTE_POLICIES:
    raise PlanError(f'{where}: recompute={p.recompute!r}; use one of '
                    f'{schedule_lib.RECOMPUTE_POLICIES}.')
  written = _written_schedule(p, where)
  if p.inline_stage_calls is not None and not isinstance(
      p.inline_stage_calls, bool):
    raise PlanError(f'{where}: inline_stage_calls={p.inline_stage_calls!r}; '
                    'use None (inline on stage processes), True or False.')
  if not isinstance(p.loop_steady_state, bool):
    raise PlanError(f'{where}: loop_steady_state={p.loop_steady_state!r}; '
                    'use True (loop over the steady state) or False (emit '
                    'every op).')
  chunks = schedule_lib.chunks_of(p.schedule, p.virtual_stages_per_device)
  if written is not None:
    chunks = written.num_stages // max(1, written.num_devices)
  if not isinstance(chunks, int) or chunks < 1:
    raise PlanError(f'{where}: virtual_stages_per_device={chunks!r}; use an '
                    'int ≥ 2 with the interleaved schedule.')
  k = p.num_stages
  if not isinstance(k, int) or k < 1 or k * chunks > len(layers):
    what = (f'num_stages={k}' if chunks == 1 else f'num_stages={k} × '
            f'virtual_stages_per_device={chunks} = {k * chunks} stages')
    raise PlanError(
        f'{where}: {what} but there are {len(layers)} layers; use 1 ≤ '
        f'{"num_stages" if chunks == 1 else "their product"} ≤ '
        f'{len(layers)}.')
  metas = (layer_metas(layers, p.input_shapes, where)
           if p.input_shapes is not None else None)
  shares = None
  if p.costs == 'profile':
    costs, shares = _profiled_costs(p, layers, where, profile_inputs)
    unit = 'seconds'
  elif p.costs is not None:
    if isinstance(p.costs, str) or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and
        0 <= c < math.inf for c in p.costs):
      raise PlanError(f'{where}: costs={p.costs!r}; give one finite cost ≥ 0 '
                      'per layer (e.g. [1.0, 2.5]), \'profile\', or None.')
    if len(p.costs) != len(layers):
      raise PlanError(
          f'{where}: p.costs has {len(p.costs)} entries but there are '
          f'{len(layers)} layers; give one cost per layer.')
    costs, unit = [float(c) for c in p.costs], 'cost'
  elif metas is not None:
    costs, unit = [float(x.flops) for x in metas], 'flops'
  elif p.split_points is None and k * chunks > 1:
    costs, unit = _parameter_counts(layers), 'parameters'
  else:
    costs, unit = [1.0] * len(layers), 'layers'
  try:
    if p.split_points is not None:
      bounds = partitioner.check_split_points(list(p.split_points),
                                              len(layers), k * chunks)
    else:
      bounds = partitioner.partition(costs, k * chunks)
  except partitioner.PartitionError as e:
    raise PlanError(f'{where}: {e}') from None
  names = layer_names(layers)
  flops = ([float(x.flops) for x in metas]
           if metas is not None and unit != 'flops' else None)
  report = partitioner.make_report(
      costs, bounds, layer_names=[f'{i}:{n}' for i, n in enumerate(names)],
      cost_unit=unit, second_costs=flops, second_cost_unit='flops')
  where_stages = (written.stage_devices if written is not None else
                  schedule_lib.stage_devices(p.schedule, k, chunks))
  return Plan(where, tuple(names), None if metas is None else tuple(metas),
              tuple(costs), unit, tuple(bounds), k, chunks, report, p,
              tuple(where_stages),
              None if shares is None else tuple(shares))
