"""Partitions by FPropMeta flops vs by a profile, judged by measured stages.

FPropMeta counts GELU, LayerNorm and dropout at about one flop per element,
yet on a CPU they are memory- and RNG-bound and cost far more time per flop
than a wide matmul, while narrow matmuls run below peak. On a stack that
mixes FC widths 128…2048 with such cheap layers, a partition balanced by
flops leaves some stages slower than others. PipeDream's answer is to time
each layer and partition by the times (`lingvo_pipe.pipeline.profile`).

For K = 2 and 4, both partitions are cut by the exact partitioner; then
each stage's real time per micro-batch is measured (its layers alone, as one
stack, forward + backward on the stage's real input), and max/mean stage
time is reported. TF runs single-threaded (intra- and inter-op), as the
benchmark's stage workers do. On a machine shared with other work, timings
are by this process's CPU time (`--clock=cpu`, the default here): others'
load stretches wall time, not our CPU time; `--clock=wall` for a quiet
machine. The two partitions are measured in alternation, `rounds` times,
so noise hits both alike; max/mean is taken of each stage's median over
rounds, with the per-round min–max beside it. The profile itself is the
per-layer median of `rounds` passes.

Registered in sections.py as `partition`; it also runs alone (prints the
section; ~2 min on 2 busy cores):

    python tools/bench/partition_bench.py [--tiny] [--reps=N] [--clock=wall]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from bench import common  # pylint: disable=g-import-not-at-top
from bench import report  # pylint: disable=g-import-not-at-top
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import sequential
from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import profile

TARGET_IMBALANCE = 1.10
STAGE_COUNTS = (2, 4)


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'dim': 16, 'wide': (32, 16), 'cheap': (32,), 'batch': 16,
            'M': 2, 'repeats': 1, 'rounds': 1, 'clock': 'cpu'}
  return {'dim': 128, 'wide': (256, 512, 1024, 512, 1024, 512, 256),
          'cheap': (2048, 1024, 512, 2048, 1024, 512), 'batch': 512, 'M': 4,
          'repeats': 7, 'rounds': 3, 'clock': 'cpu'}


def stack(cfg: dict[str, Any]) -> list[Any]:
  """A matmul-bound part, FC(ReLU) through `wide` widths (time follows
  flops), then blocks FC(GELU) → LayerNorm → Dropout → FC out to `dim` for
  each `cheap` width, whose time is mostly the GELU, LayerNorm and dropout
  that FPropMeta counts at about one flop per element."""
  layers, d = [], cfg['dim']
  for i, w in enumerate(cfg['wide'] + (cfg['dim'],)):
    layers.append(linear.FCLayer.Params().Set(
        name=f'fc{i}_{w}', input_dim=d, output_dim=w, activation='RELU'))
    d = w
  for i, w in enumerate(cfg['cheap']):
    layers += [
        linear.FCLayer.Params().Set(name=f'up{i}_{w}', input_dim=d,
                                    output_dim=w, activation='GELU'),
        normalization.LayerNormLayer.Params().Set(name=f'ln{i}', input_dim=w),
        dropout.DropoutLayer.Params().Set(name=f'drop{i}', dropout_rate=0.1),
        linear.FCLayer.Params().Set(name=f'down{i}', input_dim=w,
                                    output_dim=d, activation='RELU')]
  return layers


def describe(cfg: dict[str, Any]) -> str:
  wide = '→'.join(map(str, (cfg['dim'],) + cfg['wide'] + (cfg['dim'],)))
  return (f'FC(ReLU) {wide}, then for w in {list(cfg["cheap"])}: FC({cfg["dim"]}'
          f'→w, GELU), LayerNorm, Dropout, FC(w→{cfg["dim"]}); batch '
          f'{cfg["batch"]}, M={cfg["M"]}')


def stage_times(layers: list[Any], bounds: list[int], inputs: Any,
                cfg: dict[str, Any], device: str) -> list[float]:
  """Measured forward + backward seconds per micro-batch of each stage."""
  stages = [sequential.SequentialLayer.Params().Set(
      name=f'stage{k}', sub=layers[bounds[k]:bounds[k + 1]])
            for k in range(len(bounds) - 1)]
  return [p.total_s for p in profile.profile_layers(
      stages, inputs, cfg['M'], device=device, repeats=cfg['repeats'],
      clock=cfg['clock'])]


def _imbalance(times: list[float]) -> float:
  return max(times) * len(times) / sum(times)


def _compare(layers: list[Any], cuts: dict[str, list[int]], inputs: Any,
             cfg: dict[str, Any], device: str) -> dict[str, Any]:
  """Measures both partitions' stages in alternation, `rounds` times."""
  runs: dict[str, list[list[float]]] = {name: [] for name in cuts}
  for _ in range(cfg['rounds']):
    for name, bounds in cuts.items():
      runs[name].append(stage_times(layers, bounds, inputs, cfg, device))
  out = {}
  for name, times in runs.items():
    ratios = [_imbalance(t) for t in times]
    medians = [statistics.median(s) for s in zip(*times)]
    out[name] = {'boundaries': cuts[name], 'imbalance': _imbalance(medians),
                 'imbalance_min': min(ratios), 'imbalance_max': max(ratios),
                 'stage_ms': [1e3 * t for t in medians]}
  return out


