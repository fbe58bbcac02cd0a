"""Prints the optimal partition of given layer costs and its simulated step.

Use it to pick num_stages and num_micro_batches before a run:

  python tools/partition_report.py --costs=1,2,3,4,5 --num_stages=2 \\
      --num_micro_batches=8

`--costs` are per-layer forward costs of one micro-batch (e.g. flops); the
simulator turns them into times at `--flops_per_second` (default 1, so the
times read in cost units) with backward = 2 × forward and recompute =
forward. The trainer's `--mode=inspect_params` shows the same for a real
model, with costs from FPropMeta.
"""

import sys
from typing import Callable, TypeVar

from absl import app
from absl import flags

from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import schedule
from lingvo_pipe.pipeline import simulator

_COSTS = flags.DEFINE_list(
    'costs', None, 'Per-layer forward cost of one micro-batch, comma-separated '
    '(e.g. flops).', required=True)
_NUM_STAGES = flags.DEFINE_integer('num_stages', 2, 'K: pipeline stages.')
_NUM_MICRO_BATCHES = flags.DEFINE_integer(
    'num_micro_batches', 8, 'M: micro-batches per step; ≥ 4×K keeps the '
    'bubble small.')
_SPLIT_POINTS = flags.DEFINE_list(
    'split_points', None, 'Optional first layer of each stage after the '
    'first (K-1 ints); default: the optimal partition.')
_LAYER_NAMES = flags.DEFINE_list('layer_names', None,
                                 'Optional layer names, one per cost.')
_COST_UNIT = flags.DEFINE_string('cost_unit', 'flops', 'Unit of --costs '
                                 '(flops, seconds, bytes or any name).')
_FLOPS_PER_SECOND = flags.DEFINE_float(
    'flops_per_second', 1.0, 'Device throughput in cost units per second.')
_RECOMPUTE = flags.DEFINE_enum('recompute', 'always',
                               list(schedule.RECOMPUTE_POLICIES),
                               'Recompute policy of the simulated step.')
_SCHEDULE = flags.DEFINE_enum('schedule', 'gpipe', list(schedule.SCHEDULES),
                              'Pipeline schedule of the simulated step.')
_TRANSFER_TIME = flags.DEFINE_float(
    'transfer_time', 0.0, 'Stage-to-stage transfer time per micro-batch, s.')


_T = TypeVar('_T')


def _parse(values: list[str], kind: Callable[[str], _T],
           flag: str) -> list[_T]:
  try:
    return [kind(v) for v in values]
  except ValueError as e:
    raise partitioner.PartitionError(
        f'--{flag}={",".join(values)}: {e}; give comma-separated '
        f'{getattr(kind, "__name__", "value")}s.') from e


def report(costs: list[float], num_stages: int, num_micro_batches: int,
           split_points: list[int] | None = None) -> str:
  """The partition table and the simulator table, as one text."""
  if split_points is None:
    bounds = partitioner.partition(costs, num_stages)
  else:
    bounds = partitioner.check_split_points(split_points, len(costs),
                                            num_stages)
  rep = partitioner.make_report(costs, bounds, _LAYER_NAMES.value,
                                _COST_UNIT.value)
  stages = [simulator.StageCost(forward=s.cost / _FLOPS_PER_SECOND.value)
            for s in rep.stages]
  sim = simulator.simulate(stages, num_micro_batches, _RECOMPUTE.value,
                           _SCHEDULE.value, _TRANSFER_TIME.value)
  return '\n'.join([f'boundaries: {bounds}', rep.to_text(num_micro_batches),
                    '', sim.to_text()])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    costs = _parse(_COSTS.value, float, 'costs')
    points = (None if _SPLIT_POINTS.value is None else
              _parse(_SPLIT_POINTS.value, int, 'split_points'))
    print(report(costs, _NUM_STAGES.value, _NUM_MICRO_BATCHES.value, points))
  except (partitioner.PartitionError, simulator.SimulationError) as e:
    sys.exit(f'partition_report: {e}')


if __name__ == '__main__':
  app.run(main)
