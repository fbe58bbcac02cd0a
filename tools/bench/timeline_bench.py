"""The picture: one real K=2, M=4 step on two processes.

The measured panel comes from the engine's timestamps; the predicted panel
is the simulator run on stage costs calibrated from this same step's median
F, R and B durations (`timeline.calibrated_costs`), so the two differ only
where the real step leaves the schedule: transfers, dispatch gaps, noise.
The numbers that say "it pipelines": how much stage 0's work on
micro-batch m+1 overlaps stage 1's work on m, in the forward (F) and in
the backward (R then B, micro-batches in reverse order).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench import common
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import timeline

NUM_STAGES, NUM_MICRO_BATCHES = 2, 4
# Stage 0's end stamp and stage 1's start stamp of micro-batch m both wait
# only for stage 0's output, so they may fire in either order.
_STAMP_SLACK_S = 1e-3
PNG = 'timeline_k2_m4.png'
TRACE = 'timeline_k2_m4.trace.json'


def sizes(tiny: bool) -> tuple[common.NetSpec, int]:
  if tiny:
    return common.NetSpec(4, 32, 16), 1
  return common.NetSpec(16, 512, 1024), 5


def _shared(a: tuple[float, float], b: tuple[float, float]) -> float:
  """Overlap of two intervals as a share of the shorter one."""
  shared = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
  return shared / max(1e-12, min(a[1] - a[0], b[1] - b[0]))


def _overlap(records: list[timeline.Record]) -> dict[str, Any]:
  """Stage 0 on m+1 vs stage 1 on m (forward; backward = R..B), and the
  F(1, m)-after-F(0, m) check."""
  f = {(r.stage, r.micro_batch): r for r in records if r.kind == 'F'}
  back: dict[tuple[int, int], list[float]] = {}
  for r in records:
    if r.kind in ('R', 'B'):
      span = back.setdefault((r.stage, r.micro_batch), [r.start, r.end])
      span[0], span[1] = min(span[0], r.start), max(span[1], r.end)
  forward, backward, ordered = [], [], True
  for m in range(NUM_MICRO_BATCHES):
    ordered &= f[(1, m)].start >= f[(0, m)].end - _STAMP_SLACK_S
    if m + 1 < NUM_MICRO_BATCHES:
      forward.append(_shared((f[(0, m + 1)].start, f[(0, m + 1)].end),
                             (f[(1, m)].start, f[(1, m)].end)))
      backward.append(_shared(tuple(back[(0, m + 1)]),
                              tuple(back[(1, m)])))
  return {'forward_order_ok': bool(ordered),
          'overlap_of_shorter': forward,
          'backward_overlap_of_shorter': backward}


def run(args: argparse.Namespace, devices: list[str]) -> dict[str, Any]:
  spec, reps = sizes(args.tiny)
  reps = args.reps or reps
  net = common.pipeline_params(spec, NUM_STAGES, NUM_MICRO_BATCHES,
                               devices).Instantiate()
  recorder = timeline.StepRecorder(
      net, (common.make_input(spec, devices[0]),),
      common.loss_on(net.devices[-1]), update=common.sgd_update)
  common.log('timeline: K=2, M=4')
  recorder()  # Traces.
  runs = []
  for _ in range(reps):
    start = time.perf_counter()
    recs = recorder()
    runs.append((max(r.end for r in recs), time.perf_counter() - start, recs))
  runs.sort(key=lambda run: run[0])
  span, wall, measured = runs[len(runs) // 2]  # The median step.
  predicted = simulator.simulate(timeline.calibrated_costs(measured),
                                 NUM_MICRO_BATCHES, 'always')
  os.makedirs(args.out_dir, exist_ok=True)
  panels = [(f'measured (engine timestamps, {NUM_STAGES} processes)',
             measured),
            ('predicted (simulator, stage costs = this step\'s median op '
             'times)', predicted.events)]
  timeline.plot_gantt(panels, os.path.join(args.out_dir, PNG),
                      title=f'GPipe step, {spec.describe()}, K=2, M=4, '
                      'recompute=always')
  timeline.write_chrome_trace(os.path.join(args.out_dir, TRACE), panels)
  return {'network': spec.describe(), 'png': PNG, 'trace': TRACE,
          'measured_span_s': span, 'wall_s': wall,
          'predicted_s': predicted.step_time,
          'bubble_predicted': predicted.bubble_fraction,
          'overlap_measured': timeline.overlap_fraction(measured),
          'overlap_predicted': timeline.overlap_fraction(predicted.events),
          'records': [list(r) for r in measured], **_overlap(measured)}


def render(s: dict[str, Any]) -> str:
  ov = ', '.join(f'{100 * o:.0f}%' for o in s['overlap_of_shorter'])
  back = ', '.join(f'{100 * o:.0f}%' for o in
                   s.get('backward_overlap_of_shorter', []))
  return '\n'.join([
      f'Network: {s["network"]}. Measured span {s["measured_span_s"]:.3g} s '
      f'(wall {s["wall_s"]:.3g} s) vs predicted {s["predicted_s"]:.3g} s '
      f'(bubble {100 * s["bubble_predicted"]:.0f}%).',
      '',
      f'![K=2, M=4 timeline]({s["png"]})',
      '',
      f'- Stage 1 starts forward m only after stage 0 finished it: '
      f'{"yes" if s["forward_order_ok"] else "NO"}.',
      f'- Stage 0 forward m+1 overlaps stage 1 forward m (share of the '
      f'shorter op, m = 0..2): {ov}.',
      f'- Stage 0 backward (R, B) of m+1 overlaps stage 1 backward of m: '
      f'{back}.',
      f'- Both stages busy at once: {100 * s["overlap_measured"]:.0f}% of '
      f'busy time measured, {100 * s["overlap_predicted"]:.0f}% predicted.',
      f'- Chrome trace: [{s["trace"]}]({s["trace"]}) (open in '
      'ui.perfetto.dev or chrome://tracing).',
  ])
