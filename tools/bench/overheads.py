"""What the pipeline machinery itself costs, in one process on one core.

* K=1, M=1, recompute='never' is the pipeline doing nothing: its step
  should cost what a hand-written `tf.function` step of the same layers and
  weights costs (target ≤ 1.05×).
* Recompute re-runs each stage's forward in the backward: ≤ 1.33× the step
  (backward ≈ 2 × forward, so one extra forward is ~+33%).
* Tracing: the engine emits the periodic middle of a schedule
  as a `tf.while_loop` (executor.py, loops.py), so tracing should not grow
  with M. Measured for the training step the trainer runs (FPropLoss: the
  loss in the last stage; GPipe and 1F1B) and for FProp under an outer
  tape, K=2 (two logical devices of this process: tracing does not depend
  on where stages run), M=8 and M=64; target ≤ 1.5×. Each figure is the
  median of several traces of fresh step functions, after one dropped
  warm-up trace; the same traces with `loop_steady_state=False` (every op
  emitted) are printed beside them.
* What the loop costs a step: the FPropLoss steps at M=64, looped and
  emitted op by op, side by side (first call: tracing, Grappler, first
  run; then the median of alternating steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import tensorflow as tf

from bench import common
from bench import report
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import devices as devices_lib
from lingvo_pipe.pipeline import timeline

TRACE_MS = (8, 64)
TRACE_K = 2
TARGET_TRACE = 1.5


def sizes(tiny: bool) -> tuple[common.NetSpec, int, int]:
  """(network, timed repetitions, traces per figure)."""
  if tiny:
    return common.NetSpec(4, 32, 64), 1, 1
  return common.NetSpec(16, 512, 1024), 7, 3


def _pin_one_core() -> None:
  """Core 0 and single-threaded TF, as one stage process runs."""
  os.sched_setaffinity(0, {0})
  try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
  except RuntimeError:
    common.log('overheads: TF already started; thread pools unchanged')


def _versus(spec: common.NetSpec, device: str,
            reps: int) -> tuple[dict[str, float], dict[str, float]]:
  """Pipeline (K=1, M=1, never) vs hand-written vs recompute='always'."""
  net = common.pipeline_params(spec, 1, 1, [device], 'never').Instantiate()
  x = common.make_input(spec, device)
  again = common.pipeline_params(spec, 1, 1, [device],
                                 'always').Instantiate()
  steps = {'hand-written': common.hand_written_step(net, x),
           'pipeline, never': common.pipeline_step(net, x),
           'pipeline, always': common.pipeline_step(again, x)}
  for fn in steps.values():
    common.first_call(fn)
  times = common.interleaved(steps, reps)
  out = {name: common.median(t) for name, t in times.items()}
  # The op times of the recomputing step say what recompute should cost.
  recorder = timeline.StepRecorder(again, (x,), common.loss_on(device),
                                   update=common.sgd_update)
  recorder()
  cost = timeline.calibrated_costs(recorder())[0]
  f, r, b = (cost.time(kind) for kind in ('F', 'R', 'B'))
  return out, {'F': f, 'R': r, 'B': b, 'implied_ratio': (f + r + b) / (f + b)}


def _loss_fn(y: tf.Tensor, labels: tf.Tensor) -> dict[str, Any]:
  del labels
  n = tf.cast(tf.shape(y)[0], y.dtype)
  return {'loss': (tf.reduce_sum(tf.square(y)) / n, n)}


def _trace_step(spec: common.NetSpec, m: int, form: str,
                devices: list[str], loop: bool = True) -> Callable[[], Any]:
  """A fresh, untraced training step of the given form."""
  schedule = 'gpipe' if form == 'FProp' else form.split()[1]
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=spec.layer_params(), num_stages=TRACE_K,
      num_micro_batches=m, input_shapes=[[spec.batch, spec.width]],
      devices=devices, schedule=schedule,
      loop_steady_state=loop).Instantiate()
  x = common.make_input(spec, devices[0])
  if form == 'FProp':
    return common.pipeline_step(net, x)
  labels = tf.zeros([spec.batch])
  variables = list(net.trainable_variables)

  @tf.function
  def _step() -> tf.Tensor:
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        loss = net.FPropLoss(net.theta, (x,), labels, _loss_fn)['loss'][0]
    common.sgd_update(variables, tape.gradient(loss, variables))
    return loss

  return _step


def _trace_once(spec: common.NetSpec, m: int, form: str,
                devices: list[str], loop: bool = True) -> tuple[float, int]:
  """Seconds to trace a fresh step function, and its graph's op count."""
  step = _trace_step(spec, m, form, devices, loop)
  start = time.perf_counter()
  graph = step.get_concrete_function().graph
  seconds = time.perf_counter() - start
  ops = len(graph.get_operations())
  common.release()
  return seconds, ops


