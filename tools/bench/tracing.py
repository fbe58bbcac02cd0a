"""Tracing and graph size of stage processes as M grows.

Emitted one action at a time, a step's graph and its tracing grow with M.
The executor traces the steady state once, as loops, in one process and
on stage processes alike. Here each (schedule, M) runs in fresh K=2 stage
processes (`lingvo_pipe.launch`), rounds alternating the order, and each
task reports its traced step's op count (its graph and every function in
it) and the wall time of its first call (tracing, graph optimisation and
the first step). The slower task's figures count.

  graph growth  = ops at M=64 ÷ ops at M=8 − 1          target ≤ 0.20
  first call    = first call at M=64 ÷ at M=8          target ≤ 1.3

The first call holds one step, and a step at M=64 runs 8× as many kernels
on 1/8 the rows each. What that costs the kernels alone is measured in the
same round: one stage's layers as a hand-written tape step over M slices
of the batch (no pipeline, no recompute) in one process on one core. The
section prints it beside the first call less the step (tracing, graph
optimisation and the first run's set-up) and the tracing alone
(`get_concrete_function`, timed before the call), so a miss says which
grew.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench import common
from bench import report
from bench import stage_procs

SCHEDULES = ('gpipe', '1f1b')
TARGET_GROWTH = 0.20
TARGET_FIRST_CALL = 1.3


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'net': common.NetSpec(4, 32, 64), 'ms': (2, 8), 'rounds': 1}
  return {'net': common.NetSpec(16, 512, 1024), 'ms': (8, 64), 'rounds': 3}


def _measure(net: common.NetSpec, schedule: str, m: int) -> dict[str, Any]:
  cfg = {'name': 'step', 'scope': 'run', 'net': [net.num_layers, net.width,
                                                 net.batch],
         'K': 2, 'M': m, 'schedule': schedule, 'recompute': 'always'}
  run = stage_procs.launch({'configs': [cfg], 'warmup': 0, 'reps': 1,
                            'record': 0}, 2)
  tasks = run.config('step')
  return {'first_call_s': max(t['first_call_s'] for t in tasks),
          'trace_s': max(t['trace_s'] for t in tasks),
          'graph_ops': max(t['graph_ops'] for t in tasks),
          'step_s': max(t['times_s'][0] for t in tasks)}


def _kernels(net: common.NetSpec, ms: tuple[int, ...]) -> dict[str, float]:
  """Median step of one stage's layers, hand-written over M slices."""
  stage = [net.num_layers // 2, net.width, net.batch]
  configs = [{'name': f'M={m}', 'scope': 'local', 'tasks': [0],
              'kind': 'hand', 'micro_batches': m, 'net': stage, 'K': 1,
              'M': 1} for m in ms]
  run = stage_procs.launch({'configs': configs, 'warmup': 1, 'reps': 5,
                            'record': 0}, 1)
  return {f'M={m}': stage_procs.median_step(run, f'M={m}') for m in ms}


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  small, large = cfg['ms']
  rounds = []
  for i in range(args.rounds or cfg['rounds']):
    order = [(s, m) for s in SCHEDULES for m in cfg['ms']]
    if i % 2:
      order.reverse()
    common.log(f'tracing: round {i + 1} ({cfg["net"].describe()})')
    rounds.append({f'{s} M={m}': _measure(cfg['net'], s, m)
                   for s, m in order})
    rounds[-1]['kernels'] = _kernels(cfg['net'], cfg['ms'])
  targets = []
  for s in SCHEDULES:
    ops = [r[f'{s} M={large}']['graph_ops'] / r[f'{s} M={small}']['graph_ops']
           - 1 for r in rounds]
    first = [r[f'{s} M={large}']['first_call_s'] /
             r[f'{s} M={small}']['first_call_s'] for r in rounds]
    targets.append(report.target(
        f'{s}: graph ops at M={large} ÷ M={small} − 1', max(ops), '<=',
        TARGET_GROWTH, ''))
    targets.append(report.target(
        f'{s}: tracing + first step at M={large} ÷ M={small}, median of '
        'rounds', statistics.median(first), '<=', TARGET_FIRST_CALL, '×'))
  return {'network': cfg['net'].describe(), 'ms': list(cfg['ms']),
          'rounds': rounds, 'targets': targets}


def _growth(s: dict[str, Any]) -> list[str]:
  """Medians of rounds: what of the first call grew, M=large ÷ M=small."""
  small, large = s['ms']

  def ratio(fn: Any) -> float:
    return statistics.median(fn(r, f'M={large}') / fn(r, f'M={small}')
                             for r in s['rounds'])

  lines = [f'- the kernels alone (one stage\'s layers, hand-written over M '
           f'slices, one core): step at M={large} ÷ M={small}: '
           f'{ratio(lambda r, m: r["kernels"][m]):.2f}×']
  for sched in SCHEDULES:
    step = ratio(lambda r, m: r[f'{sched} {m}']['step_s'])
    rest = ratio(lambda r, m: r[f'{sched} {m}']['first_call_s']
                 - r[f'{sched} {m}']['step_s'])
    trace = ratio(lambda r, m: r[f'{sched} {m}']['trace_s'])
    lines.append(f'- {sched}: step at M={large} ÷ M={small}: {step:.2f}×; '
                 f'first call less one step (tracing, graph optimisation, '
                 f'first run\'s set-up): {rest:.2f}×; the tracing alone: '
                 f'{trace:.2f}×')
  return lines


def render(s: dict[str, Any]) -> str:
  small, large = s['ms']
  rows = []
  for i, r in enumerate(s['rounds']):
    for sched in SCHEDULES:
      a, b = r[f'{sched} M={small}'], r[f'{sched} M={large}']
      rows.append([i + 1, sched, a['graph_ops'], b['graph_ops'],
                   b['graph_ops'] / a['graph_ops'], a['first_call_s'],
                   b['first_call_s'], b['first_call_s'] / a['first_call_s'],
                   a['step_s'], b['step_s']])
  return '\n'.join([
      f'Network: {s["network"]}, K=2 stage processes, recompute=always, '
      'each (schedule, M) in fresh processes; the slower task\'s figures. '
      'Graph ops: the traced step\'s ops, its functions\' included.',
      '',
      report.table(['round', 'schedule', f'ops M={small}', f'ops M={large}',
                    'ratio', f'first call M={small} (s)',
                    f'first call M={large} (s)', 'ratio',
                    f'step M={small} (s)', f'step M={large} (s)'], rows),
      '',
      report.target_lines(s['targets']),
      *(_growth(s) if 'kernels' in s['rounds'][0] else []),
  ])
