"""Predicts a pipelined step before running it: time, bubble, memory.

Choosing K (stages), M (micro-batches), the recompute policy and the
schedule trades step time against activation memory, and a wrong choice
costs a run that runs out of memory or idles most devices. This module
replays one step on paper: every stage runs its ops in schedule order
(`schedule.py`), an op starts when its stage is free and its dependencies
are done (+ `transfer_time` when they cross stages), and it lasts the
stage's forward / recompute / backward time.

Memory model, per stage and micro-batch (from the op start/end times):
  with recompute   boundary_bytes from F's start to B's end (the saved
                   stage input), plus activation_bytes from R's start to B's
                   end (the rebuilt intermediates);
  without          boundary_bytes + activation_bytes from F's start to B's
                   end.
The transient working memory inside one op is not counted.

"Single device" means the same ops run back to back on one device (no
bubbles, no transfers), so `speedup_vs_single_device` = K × (1 - bubble)
isolates what pipelining costs in idle time.

>>> r = simulate([StageCost(forward=1.0)] * 2, num_micro_batches=3)
>>> r.step_time, round(r.bubble_fraction, 4)
(16.0, 0.25)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, NamedTuple, Sequence

from lingvo_pipe import errors
from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline.partitioner import format_quantity

__all__ = ['Event', 'SimResult', 'SimulationError', 'StageCost', 'simulate',
           'stage_costs_from_layers']


class SimulationError(errors.LingvoPipeError):
  """Stage costs or step settings the simulator cannot use."""


def _check_amount(name: str, value: float, allow_zero: bool = True) -> None:
  if (not isinstance(value, numbers.Real) or isinstance(value, bool) or
      math.isnan(value) or math.isinf(value) or value < 0 or
      (value == 0 and not allow_zero)):
    limit = '≥ 0' if allow_zero else '> 0'
    raise SimulationError(f'{name} = {value!r} must be a finite number '
                          f'{limit}.')


@dataclasses.dataclass(frozen=True)
class StageCost:
  """What one stage costs per micro-batch.

  Times are in seconds (or any one unit); bytes are per micro-batch except
  `param_bytes`. `backward` defaults to 2 × forward (two matmuls per forward
  one), `recompute` to forward (it re-runs the forward).
  """
  forward: float
  backward: float | None = None
  recompute: float | None = None
  boundary_bytes: float = 0.0  # The stage's input: kept with recompute.
  activation_bytes: float = 0.0  # All intermediates inside the stage.
  param_bytes: float = 0.0

  def __post_init__(self) -> None:
    if self.backward is None:
      object.__setattr__(self, 'backward', 2.0 * self.forward)
    if self.recompute is None:
      object.__setattr__(self, 'recompute', self.forward)
    for field in dataclasses.fields(self):
      _check_amount(f'StageCost.{field.name}', getattr(self, field.name))

  def time(self, kind: str) -> float:
    """Duration of an op of `kind` ('F', 'R' or 'B')."""
    return float({'F': self.forward, 'R': self.recompute,
                  'B': self.backward}[kind])  # type: ignore[arg-type]


class Event(NamedTuple):
  """One op on the timeline (stage: the virtual stage; see `device`)."""
  stage: int
  micro_batch: int
  kind: str  # 'F', 'R' or 'B'.
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
  """The predicted step; see `to_text` for a table."""
  stages: tuple[StageCost, ...]  # Per (virtual) stage.
  num_micro_batches: int
  recompute: str
  schedule: str
  transfer_time: float | Callable[[int, int], float]
  step_time: float
  busy: tuple[float, ...]  # Per device: time spent running ops.
  peak_activation_bytes: tuple[float, ...]  # Per device.
  events: tuple[Event, ...]  # Sorted by start time.
  num_chunks: int = 1  # Most stages on one device (interleaved: v).
  stage_devices: tuple[int, ...] = ()  # Stage → device; () = s mod K.

  @property
  def num_stages(self) -> int:
    """Devices (K)."""
    if self.stage_devices:
      return len(set(self.stage_devices))
    return len(self.stages) // self.num_chunks

  def device_of(self, stage: int) -> int:
    if self.stage_devices:
      return self.stage_devices[stage]
    return stage % self.num_stages

  @property
  def idle(self) -> tuple[float, ...]:
    return tuple(self.step_time - b for b in self.busy)

  @property
  def bubble_fraction(self) -> float:
    """1 - Σ busy / (K × step time): the share of device time spent idle."""
    if self.step_time == 0:
      return 0.0
    return 1.0 - sum(self.busy) / (self.num_stages * self.step_time)

  @property
  def analytic_bubble_fraction(self) -> float:
    """(K-1)/(M+K-1), ÷ v with v chunks per device (interleaved): the
    bubble for equal stages and free transfers."""
    return partitioner.bubble_fraction(
        self.num_stages, self.num_micro_batches) / self.num_chunks

  @property
  def single_device_time(self) -> float:
    """The same ops back to back on one device."""
    return sum(self.busy)

  @property
  def speedup_vs_single_device(self) -> float:
    if self.step_time == 0:
      return float(self.num_stages)
    return self.single_device_time / self.step_time

  def to_text(self, time_unit: str = 'seconds') -> str:
    """A table, one row per stage, then step time, bubble and speed-up."""

    def t(x: float) -> str:
      return format_quantity(x, time_unit)

    header = ['stage', 'forward', 'backward', 'recompute', 'busy', 'idle',
              'busy %', 'peak act. mem', 'params']
    rows = []
    for k in range(self.num_stages):
      mine = [self.stages[s] for s in range(len(self.stages))
              if self.device_of(s) == k]
      has_r = any(e.kind == 'R' for e in self.events
                  if self.device_of(e.stage) == k)
      busy_share = self.busy[k] / self.step_time if self.step_time else 1.0

      def total(kind: str, mine=mine) -> float:
        return math.fsum(s.time(kind) for s in mine)

      rows.append([
          str(k), t(total('F')), t(total('B')),
          t(total('R')) if has_r else '-', t(self.busy[k]), t(self.idle[k]),
          f'{100 * busy_share:.1f}%',
          format_quantity(self.peak_activation_bytes[k], 'bytes'),
          format_quantity(math.fsum(s.param_bytes for s in mine), 'bytes')])
    k, m = self.num_stages, self.num_micro_batches
    hop = ('per link' if callable(self.transfer_time) else
           t(self.transfer_time))
    chunks = f' × {self.num_chunks} chunks' if self.num_chunks > 1 else ''
    return '\n'.join([
        f'schedule={self.schedule}, recompute={self.recompute}, K={k}{chunks}, '
        f'M={m}, '
        f'transfer_time={hop} (forward, backward, recompute: '
        'per micro-batch; busy, idle: per step)',
        partitioner.format_table(header, rows, 'r' + 'r' * 8),
        f'step time: {t(self.step_time)}',
        f'bubble fraction: {100 * self.bubble_fraction:.1f}% simulated, '
        f'{100 * self.analytic_bubble_fraction:.1f}% analytic (K-1)/(M+K-1)'
        + (f' ÷ {self.num_chunks} chunks' if self.num_chunks > 1 else ''),
        f'predicted speed-up vs one device: '
        f'{self.speedup_vs_single_device:.2f}× (ideal {k}×)'])


def simulate(stages: Sequence[StageCost], num_micro_batches: int,
             recompute: str = 'always',
             schedule: str | schedule_lib.Schedule = 'gpipe',
             transfer_time: float | Callable[[int, int], float] = 0.0,
             num_chunks: int = 1,
             link_busy: Callable[[int, int], float] | None = None
             ) -> SimResult:
  """Replays one training step of a K-stage, M-micro-batch pipeline.

  Args:
    stages: one StageCost per (virtual) stage: K × num_chunks of them.
    num_micro_batches: M.
    recompute: one of `schedule.RECOMPUTE_POLICIES` (see `schedule.py`).
    schedule: a schedule's name ('gpipe', '1f1b', 'interleaved'), text
      (`schedule_text.py`), or a `Schedule`, which says where each stage
      runs (round-robin by name).
    transfer_time: per micro-batch stage-to-stage transfer time, or a
      callable (from device, to device) → seconds, e.g.
      `links.Cluster.transfer_time_fn`.
    num_chunks: stages per device (interleaved only, by name).
    link_busy: optional (from device, to device) → seconds a transfer
      holds its link (`links.Cluster.link_busy_fn`): transfers in one
      direction then queue (`actions.run_times`).

  Returns:
    A SimResult.

  Raises:
    SimulationError: bad stages or settings.
  """
  if not stages or not all(isinstance(s, StageCost) for s in stages):
    raise SimulationError(f'stages must be a non-empty list of StageCost, got '
                          f'{stages!r}.')
  if not callable(transfer_time):
    _check_amount('transfer_time', transfer_time)
  try:
    ops = _schedule(schedule, len(stages), num_micro_batches, recompute,
                    num_chunks)
    times = schedule_lib.run_times(
        ops, lambda d, a: stages[a.stage].time(a.kind), transfer_time,
        link_busy)
  except schedule_lib.ScheduleError as e:
    raise SimulationError(str(e)) from e
  compute = ops.compute()
  events = sorted(
      (Event(a.stage, a.micro_batch, a.kind, start, end)
       for d, device_ops in enumerate(compute)
       for a, (start, end) in zip(device_ops, times[d])),
      key=lambda e: (e.start, e.stage))
  step_time = max((e.end for e in events), default=0.0)
  devices = ops.num_devices
  busy = tuple(math.fsum(e.end - e.start for e in events
                         if ops.device_of(e.stage) == d)
               for d in range(devices))
  peaks = tuple(_peak_memory(stages, [e for e in events
                                      if ops.device_of(e.stage) == d])
                for d in range(devices))
  return SimResult(tuple(stages), ops.num_micro_batches, ops.recompute,
                   ops.name, transfer_time if callable(transfer_time) else
                   float(transfer_time), step_time, busy, peaks,
                   tuple(events), ops.num_chunks, ops.stage_devices)


def _schedule(schedule: str | schedule_lib.Schedule, num_stages: int,
              num_micro_batches: int, recompute: str,
              num_chunks: int) -> schedule_lib.Schedule:
  """The Schedule to replay, checked against the stages' count."""
  if isinstance(schedule, schedule_lib.Schedule):
    ops = schedule
  else:
    if (isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or
        num_chunks < 1 or num_stages % num_chunks):
      raise SimulationError(f'num_chunks={num_chunks!r} must be an int ≥ 1 '
                            f'that divides the {num_stages} stages.')
    ops = schedule_lib.make_schedule(schedule, num_stages // num_chunks,
                                     num_micro_batches, recompute, num_chunks)
  if ops.num_stages != num_stages:
    raise SimulationError(
        f'{num_stages} stage costs for a schedule of {ops.num_stages} '
        'stages; give one StageCost per stage.')
  return ops


