"""Memory preflight: each stage's peak bytes, predicted before the first step.

A pipeline that runs out of memory fails minutes into a run, after tracing
and graph optimisation, with an allocator message that names a tensor, not
the setting to change. The schedule, M and the recompute policy decide most
of a stage's memory, and all of it follows from FPropMeta (bytes per layer
for the whole mini-batch) and the partition, so it can be checked up front
and M can be chosen to fit (`choose_micro_batches`).

The model, per stage k (P = bytes of its parameters):

  parameters     P
  gradients      P            the accumulator summed over micro-batches
  optimizer      slots × P    sgd 1 (momentum), adam 2, rmsprop 2
  activations    the simulator's peak (`simulator.simulate`, run on the
                 schedule's op order): saved stage inputs, plus each
                 layer's outputs while a micro-batch's forward (or its
                 recompute) waits for its backward
  workspace      the backward of one micro-batch: the gradient flowing
                 into and out of a layer (2 × the stage's largest
                 per-micro-batch activation) and, if M > 1, the micro-batch's
                 parameter gradient before it joins the accumulator (P)
  io             with the FProp form (loss outside the pipeline), the whole
                 batch's input on stage 0 (micro-batches are views of it),
                 and the whole batch's output plus its loss gradient on the
                 last stage
  transfers      with stage processes, on each side of a stage where a
                 boundary crosses to another process, the buffers the
                 action lists hold at once (`Schedule.transfer_buffers`):
                 recvs posted ahead of their reader (the transfer pass
                 posts them `actions.RECV_LOOKAHEAD` actions ahead) and a
                 send its receiver has not taken yet

What it leaves out, so treat the budget as an upper bound minus a margin:
tensors a layer keeps for its backward besides its outputs (FPropMeta
counts outputs only: a Transformer layer's attention probabilities and
feed-forward hidden units are not counted, so Transformer stacks are
under-predicted); the scratch memory of one op (e.g. a matmul's workspace,
an optimizer update's temporaries); gradients queued between stages when an
upstream stage's backward runs ahead; constants that Grappler folds into
the graph; and allocator fragmentation and rounding.

How close it comes is measured, not stated here: `python tools/benchmark.py
schedules` prints predicted ÷ measured per stage beside each component
(docs/benchmarks.md, "Schedules"), and `zero_bubble` does the same for the
split schedules. Leave a margin.

>>> from lingvo_pipe.core.base_layer import LayerMeta
>>> metas = [LayerMeta(0, (), param_bytes=4 << 20, out_bytes=8 << 20)] * 4
>>> [round(predict(metas, [0, 2, 4], m, input_bytes=8 << 20).peak / 2**20)
...  for m in (2, 4, 8)]  # MiB, the fuller stage: stage 1.
[72, 64, 60]
>>> choose_micro_batches(metas, [0, 2, 4], batch_size=64,
...                      budget_bytes=64 << 20, input_bytes=8 << 20)
8

M=4 fits too, but M=8=4K keeps the bubble small.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from lingvo_pipe import errors
from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline.partitioner import format_quantity

__all__ = ['COMPONENTS', 'MemoryBudgetError', 'MemoryPrediction',
           'OPTIMIZER_SLOTS',
           'PreflightError', 'StageMemory', 'check_budget',
           'choose_micro_batches', 'predict']

# Slot variables per parameter, as lingvo_pipe.core.optimizer creates them.
OPTIMIZER_SLOTS = {'sgd': 1, 'adam': 2, 'rmsprop': 2}
COMPONENTS = ('parameters', 'gradients', 'optimizer_slots', 'activations',
              'workspace', 'io', 'transfers')


class PreflightError(errors.LingvoPipeError):
  """Arguments the memory model cannot use; the message names the fix."""


class MemoryBudgetError(PreflightError):
  """A configuration whose predicted peak exceeds the memory budget."""


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """Predicted peak bytes of one stage, by component (see module doc)."""
  parameters: float
  gradients: float
  optimizer_slots: float
  activations: float
  workspace: float
  io: float
  transfers: float = 0.0

  @property
  def total(self) -> float:
    return sum(getattr(self, f) for f in COMPONENTS)

  def describe(self) -> str:
    """'1.2 GiB (parameters 100 MiB, gradients …)'."""
    parts = ', '.join(
        f'{f.replace("_", " ")} {format_quantity(getattr(self, f), "bytes")}'
        for f in COMPONENTS)
    return f'{format_quantity(self.total, "bytes")} ({parts})'


@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
  """Per-stage predicted peaks of one configuration."""
  stages: tuple[StageMemory, ...]
  num_micro_batches: int
  schedule: str
  recompute: str
  optimizer: str | None

  @property
  def peak(self) -> float:
    """The fullest stage's total."""
    return max(s.total for s in self.stages)

  @property
  def fullest_stage(self) -> int:
    return max(range(len(self.stages)), key=lambda k: self.stages[k].total)

  def to_text(self) -> str:
    """A table, one row per stage, in human units."""
    header = ['stage', *(f.replace('_', ' ') for f in COMPONENTS), 'total']
    rows = [[str(k)] + [format_quantity(getattr(s, f), 'bytes')
                        for f in COMPONENTS + ('total',)]
            for k, s in enumerate(self.stages)]
    return '\n'.join([
        f'predicted peak memory per stage: schedule={self.schedule}, '
        f'recompute={self.recompute}, M={self.num_micro_batches}, '
        f'optimizer={self.optimizer}',
        partitioner.format_table(header, rows, 'r' * len(header))])


