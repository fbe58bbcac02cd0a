"""The timeline picture: one step of each schedule on 2 stage processes.

GPipe, 1F1B, interleaved 1F1B (v=2 stages per process) and the zero-bubble
ZB-H1 and ZB-V (split backward: I, then W; ZB-V holds 2 stages per process
in a V) run the same
network at K=2, M=8, recompute off, in one run of two stage processes. For
each, the recorded step of median span (engine timestamps; one host, so
both processes' clocks agree) is drawn above its prediction: the simulator
run on stage costs calibrated from that step's own median F and B
durations (`timeline.calibrated_costs`), so the panels differ only where
the real step leaves the schedule (transfers, dispatch gaps, noise). Rows
are processes (devices), as the schedule places its stages.

The numbers that say "this is 1F1B": the most micro-batches a stage holds
at once (forward done, backward — or I — not): M for GPipe, K−k for 1F1B
on stage k.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from bench import common
from bench import stage_procs
from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import step_gaps
from lingvo_pipe.pipeline import timeline

K, M, CHUNKS = 2, 8, 2
RECOMPUTE = 'never'
SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zb_h1', 'zb_v')
PNG = 'timeline_k2_m8.png'
TRACE = 'timeline_k2_m8.trace.json'


def sizes(tiny: bool) -> tuple[common.NetSpec, int]:
  if tiny:
    return common.NetSpec(4, 32, 32), 1
  return common.NetSpec(16, 512, 1024), 5


def in_flight(recs: list[Any]) -> list[int]:
  """Per stage, the most micro-batches with F done and B (or I) not yet
  done."""
  out = []
  for s in range(max(r[0] for r in recs) + 1):
    events = sorted([(r[4], 1) for r in recs if r[0] == s and r[2] == 'F'] +
                    [(r[4], -1) for r in recs
                     if r[0] == s and r[2] in ('B', 'I')])
    held = peak = 0
    for _, delta in events:
      held += delta
      peak = max(peak, held)
    out.append(peak)
  return out


def run(args: argparse.Namespace) -> dict[str, Any]:
  spec, record = sizes(args.tiny)
  record = args.reps or record
  configs = [{'name': s, 'scope': 'run', 'K': K, 'M': M, 'schedule': s,
              'recompute': RECOMPUTE, 'chunks': CHUNKS,
              'net': [spec.num_layers, spec.width, spec.batch]}
             for s in SCHEDULES]
  common.log(f'timeline: {", ".join(SCHEDULES)} at K={K}, M={M}')
  runs = {}
  # zb_v in a launch of its own: its stage 3 is on process 0, interleaved's
  # on process 1, and a transfer's collective keys name the stage, not the
  # network (one process refuses the two).
  for group in ([c for c in configs if c['schedule'] != 'zb_v'],
                [c for c in configs if c['schedule'] == 'zb_v']):
    run = stage_procs.launch({'configs': group, 'warmup': 1, 'reps': 1,
                              'record': record}, K)
    runs.update({c['name']: run for c in group})
  panels, rows, maps = [], [], []
  for s in SCHEDULES:
    result = runs[s]
    measured = timeline.normalized(stage_procs.median_by_span(
        stage_procs.records(result, s)))
    sched = schedule_lib.make_schedule(
        s, K, M, RECOMPUTE, CHUNKS if s == 'interleaved' else 1)
    predicted = simulator.simulate(timeline.calibrated_costs(measured), M,
                                   RECOMPUTE, sched)
    gaps = step_gaps.gaps(measured, sched)
    devices = predicted.stage_devices or tuple(
        d % K for d in range(len(predicted.stages)))
    maps += [devices, devices]
    panels += [(f'{s}: measured (engine timestamps, {K} processes)',
                measured),
               (f'{s}: predicted (simulator, this step\'s median op times)',
                predicted.events)]
    rows.append({'schedule': s, 'span_s': stage_procs.span(measured),
                 'predicted_s': predicted.step_time,
                 'predicted_gaps_s': step_gaps.predicted_with_gaps(
                     measured, sched).step_time,
                 'gap_ms': [1e3 * gaps.mean_dispatch, 1e3 * gaps.mean_handoff],
                 'wall_s': stage_procs.median_step(result, s),
                 'bubble_predicted': predicted.bubble_fraction,
                 'in_flight': in_flight(measured),
                 'in_flight_predicted': in_flight(list(predicted.events)),
                 'overlap': timeline.overlap_fraction(
                     [r._replace(stage=devices[r.stage])
                      for r in measured]),
                 'records': [list(r) for r in measured]})
  os.makedirs(args.out_dir, exist_ok=True)
  timeline.plot_gantt(panels, os.path.join(args.out_dir, PNG),
                      title=f'{spec.describe()}, K={K} stage processes, '
                      f'M={M}, recompute={RECOMPUTE}; interleaved: v={CHUNKS}; '
                      'zb_v: 2 stages per process in a V',
                      panel_devices=maps)
  timeline.write_chrome_trace(os.path.join(args.out_dir, TRACE), panels)
  return {'network': spec.describe(), 'png': PNG, 'trace': TRACE,
          'rows': rows, 'targets': _targets(rows)}


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The schedules' memory bounds, read off the measured steps."""
  from bench import report  # pylint: disable=g-import-not-at-top
  by = {r['schedule']: r for r in rows}
  one = by['1f1b']['in_flight']
  return [
      report.target('GPipe: fewest micro-batches held by a stage at once '
                    f'(all M={M})', min(by['gpipe']['in_flight']), '>=', M,
                    ''),
      report.target('1F1B: micro-batches held by stage k ÷ (K−k), worst '
                    'stage', max(n / (K - k) for k, n in enumerate(one)),
                    '<=', 1, ''),
      report.target('interleaved: stages holding more micro-batches than '
                    'the simulator', sum(
                        a > b for a, b in zip(
                            by['interleaved']['in_flight'],
                            by['interleaved']['in_flight_predicted'])),
                    '<=', 0, ''),
  ]