def _single_threaded() -> None:
  """One intra-op thread, like the benchmark's single-core stage workers:
  on a shared 2-core machine a parallel op waits for its slowest thread,
  so two-thread timings swing with the neighbours' load."""
  try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
  except RuntimeError:  # Runtime started (benchmark.py): keep its setting.
    common.log('partition: TF already started; thread pools unchanged')


def _profile_costs(layers: list[Any], inputs: Any, cfg: dict[str, Any],
                   device: str | None) -> tuple[list[float], list[float]]:
  """Per-layer seconds: the median over `rounds` profiling passes, so a
  burst of load during one layer's repeats does not move the cut."""
  passes = [profile.costs_from_profiles(profile.profile_layers(
      layers, inputs, cfg['M'], device=device, repeats=cfg['repeats'],
      clock=cfg['clock']))
            for _ in range(cfg['rounds'])]
  costs = [statistics.median(c) for c in zip(*passes)]
  spread = [(max(c) - min(c)) / statistics.median(c) if min(c) > 0 else 0.0
            for c in zip(*passes)]
  return costs, spread


def run(args: argparse.Namespace,
        devices: list[str] | None = None) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  if args.reps:
    cfg['repeats'] = args.reps
  cfg['clock'] = getattr(args, 'clock', None) or cfg['clock']
  device = devices[0] if devices else None
  _single_threaded()
  layers = stack(cfg)
  shape = [cfg['batch'], cfg['dim']]
  flops = [float(m.flops) for m in gpipe.layer_metas(layers, [shape])]
  inputs = profile.synthetic_inputs([shape])
  common.log(f'partition: profiling {len(layers)} layers, {cfg["rounds"]} '
             'passes')
  costs, spread = _profile_costs(layers, inputs, cfg, device)
  rows, targets = [], []
  for k in STAGE_COUNTS:
    cuts = {'flops': partitioner.partition(flops, k),
            'profile': partitioner.partition(costs, k)}
    common.log(f'partition: K={k} measuring stages of {cuts}')
    measured = _compare(layers, cuts, inputs, cfg, device or '')
    for name, bounds in cuts.items():
      rep = partitioner.make_report(flops, bounds, second_costs=costs)
      rows.append({'K': k, 'by': name, **measured[name],
                   'predicted_by_flops': rep.imbalance,
                   'predicted_by_profile': rep.second.imbalance})
    targets.append(report.target(
        f'measured max/mean stage time, profile partition, K={k}',
        measured['profile']['imbalance'], '<=', TARGET_IMBALANCE))
  return {'network': f'{len(layers)} layers: {describe(cfg)}',
          'rounds': cfg['rounds'], 'repeats': cfg['repeats'],
          'clock': cfg['clock'],
          'layer_ms': [1e3 * c for c in costs],
          'layer_spread_median': statistics.median(spread),
          'rows': rows, 'targets': targets}


def render(s: dict[str, Any]) -> str:
  rows = [[r['K'], r['by'], str(r['boundaries']),
           f'{r["predicted_by_flops"]:.3f}',
           f'{r["predicted_by_profile"]:.3f}',
           ' '.join(f'{t:.2f}' for t in r['stage_ms']),
           f'{r["imbalance"]:.3f} ({r["imbalance_min"]:.3f}–'
           f'{r["imbalance_max"]:.3f})'] for r in s['rows']]
  return '\n'.join([
      f'Network: {s["network"]}. Stage times: each stage\'s layers alone, '
      f'forward + backward of one micro-batch by {s["clock"]} time, median '
      f'of {s["repeats"]} '
      f'calls, then of {s["rounds"]} alternated rounds; max/mean of those '
      '(per-round min–max in brackets). Profile: per-layer median of '
      f'{s["rounds"]} passes (median spread between passes '
      f'{100 * s.get("layer_spread_median", 0):.0f}%). Single-threaded TF.',
      '',
      report.table(['K', 'partition by', 'boundaries',
                    'predicted max/mean by flops',
                    'predicted max/mean by profile',
                    'measured stage times (ms)', 'measured max/mean'], rows),
      '', report.target_lines(s['targets'])] + _limits(s))


def _limits(s: dict[str, Any]) -> list[str]:
  """'What limits it' for each profile partition over its target."""
  notes = []
  for r in s['rows']:
    if r['by'] != 'profile' or r['imbalance'] <= TARGET_IMBALANCE:
      continue
    notes.append(
        f'K={r["K"]}: the profile predicted max/mean '
        f'{r["predicted_by_profile"]:.3f} for this cut and the stages '
        f'measured {r["imbalance"]:.3f} (rounds '
        f'{r["imbalance_min"]:.3f}–{r["imbalance_max"]:.3f}): the '
        'per-layer times do not add up to the stage\'s time (a stack of '
        'layers runs faster or slower than its layers one by one), or no '
        'cut of whole layers balances them better (the exact partitioner\'s '
        'optimum is the predicted figure)')
  return ['- What limits it: ' + '; '.join(notes) + '.'] if notes else []


if __name__ == '__main__':
  _parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  _parser.add_argument('--tiny', action='store_true')
  _parser.add_argument('--reps', type=int, default=0)
  _parser.add_argument('--clock', choices=sorted(profile.CLOCKS), default='')
  _section = run(_parser.parse_args())
  print(json.dumps(_section))
  print(render(_section))