def predict(metas: Sequence[Any], boundaries: Sequence[int],
            num_micro_batches: int, *, input_bytes: float,
            schedule: Any = 'gpipe', recompute: str = 'always',
            optimizer: str | None = 'sgd',
            whole_batch_io: bool = True,
            num_chunks: int = 1,
            stage_processes: bool = False,
            layer_kept_bytes: Sequence[float] | None = None
            ) -> MemoryPrediction:
  """Each stage's (device's) predicted peak bytes for one training step.

  Args:
    metas: one FPropMeta result per layer (`param_bytes`, and `out_bytes`
      for the whole mini-batch), e.g. `gpipe.layer_metas(...)`.
    boundaries: [0, b1, ..., L], stage k = layers [b[k], b[k+1]).
    num_micro_batches: M.
    input_bytes: bytes of the first layer's inputs for the whole mini-batch.
    schedule: a schedule's name (or text), or a `Schedule`.
    recompute: one of `schedule.RECOMPUTE_POLICIES`.
    optimizer: 'sgd', 'adam', 'rmsprop', or None (no slots).
    whole_batch_io: True for the FProp form (see the module doc); False
      when the loss runs inside the pipeline, micro-batch by micro-batch.
    num_chunks: virtual stages per device (schedule='interleaved' by
      name): the boundaries then cut K × num_chunks stages, and the
      prediction is per device (the schedule says which stages it holds).
    stage_processes: whether each device is a process of its own, so
      boundaries travel between processes (the `transfers` component).
    layer_kept_bytes: per layer, the bytes a split backward keeps from I
      to W for the whole mini-batch (`split_backward.layer_bytes` × M);
      counted only by schedules that split (zb_h1, zb_v). None: not
      counted (tracing each layer's split costs seconds; the caller
      decides).

  Raises:
    PreflightError: bad optimizer, boundaries, M, schedule or recompute.
  """
  if optimizer is not None and optimizer not in OPTIMIZER_SLOTS:
    raise PreflightError(f'optimizer={optimizer!r}; use one of '
                         f'{sorted(OPTIMIZER_SLOTS)} or None (no slots).')
  num_layers = len(metas)
  try:
    bounds = partitioner.check_boundaries(boundaries, num_layers)
    # Unit layer times: a stage's peak depends only on its op order.
    costs = simulator.stage_costs_from_layers(
        layer_flops=[1.0] * num_layers,
        layer_out_bytes=[float(m.out_bytes) for m in metas],
        layer_param_bytes=[float(m.param_bytes) for m in metas],
        input_bytes=float(input_bytes), boundaries=bounds,
        num_micro_batches=num_micro_batches, flops_per_second=1.0,
        layer_kept_bytes=layer_kept_bytes)
    if whole_batch_io:  # Stage 0's input is the whole batch, counted in io.
      costs[0] = dataclasses.replace(costs[0], boundary_bytes=0.0)
    ops = schedule if isinstance(schedule, schedule_lib.Schedule) else (
        schedule_lib.make_schedule(schedule, len(costs) // num_chunks,
                                   num_micro_batches, recompute, num_chunks))
    sim = simulator.simulate(stages=costs,
                             num_micro_batches=num_micro_batches,
                             schedule=ops)
  except (partitioner.PartitionError, simulator.SimulationError,
          schedule_lib.ScheduleError) as e:
    raise PreflightError(str(e)) from e
  slots = OPTIMIZER_SLOTS.get(optimizer or '', 0)
  m, out = num_micro_batches, []
  wired = ops.with_transfers() if stage_processes else None
  for d in range(ops.num_devices):
    mine = ops.stages_of(d)
    largest = max(
        max([input_bytes if bounds[s] == 0 else metas[bounds[s] - 1].out_bytes]
            + [x.out_bytes for x in metas[bounds[s]:bounds[s + 1]]])
        for s in mine) / m
    io = 0.0
    if whole_batch_io:
      io += input_bytes if 0 in mine else 0.0
      io += 2.0 * metas[-1].out_bytes if len(costs) - 1 in mine else 0.0
    p = sum(costs[s].param_bytes for s in mine)
    transfers = 0.0
    for s in mine if wired is not None else ():
      # Boundary bytes per micro-batch, each side: the buffers the action
      # lists hold at once (recvs posted ahead of their reader, a send).
      buffers = wired.transfer_buffers(s)
      if s > 0:
        transfers += buffers['input'] * metas[bounds[s] - 1].out_bytes / m
      if s < len(costs) - 1:
        transfers += (buffers['output'] *
                      metas[bounds[s + 1] - 1].out_bytes / m)
    out.append(StageMemory(
        parameters=p, gradients=p, optimizer_slots=slots * p,
        activations=sim.peak_activation_bytes[d],
        workspace=2 * largest + (p if m > 1 else 0.0), io=io,
        transfers=transfers))
  return MemoryPrediction(tuple(out), m, schedule, recompute, optimizer)