def _peak_memory(stages: Sequence[StageCost], events: list[Event]) -> float:
  """The most bytes one device holds at once (see the module docstring)."""
  when = {(e.stage, e.kind, e.micro_batch): e for e in events}
  changes = []  # (time, bytes); frees sort before allocations at equal times.
  for (s, kind, m), e in when.items():
    if kind != 'B':
      continue
    cost, start = stages[s], when[(s, 'F', m)].start
    if (s, 'R', m) in when:
      changes += [(start, cost.boundary_bytes), (e.end, -cost.boundary_bytes),
                  (when[(s, 'R', m)].start, cost.activation_bytes),
                  (e.end, -cost.activation_bytes)]
    else:
      held = cost.boundary_bytes + cost.activation_bytes
      changes += [(start, held), (e.end, -held)]
  peak = current = 0.0
  for _, delta in sorted(changes):
    current += delta
    peak = max(peak, current)
  return peak


def stage_costs_from_layers(
    layer_flops: Sequence[float], layer_out_bytes: Sequence[float],
    layer_param_bytes: Sequence[float], input_bytes: float,
    boundaries: Sequence[int], num_micro_batches: int,
    flops_per_second: float, backward_ratio: float = 2.0) -> list[StageCost]:
  """Per-stage costs of one micro-batch from batch-level per-layer numbers.

  Args:
    layer_flops: forward flops of each layer for the whole batch.
    layer_out_bytes: bytes of each layer's output for the whole batch.
    layer_param_bytes: bytes of each layer's parameters.
    input_bytes: bytes of the model's input for the whole batch.
    boundaries: [0, b1, ..., L] as returned by `partitioner.partition`.
    num_micro_batches: M; flops and activation bytes are divided by it.
    flops_per_second: throughput of one device.
    backward_ratio: backward time / forward time.

  Returns:
    One StageCost per stage: forward = flops / M / flops_per_second,
    activation_bytes = Σ out_bytes of its layers / M, boundary_bytes = the
    previous stage's last output (or the input) / M, param_bytes = Σ.

  Raises:
    SimulationError: mismatched lengths or bad numbers.
  """
  num_layers = len(layer_flops)
  if not len(layer_out_bytes) == len(layer_param_bytes) == num_layers:
    raise SimulationError(
        f'layer_flops, layer_out_bytes and layer_param_bytes need one entry '
        f'per layer; got {num_layers}, {len(layer_out_bytes)} and '
        f'{len(layer_param_bytes)}.')
  for name, value in (('input_bytes', input_bytes),
                      ('backward_ratio', backward_ratio)):
    _check_amount(name, value)
  _check_amount('flops_per_second', flops_per_second, allow_zero=False)
  if (isinstance(num_micro_batches, bool) or
      not isinstance(num_micro_batches, int) or num_micro_batches < 1):
    raise SimulationError(f'num_micro_batches must be an int ≥ 1, got '
                          f'{num_micro_batches!r}.')
  try:
    bounds = partitioner.check_boundaries(boundaries, num_layers)
  except partitioner.PartitionError as e:
    raise SimulationError(str(e)) from e
  m, out = num_micro_batches, []
  for k in range(len(bounds) - 1):
    a, b = bounds[k], bounds[k + 1]
    forward = math.fsum(layer_flops[a:b]) / m / flops_per_second
    out.append(StageCost(
        forward=forward, backward=backward_ratio * forward,
        boundary_bytes=(input_bytes if a == 0 else layer_out_bytes[a - 1]) / m,
        activation_bytes=math.fsum(layer_out_bytes[a:b]) / m,
        param_bytes=float(math.fsum(layer_param_bytes[a:b]))))
  return out
