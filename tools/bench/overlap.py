"""Do K = 3 and K = 4 stage processes overlap, on a 2-core host?

K stage processes share this host's 2 cores (task i on core i mod 2, so
adjacent stages sit on different cores and stages 0 and 2 share one). Their
speed says little, so this measures overlap: from the engine's timestamps
(one host, so the processes' clocks agree), for every adjacent pair of
stages, the seconds during which both run an op at once, divided by what
the simulator predicts for the same step — its stage costs calibrated from
that step's own median F, R and B durations, so the prediction differs from
the measurement only where the real step leaves the schedule (transfers,
dispatch gaps, two processes time-slicing one core). Target: ≥ 0.50 for
every adjacent pair, GPipe and 1F1B, M = 8. The old runtime (stage 0 on
the client, the others as TF workers driven by it) gave 0 between stages
on workers: they took turns.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench import common
from bench import report
from bench import stage_procs
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import step_gaps
from lingvo_pipe.pipeline import timeline

TARGET = 0.50
STAGE_COUNTS = (3, 4)
SCHEDULES = ('gpipe', '1f1b')
M = 8


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'net': common.NetSpec(4, 32, 32), 'record': 1, 'reps': 1}
  return {'net': common.NetSpec(16, 512, 1024), 'record': 5, 'reps': 3}


def _pairs(recs: list[Any], k: int, schedule: str) -> dict[str, Any]:
  """Measured and simulated both-busy seconds of each adjacent pair."""
  costs = timeline.calibrated_costs(recs)
  sim = simulator.simulate(costs, M, 'always', schedule)
  out = []
  for s in range(k - 1):
    measured = stage_procs.busy_together(recs, s, s + 1, k)
    predicted = stage_procs.busy_together(
        [tuple(e) for e in sim.events], s, s + 1, k)
    out.append({'pair': f'{s}-{s + 1}', 'measured_s': measured,
                'predicted_s': predicted,
                'ratio': measured / predicted if predicted > 0 else 0.0})
  return {'pairs': out, 'span_s': stage_procs.span(recs),
          'predicted_span_s': sim.step_time,
          'busy_s': [stage_procs.busy(recs, d, k) for d in range(k)],
          'op_ms': [{kind: 1e3 * c.time(kind) for kind in 'FRB'}
                    for c in costs],
          'handoff_ms': 1e3 * statistics.median(step_gaps.gaps(
              recs, schedule_lib.make_schedule(schedule, k, M)).crossing
                                                or [0.0])}


def _measure(cfg: dict[str, Any], k: int) -> dict[str, Any]:
  net = cfg['net']
  spec = {'configs': [{'name': s, 'scope': 'run', 'K': k, 'M': M,
                       'schedule': s, 'recompute': 'always',
                       'net': [net.num_layers, net.width, net.batch]}
                      for s in SCHEDULES],
          'warmup': 1, 'reps': cfg['reps'], 'record': cfg['record']}
  common.log(f'overlap: K={k} on {k} processes ({net.describe()}, M={M})')
  run = stage_procs.launch(spec, k)
  rows = []
  for schedule in SCHEDULES:
    steps = [_pairs(recs, k, schedule)
             for recs in stage_procs.records(run, schedule)]
    pairs = []
    for i, pair in enumerate(steps[0]['pairs']):
      per_step = [st['pairs'][i] for st in steps]
      pairs.append({'pair': pair['pair'],
                    'ratio': statistics.median(p['ratio'] for p in per_step),
                    'ratio_min': min(p['ratio'] for p in per_step),
                    'measured_s': statistics.median(
                        p['measured_s'] for p in per_step),
                    'predicted_s': statistics.median(
                        p['predicted_s'] for p in per_step)})
    median_step = sorted(steps, key=lambda st: st['span_s'])[len(steps) // 2]
    rows.append({'K': k, 'schedule': schedule, 'pairs': pairs,
                 'steps_recorded': len(steps),
                 'step_s': stage_procs.median_step(run, schedule),
                 **{key: median_step[key] for key in
                    ('span_s', 'predicted_span_s', 'busy_s', 'op_ms',
                     'handoff_ms')}})
  return {'rows': rows, 'cores': [t['cores'] for t in run.tasks]}


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  if args.reps:
    cfg['record'] = args.reps
  rows, cores = [], {}
  for k in STAGE_COUNTS:
    result = _measure(cfg, k)
    rows += result['rows']
    cores[str(k)] = result['cores']
  targets = [report.target(
      f'K={r["K"]} {r["schedule"]}: stages {p["pair"]} busy at once, '
      'measured ÷ simulated', p['ratio'], '>=', TARGET, '')
             for r in rows for p in r['pairs']]
  return {'network': cfg['net'].describe(), 'M': M, 'rows': rows,
          'cores': cores, 'targets': targets}


def render(s: dict[str, Any]) -> str:
  table = []
  for r in s['rows']:
    for p in r['pairs']:
      table.append([r['K'], r['schedule'], p['pair'], p['measured_s'] * 1e3,
                    p['predicted_s'] * 1e3,
                    f'{p["ratio"]:.2f} (min {p["ratio_min"]:.2f})'])
  steps = [[r['K'], r['schedule'], r['step_s'], r['span_s'],
            r['predicted_span_s'],
            ' / '.join(f'{b * 1e3:.0f}' for b in r['busy_s']),
            r['handoff_ms']] for r in s['rows']]
  lines = [
      f'Network: {s["network"]}, M={s["M"]}, recompute=always; one process '
      'per stage (`lingvo_pipe.launch`), task i pinned to core i mod 2 '
      f'(cores per task: {s["cores"]}). Medians over '
      f'{s["rows"][0]["steps_recorded"]} recorded steps; each step\'s '
      'prediction uses that step\'s median op times.',
      '',
      report.table(['K', 'schedule', 'stages', 'both busy, measured (ms)',
                    'predicted (ms)', 'measured ÷ predicted'], table),
      '',
      report.table(['K', 'schedule', 'wall step (s)', 'recorded span (s)',
                    'predicted span (s)', 'busy per stage (ms)',
                    'handoff gap (ms)'], steps),
      '',
      report.target_lines(s['targets']),
  ]
  if not all(t['met'] for t in s['targets']):
    lines.append(_limits(s))
  return '\n'.join(lines)


def _limits(s: dict[str, Any]) -> str:
  worst_row, worst = min(((r, p) for r in s['rows'] for p in r['pairs']),
                         key=lambda rp: rp[1]['ratio'])
  k = worst_row['K']
  return (
      f'- What limits it: the worst pair, K={k} {worst_row["schedule"]} '
      f'stages {worst["pair"]}, was busy at once {worst["measured_s"] * 1e3:.0f}'
      f' ms vs {worst["predicted_s"] * 1e3:.0f} ms predicted; its step spans '
      f'{worst_row["span_s"] * 1e3:.0f} ms vs {worst_row["predicted_span_s"] * 1e3:.0f}'
      f' ms predicted, the median handoff gap (input ready and stage free → '
      f'op starts) is {worst_row["handoff_ms"]:.1f} ms, and {k} processes '
      'share 2 cores, so a stage whose core-mate runs stalls for a time '
      'slice the simulator does not model.')