def _fixes(schedule: str, recompute: str, can_add_micro_batches: bool) -> str:
  """The settings that lower a stage's peak, for an error message."""
  fixes = []
  if can_add_micro_batches and (recompute != 'never' or schedule != 'gpipe'):
    # GPipe without recompute keeps the whole batch's activations at any M.
    fixes.append("more micro-batches (num_micro_batches, or 'auto')")
  fixes += ['a smaller batch', 'more stages (num_stages)']
  if recompute != 'always':
    fixes.append("recompute='always'")
  if schedule == 'gpipe':
    fixes.append("schedule='1f1b' (activations of ≤ K micro-batches)")
  return ', '.join(fixes)


def _check_budget_value(budget_bytes: float) -> None:
  if not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
    raise PreflightError(f'budget_bytes={budget_bytes!r} must be a number > '
                         '0: the bytes one stage\'s device may use.')


def _over_budget(pred: MemoryPrediction, budget_bytes: float,
                 what: str, fix: str) -> MemoryBudgetError:
  k = pred.fullest_stage
  return MemoryBudgetError(
      f'{what} stage {k} is predicted to need {pred.stages[k].describe()}, '
      'but the budget '
      f'is {format_quantity(budget_bytes, "bytes")} per stage '
      f'(schedule={pred.schedule}, recompute={pred.recompute}, '
      f'M={pred.num_micro_batches}). Fix: {fix}.')


def check_budget(metas: Sequence[Any], boundaries: Sequence[int],
                 num_micro_batches: int, budget_bytes: float,
                 **kwargs: Any) -> MemoryPrediction:
  """`predict`, then fail unless every stage fits in `budget_bytes`.

  Args:
    metas, boundaries, num_micro_batches: as for `predict`.
    budget_bytes: bytes each stage's device may use.
    **kwargs: the keyword arguments of `predict` (input_bytes, schedule,
      recompute, optimizer, whole_batch_io).

  Returns:
    The prediction, when it fits.

  Raises:
    MemoryBudgetError: naming the fullest stage, its predicted bytes by
      component, the budget and the settings that lower it.
  """
  _check_budget_value(budget_bytes)
  pred = predict(metas, boundaries, num_micro_batches, **kwargs)
  if pred.peak > budget_bytes:
    raise _over_budget(pred, budget_bytes, 'Memory preflight:',
                       _fixes(pred.schedule, pred.recompute, True))
  return pred


def choose_micro_batches(metas: Sequence[Any], boundaries: Sequence[int],
                         batch_size: int, budget_bytes: float,
                         **kwargs: Any) -> int:
  """M for num_micro_batches='auto': the largest micro-batch that fits.

  Among the M that divide `batch_size` and fit every stage in the budget,
  the smallest M ≥ 4·K if one fits (GPipe's bubble (K−1)/(M+K−1) is then
  small, and smaller M means larger, faster micro-batches), else the
  smallest M that fits.

  Args:
    metas, boundaries: as for `predict`.
    batch_size: N, examples per mini-batch.
    budget_bytes: bytes each stage's device may use.
    **kwargs: the keyword arguments of `predict`.

  Raises:
    MemoryBudgetError: no M fits; names the stage, its bytes at the M with
      the least memory, the budget and the fixes.
  """
  _check_budget_value(budget_bytes)
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or (
      batch_size < 1):
    raise PreflightError(f'batch_size={batch_size!r} must be an int ≥ 1.')
  num_stages = (len(boundaries) - 1) // kwargs.get('num_chunks', 1)
  # An interleaved schedule (num_chunks > 1) needs M to be a multiple of K.
  step = num_stages if kwargs.get('num_chunks', 1) > 1 else 1
  preds = [predict(metas, boundaries, m, **kwargs)
           for m in range(step, batch_size + 1, step) if batch_size % m == 0]
  if not preds:
    raise PreflightError(
        f"num_micro_batches='auto': the batch of {batch_size} has no M that "
        f'is a multiple of K={num_stages} (interleaved needs one); use a '
        f'batch size that is a multiple of {num_stages}.')
  fits = [p.num_micro_batches for p in preds if p.peak <= budget_bytes]
  if not fits:
    best = min(preds, key=lambda p: p.peak)
    raise _over_budget(
        best, budget_bytes, f"num_micro_batches='auto': no M dividing the "
        f'batch of {batch_size} fits; even at M={best.num_micro_batches} '
        '(the least memory),', _fixes(best.schedule, best.recompute, False))
  preferred = [m for m in fits if m >= 4 * num_stages]
  return min(preferred or fits)
