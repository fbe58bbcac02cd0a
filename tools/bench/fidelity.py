"""Does the simulator predict real steps? Calibrate on three, predict the rest.

The simulator takes per-stage op times and a stage-to-stage transfer time;
they come from three calibration steps (engine timestamps), and every
other configuration is predicted from them, never fitted per
configuration:

* K=1, M=1 and K=1, M=M_max: each op's time as `work / M + overhead`.
  The work scales with the micro-batch (split over F, R, B as their op
  times at M=1); the per-op overhead (dispatch, the gap to the next op,
  small-matmul inefficiency, accumulation) does not. The two steps' spans,
  Σwork + 3·M·overhead, give both.
* K=2, M=1: each stage's own op times (a profile of the placed stages, as
  PipeDream profiles its stages: the worker process and the split are not
  the single-device run) and the transfer time, the part of the measured
  step that the stages' op times do not explain.

Predicted: K=1 at the other M, and K=2 at every M > 1. The measured step is
the span of the recorded timeline (first op's start to last op's end),
which is what the simulator models; the wall-clock step (plus the SGD
update and dispatch) is shown beside it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import common
from bench import report
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import timeline

TARGET_ERROR = 0.15


def sizes(tiny: bool) -> tuple[common.NetSpec, list[int], int]:
  if tiny:
    return common.NetSpec(4, 32, 16), [1, 2, 4], 1
  return common.NetSpec(16, 512, 1024), [1, 4, 8, 16], 5


def _measure(spec: common.NetSpec, devices: list[str], k: int, m: int,
             reps: int) -> tuple[list[list[timeline.Record]], list[float]]:
  """Recorded timelines and wall times of `reps` steps (after a warm-up)."""
  net = common.pipeline_params(spec, k, m, devices).Instantiate()
  x = common.make_input(spec, devices[0])
  recorder = timeline.StepRecorder(net, (x,), common.loss_on(net.devices[-1]),
                                   update=common.sgd_update)
  recorder()
  runs, walls = [], []
  for _ in range(reps):
    start = time.perf_counter()
    runs.append(recorder())  # Fetches the timestamps: the step is done.
    walls.append(time.perf_counter() - start)
  common.release()
  return runs, walls


def _op_times(runs: list[list[timeline.Record]]) -> list[dict[str, float]]:
  """Per stage, the median duration of each op kind over `runs`."""
  per_run = [timeline.calibrated_costs(r) for r in runs]
  return [{kind: common.median([costs[k].time(kind) for costs in per_run])
           for kind in timeline.KINDS} for k in range(len(per_run[0]))]


def fit_overhead(op_times: dict[str, float], span_1: float, span_m: float,
                 m: int) -> dict[str, tuple[float, float]]:
  """(work, overhead) per op kind, from one stage's K=1 spans at M=1 and m.

  span(M) = Σ work + 3·M·overhead (F, R and B per micro-batch); the work is
  split over the kinds as their op times at M=1.
  """
  overhead = max(0.0, (span_m - span_1) / (3 * (m - 1)))
  work = max(0.0, span_1 - 3 * overhead)
  total = sum(op_times.values())
  return {kind: (work * op_times[kind] / total, overhead)
          for kind in timeline.KINDS}


def predict(stage_models: list[dict[str, tuple[float, float]]], m: int,
            transfer: float = 0.0) -> simulator.SimResult:
  costs = [simulator.StageCost(
      **{name: sm[kind][0] / m + sm[kind][1] for name, kind in
         (('forward', 'F'), ('recompute', 'R'), ('backward', 'B'))})
           for sm in stage_models]
  return simulator.simulate(costs, m, 'always', transfer_time=transfer)


def fit_transfer(stage_models: list[dict[str, tuple[float, float]]],
                 measured_span: float) -> float:
  """The transfer time that makes the M=1 prediction match its span."""
  base = predict(stage_models, 1).step_time
  slope = (predict(stage_models, 1, 1e-3).step_time - base) / 1e-3
  return max(0.0, (measured_span - base) / slope) if slope > 0 else 0.0


def run(args: argparse.Namespace, devices: list[str]) -> dict[str, Any]:
  spec, ms, reps = sizes(args.tiny)
  reps = args.reps or reps
  m_max = max(ms)
  measured = {}
  for k in (1, 2):
    for m in ms:
      common.log(f'fidelity: K={k}, M={m}')
      runs, walls = _measure(spec, devices, k, m, reps)
      runs.sort(key=common.span)
      median_run = runs[len(runs) // 2]
      measured[k, m] = (runs, median_run, common.span(median_run),
                        common.median(walls))
  # Calibration: work and per-op overhead on K=1; stage profile on K=2, M=1
  # (every op, whatever its stage's size, pays the per-op overhead).
  k1 = fit_overhead(_op_times(measured[1, 1][0])[0], measured[1, 1][2],
                    measured[1, m_max][2], m_max)
  per_layer = {kind: (w / spec.num_layers, o) for kind, (w, o) in k1.items()}
  k2 = [{kind: (max(0.0, times[kind] - o), min(times[kind], o))
         for kind, (_, o) in k1.items()}
        for times in _op_times(measured[2, 1][0])]
  transfer = fit_transfer(k2, measured[2, 1][2])
  models = {1: ([k1], 0.0), 2: (k2, transfer)}
  calibration = {(1, 1), (1, m_max), (2, 1)}
  rows = []
  for (k, m), (_, median_run, span, wall) in measured.items():
    stage_models, t = models[k]
    predicted = predict(stage_models, m, t)
    rows.append({'K': k, 'M': m, 'measured_s': span,
                 'wall_s': wall, 'predicted_s': predicted.step_time,
                 'error': predicted.step_time / span - 1.0,
                 'calibration': (k, m) in calibration,
                 'overlap': timeline.overlap_fraction(median_run),
                 'overlap_predicted': timeline.overlap_fraction(
                     predicted.events)})
  common.release()
  worst = max((r for r in rows if not r['calibration']),
              key=lambda r: abs(r['error']))
  targets = [report.target(f'worst |predicted ÷ measured − 1| over the '
                           f'predicted rows (K={worst["K"]}, '
                           f'M={worst["M"]})',
                           abs(worst['error']), '<=', TARGET_ERROR, '')]
  return {'network': spec.describe(), 'per_layer_s': per_layer,
          'transfer_s': transfer, 'm_max': m_max, 'rows': rows,
          'targets': targets}


def render(s: dict[str, Any]) -> str:
  pl = s['per_layer_s']
  ms = lambda kind: f'{pl[kind][0] * 1e3:.3g} ms / M'
  overhead = pl['F'][1] * 1e3
  lines = [
      f'Network: {s["network"]}; recompute=always; K stage devices. '
      f'Calibrated on K=1 at M=1 and M={s["m_max"]} (work per layer: '
      f'forward {ms("F")}, recompute {ms("R")}, backward {ms("B")}; plus '
      f'{overhead:.2g} ms per op) and on K=2, '
      'M=1 (each stage\'s op times; transfer '
      f'{s["transfer_s"] * 1e3:.2g} ms per hop); the other rows are '
      'predictions.',
      '',
      report.table(['K', 'M', 'measured span (s)', 'predicted (s)', 'error',
                    'wall step (s)', 'stages overlap, measured / simulated'],
                   [[r['K'], r['M'], r['measured_s'], r['predicted_s'],
                     f'{100 * r["error"]:+.1f}%' +
                     (' (calibration)' if r['calibration'] else ''),
                     r['wall_s'],
                     f'{100 * r["overlap"]:.0f}% / '
                     f'{100 * r["overlap_predicted"]:.0f}%']
                    for r in s['rows']]),
      '',
      report.target_lines(s['targets']),
  ]
  if not all(t['met'] for t in s['targets']):
    lines.append(_limits(s['rows']))
  return '\n'.join(lines)


def _limits(rows: list[dict[str, Any]]) -> str:
  """The 'what limits it' note, from the measured rows."""
  worst = max((r for r in rows if not r['calibration']),
              key=lambda r: abs(r['error']))
  notes = [f'the worst prediction, K={worst["K"]}, M={worst["M"]}, is '
           f'{100 * worst["error"]:+.0f}%']
  if worst['K'] == 1:
    notes.append('op times at this M are not `work / M + overhead` between '
                 'the two calibration points')
  elif worst['error'] > 0:
    base = {(r['K'], r['M']): r['measured_s'] for r in rows}
    notes.append(
        'the prediction is above the measurement: every K=2 row is scaled '
        'from the one K=2, M=1 calibration step (here '
        f'{base[2, 1]:.3g} s, {base[2, 1] / base[1, 1]:.2f}× the K=1, M=1 '
        'step), so a slow calibration step overstates them all')
  else:
    notes.append(
        f'the stages were busy at the same time for '
        f'{100 * worst["overlap"]:.0f}% of their busy time vs '
        f'{100 * worst["overlap_predicted"]:.0f}% simulated, and ops of two '
        'processes running at once are slower than alone (the ceiling C of '
        'the throughput section is below 2) — the simulator keeps each op\'s '
        'calibrated time whatever runs beside it')
  return '- What limits it: ' + '; '.join(notes) + '.'