def _tracing(spec: common.NetSpec, traces: int) -> list[dict[str, Any]]:
  """Trace seconds and graph ops per form and M (medians of `traces`).

  Each form is traced once first and that trace dropped: the first trace
  in a process also converts and caches the layers' code (AutoGraph,
  function types), which would be charged to whichever M came first. Then
  the Ms alternate.
  """
  devices_lib.configure_logical_cpus(TRACE_K)
  devices = devices_lib.default_devices(TRACE_K)
  rows = []
  for form in ('FPropLoss gpipe', 'FPropLoss 1f1b', 'FProp'):
    _trace_once(spec, TRACE_MS[0], form, devices)  # Warm-up, dropped.
    seconds: dict[tuple[int, bool], list[float]] = {
        (m, loop): [] for m in TRACE_MS for loop in (True, False)}
    ops = {}
    for _ in range(traces):
      for key in seconds:
        t, ops[key] = _trace_once(spec, key[0], form, devices, key[1])
        seconds[key].append(t)
    rows += [{'form': form, 'M': m,
              'trace_s': statistics.median(seconds[(m, True)]),
              'graph_ops': ops[(m, True)],
              'unrolled_trace_s': statistics.median(seconds[(m, False)]),
              'unrolled_graph_ops': ops[(m, False)]} for m in TRACE_MS]
  return rows


def _loop_cost(spec: common.NetSpec, reps: int) -> list[dict[str, Any]]:
  """First call and step of the M=64 training steps, looped and emitted
  op by op, measured side by side."""
  devices = devices_lib.default_devices(TRACE_K)
  m = TRACE_MS[-1]
  rows = []
  for form in ('FPropLoss gpipe', 'FPropLoss 1f1b'):
    steps = {loop: _trace_step(spec, m, form, devices, loop)
             for loop in (True, False)}
    first = {loop: common.first_call(fn) for loop, fn in steps.items()}
    times = common.interleaved({str(k): fn for k, fn in steps.items()}, reps)
    step = {loop: common.median(times[str(loop)]) for loop in steps}
    rows.append({'form': form, 'M': m, 'first_loop_s': first[True],
                 'first_unrolled_s': first[False], 'step_loop_s': step[True],
                 'step_unrolled_s': step[False],
                 'step_ratio': step[True] / step[False]})
    common.release()
  return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
  spec, reps, traces = sizes(args.tiny)
  reps = args.reps or reps
  if not args.tiny:  # The tiny run may share a process (tests): no pinning.
    _pin_one_core()
  devices_lib.configure_logical_cpus(TRACE_K)
  common.log('overheads: pipeline vs hand-written vs recompute')
  steps, ops = _versus(spec, '/device:CPU:0', reps)
  common.log(f'overheads: tracing at M={TRACE_MS}')
  tracing = _tracing(spec, traces)
  common.log(f'overheads: looped vs op-by-op steps at M={TRACE_MS[-1]}')
  loop_cost = _loop_cost(spec, reps)
  growth = {}
  for form in {r['form'] for r in tracing}:
    a, b = (next(r for r in tracing if r['form'] == form and r['M'] == m)
            for m in TRACE_MS)
    growth[form] = {'trace': b['trace_s'] / a['trace_s'],
                    'ops': b['graph_ops'] / a['graph_ops']}
  vs_hand = steps['pipeline, never'] / steps['hand-written']
  recompute = steps['pipeline, always'] / steps['pipeline, never']
  targets = [
      report.target('pipeline (K=1, M=1, never) ÷ hand-written step',
                    vs_hand, '<=', 1.05),
      report.target('recompute=always ÷ never (K=1, M=1)', recompute, '<=',
                    1.33)] + [
      report.target(f'tracing time M={TRACE_MS[1]} ÷ M={TRACE_MS[0]}, '
                    f'{form}', growth[form]['trace'], '<=', TARGET_TRACE)
      for form in ('FPropLoss gpipe', 'FPropLoss 1f1b')]
  return {'network': spec.describe(), 'step_s': steps, 'op_s': ops,
          'tracing': tracing, 'growth': growth, 'targets': targets,
          'loop_cost': loop_cost,
          'traces': traces,
          'devices': 'this process, pinned to core 0 (single-threaded TF); '
                     'tracing on 2 logical CPU devices'}