def render(s: dict[str, Any]) -> str:
  from bench import report  # pylint: disable=g-import-not-at-top
  table = [[r['schedule'], r['span_s'], r['predicted_s'],
            r.get('predicted_gaps_s', '–'),
            ' / '.join(f'{g:.2f}' for g in r['gap_ms']) if 'gap_ms' in r
            else '–', r['wall_s'],
            f'{100 * r["bubble_predicted"]:.0f}%',
            f'{100 * r["overlap"]:.0f}%',
            ' / '.join(map(str, r['in_flight'])),
            ' / '.join(map(str, r['in_flight_predicted']))]
           for r in s['rows']]
  return '\n'.join([
      f'Network: {s["network"]}; K={K} stage processes, M={M}, '
      f'recompute={RECOMPUTE}; interleaved: v={CHUNKS} stages per process, '
      'zb_v: 2 in a V (hatched boxes: a process\'s second stage). Each '
      'schedule: the measured step (median '
      'span of the recorded ones) above its prediction from its own '
      'median op times; "with gaps" adds the step\'s mean dispatch gap to '
      'every op and its mean hand-off gap (less that dispatch) to each '
      'transfer between processes (`step_gaps.predicted_with_gaps`).',
      '',
      f'![GPipe, 1F1B, interleaved, ZB-H1 and ZB-V steps, measured and '
      f'predicted]'
      f'({s["png"]})',
      '',
      report.table(['schedule', 'measured span (s)', 'predicted (s)',
                    'with gaps (s)', 'mean dispatch / hand-off gap (ms)',
                    'wall step (s)', 'predicted bubble',
                    'processes busy at once', 'most micro-batches held per '
                    'stage, measured', 'predicted'], table),
      '',
      f'- Chrome trace of all ten panels: [{s["trace"]}]({s["trace"]}) '
      '(ui.perfetto.dev or chrome://tracing).',
      report.target_lines(s.get('targets', [])),
  ])