def render(s: dict[str, Any]) -> str:
  o = s['op_s']
  lines = [
      f'Network: {s["network"]}; one process on one core; medians of '
      'alternating runs.',
      '',
      report.table(['step', 'time (s)'],
                   [[n, v] for n, v in s['step_s'].items()]),
      '',
      f'Op times of the recomputing step (engine timestamps): forward '
      f'{o["F"] * 1e3:.3g} ms, recompute {o["R"] * 1e3:.3g} ms, backward '
      f'{o["B"] * 1e3:.3g} ms → recompute should cost '
      f'{o["implied_ratio"]:.2f}×.',
      '',
      f'Tracing a training step, K={TRACE_K} (median of {s["traces"]} '
      'traces of fresh step functions):',
      '',
      report.table(['form', 'M', 'graph ops', 'trace (s)',
                    'op by op: graph ops', 'op by op: trace (s)'],
                   [[r['form'], r['M'], r['graph_ops'], r['trace_s'],
                     r.get('unrolled_graph_ops', '—'),
                     r.get('unrolled_trace_s', '—')]
                    for r in s['tracing']]),
      '',
      'What the loop costs a training step (K=2 on 2 logical devices, one '
      'core; first call = tracing, Grappler and the first run):',
      '',
      report.table(['form', 'M', 'first call, looped (s)',
                    'first call, op by op (s)', 'step, looped (s)',
                    'step, op by op (s)', 'looped ÷ op by op'],
                   [[r['form'], r['M'], r['first_loop_s'],
                     r['first_unrolled_s'], r['step_loop_s'],
                     r['step_unrolled_s'], r['step_ratio']]
                    for r in s.get('loop_cost', [])]),
      '',
      report.target_lines(s['targets']),
  ]
  notes = []
  if not s['targets'][0]['met']:
    notes.append('the pipeline step adds per-op work the hand-written step '
                 'has not (identities at the stage boundary, the custom '
                 'gradient, reading weights through identities)')
  if not s['targets'][1]['met']:
    notes.append(f'the recomputing step\'s own op times (forward '
                 f'{o["F"] * 1e3:.0f} ms, recompute {o["R"] * 1e3:.0f} ms, '
                 f'backward {o["B"] * 1e3:.0f} ms) imply '
                 f'{o["implied_ratio"]:.2f}×; the rest is outside the ops')
  if not all(t['met'] for t in s['targets'][2:]):
    g = s['growth']
    notes.append(
        'tracing: what is emitted op by op (warm-up, drain, the reads of '
        'each micro-batch\'s outputs) still grows with M: the graph grows '
        + ', '.join(f'{v["ops"]:.2f}× ({f})' for f, v in sorted(g.items())) +
        f' from M={TRACE_MS[0]} to M={TRACE_MS[1]}')
  if notes:
    lines.append('- What limits it: ' + '; '.join(notes) + '.')
  return '\n'.join(lines)
