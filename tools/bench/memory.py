"""Largest trainable model per memory budget, in the shape of GPipe Table 1.

The network is an activation-heavy FC stack (a big batch of narrow rows),
as AmoebaNet on 480×480 images is: there, as here, what recompute and
pipelining save is activation memory, so the stack grows in layers. For
each configuration the number of layers is searched — doubled until a
measured step no longer fits, then bisected — never computed from a
formula:

  naive        a plain tape step, no pipeline, no recompute, one device;
  pipeline-1   PipeliningLayer, K=1, recompute, M micro-batches;
  pipeline-K   K stages on K logical CPU devices of this process.

Measured: the TF allocator's peak (`get_memory_info('CPU:0')`, reset before
the step; parameters, gradients, input and activations, minus what earlier
trials left behind). benchmark.py sets TF's BFC allocator on every CPU: the
default CPU allocator keeps no statistics when oneDNN is off (AMD). Those statistics miss allocations under 256 KiB; at
these sizes that is only the weights and their gradients, whose bytes are
added from the variables. Logical CPU devices share one allocator, so for K>1
the measurement is the whole process, and the stages peak at different times
(each during its own backward), so total ÷ K understates the fullest device.
Per device, pipeline-K therefore uses the larger of total ÷ K and the
simulator's largest per-stage peak (FPropMeta bytes) × the measured ÷
simulated ratio of the pipeline-1 result (which adds what the simulator
leaves out: gradients, transients). A child process cross-checks the
largest naive and pipeline-1 models by peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable

if __name__ == '__main__':  # The cross-check child: python memory.py probe …
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')  # benchmark.py

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from bench import common  # pylint: disable=g-import-not-at-top
from bench import report  # pylint: disable=g-import-not-at-top
from bench import reference  # pylint: disable=g-import-not-at-top
from lingvo_pipe.pipeline import devices as devices_lib  # pylint: disable=C0413

MIB = 2**20
# TF's CPU allocator statistics do not see allocations below 256 KiB.
_UNTRACKED_BYTES = 256 * 1024
NUM_DEVICES = common.NUM_LOGICAL_DEVICES
TARGET_MEMORY_RATIO, TARGET_TIME_RATIO = 0.40, 1.33
# (name, K, recompute policy or None for the naive step).
CONFIGS = (('naive', 1, None), ('pipeline-1', 1, 'always'),
           ('pipeline-2', 2, 'always'), ('pipeline-4', 4, 'always'))


def sizes(tiny: bool) -> dict[str, Any]:
  """Budget per device, network family, M, search tolerance."""
  if tiny:
    return {'budget_mib': 10.0, 'width': 16, 'batch': 16384, 'M': 4,
            'tolerance': 2.0, 'recompute_layers': 8, 'recompute_M': 4,
            'reps': 1, 'max_layers': 8}
  return {'budget_mib': 64.0, 'width': 64, 'batch': 32768, 'M': 4,
          'tolerance': 1.125, 'recompute_layers': 32, 'recompute_M': 8,
          'reps': 3, 'max_layers': 512}


def _step(spec: common.NetSpec, k: int, m: int, recompute: str | None,
          devices: list[str]) -> tuple[Any, Callable[[], Any]]:
  net = common.pipeline_params(spec, k, m, devices,
                               recompute or 'never').Instantiate()
  x = common.make_input(spec, devices[0])
  step = (common.hand_written_step(net, x) if recompute is None else
          common.pipeline_step(net, x))
  return net, step


def peak_bytes(spec: common.NetSpec, k: int, m: int, recompute: str | None,
               devices: list[str]) -> dict[str, Any]:
  """Allocator peak of one training step, this trial's share.

  The step is called twice and the second call measured: the first call of
  a multi-device function does not report all of its allocations.
  """
  common.release()
  before = tf.config.experimental.get_memory_info('CPU:0')['current']
  net, step = _step(spec, k, m, recompute, devices)
  common.sync(step())
  tf.config.experimental.reset_memory_stats('CPU:0')
  common.sync(step())
  peak = tf.config.experimental.get_memory_info('CPU:0')['peak'] - before
  sizes = [v.numpy().nbytes for v in net.trainable_variables]
  # Weights and their gradients below the allocator's tracking threshold.
  peak += 2 * sum(b for b in sizes if b < _UNTRACKED_BYTES)
  out = {'layers': spec.num_layers, 'peak_bytes': peak,
         'param_bytes': sum(sizes)}
  if recompute is not None and net.metas is not None:
    sim = net.Simulate()
    out['sim_stage_bytes'] = max(
        a + s.param_bytes for a, s in zip(sim.peak_activation_bytes,
                                          sim.stages))
  del net, step
  common.release()
  return out


def search(fits: Callable[[int], bool], start: int, tolerance: float,
           limit: int) -> tuple[int, int]:
  """(largest fitting, smallest failing) layer counts found by measuring.

  Doubles (or halves) from `start` until the answer flips, then bisects
  until smallest failing / largest fitting ≤ `tolerance`. Stops doubling at
  `limit` (then the second value is 0: "at least `limit`").
  """
  lo, hi = 0, 0
  n = max(1, min(start, limit))
  if fits(n):
    lo = n
    while not hi and n < limit:
      n = min(2 * n, limit)
      if fits(n):
        lo = n
      else:
        hi = n
    if not hi:
      return lo, 0
  else:
    hi = n
    while not lo and n > 1:
      n //= 2
      if fits(n):
        lo = n
      else:
        hi = n
  while lo and hi / lo > tolerance and hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo, hi


def _per_device(trial: dict[str, Any], k: int, scale: float) -> float:
  """Bytes on the fullest device: measured for K=1; for K>1 the larger of
  the measured total ÷ K and the simulator's largest stage × `scale`."""
  if k == 1:
    return trial['peak_bytes']
  return max(trial['peak_bytes'] / k, trial['sim_stage_bytes'] * scale)


def _column(sizes: dict[str, Any], name: str, k: int, recompute: str | None,
            devices: list[str], start: int, scale: float) -> dict[str, Any]:
  budget = sizes['budget_mib'] * MIB
  trials: dict[int, dict[str, Any]] = {}

  def _fits(layers: int) -> bool:
    spec = common.NetSpec(layers, sizes['width'], sizes['batch'])
    trial = trials[layers] = peak_bytes(spec, k, sizes['M'], recompute,
                                        devices)
    trial['per_device_bytes'] = _per_device(trial, k, scale)
    common.log(f'memory: {name} {layers} layers: '
               f'{trial["peak_bytes"] / MIB:.1f} MiB in all, '
               f'{trial["per_device_bytes"] / MIB:.1f} MiB per device')
    return trial['per_device_bytes'] <= budget

  lo, hi = search(_fits, start, sizes['tolerance'], sizes['max_layers'])
  best = trials.get(lo, {})
  return {'name': name, 'K': k, 'max_layers': lo, 'first_failing': hi,
          'limit': sizes['max_layers'],
          'peak_mib': best.get('peak_bytes', 0) / MIB,
          'per_device_mib': best.get('per_device_bytes', 0) / MIB,
          'param_mib': best.get('param_bytes', 0) / MIB,
          'sim_stage_mib': best.get('sim_stage_bytes', 0) / MIB or None,
          'trials': len(trials)}


def _recompute_ratio(sizes: dict[str, Any],
                     devices: list[str]) -> dict[str, Any]:
  """Peak memory and step time, recompute always vs never, same K, M."""
  k, m = 2, sizes['recompute_M']
  spec = common.NetSpec(sizes['recompute_layers'], sizes['width'],
                        sizes['batch'])
  peaks = {r: peak_bytes(spec, k, m, r, devices)['peak_bytes']
           for r in ('never', 'always')}
  steps = {r: _step(spec, k, m, r, devices)[1] for r in ('never', 'always')}
  for fn in steps.values():
    common.first_call(fn)
  times = common.interleaved(steps, sizes['reps'])
  t = {r: common.median(v) for r, v in times.items()}
  return {'network': spec.describe(), 'K': k, 'M': m,
          'peak_mib': {r: p / MIB for r, p in peaks.items()},
          'step_s': t, 'memory_ratio': peaks['always'] / peaks['never'],
          'time_ratio': t['always'] / t['never']}


# ---- Cross-check in a child process ------------------------------------------
def _rss(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise common.BenchError(f'/proc/self/status has no {field}.')


def _probe(layers: int, width: int, batch: int, k: int, m: int,
           recompute: str) -> dict[str, float]:
  """In the child: the first step's growth by allocator and by peak RSS.

  The first step of a fresh process, because TF keeps freed large buffers
  for reuse (RSS does not fall after a step); the Python trace is done
  before the window opens, graph optimisation falls inside it.
  """
  devices_lib.configure_logical_cpus(max(k, 1))
  devices = devices_lib.default_devices(k)
  spec = common.NetSpec(layers, width, batch)
  _, step = _step(spec, k, m, None if recompute == 'naive' else recompute,
                  devices)
  step.get_concrete_function()
  tf.config.experimental.reset_memory_stats('CPU:0')
  current = tf.config.experimental.get_memory_info('CPU:0')['current']
  rss = _rss('VmRSS')
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # Resets VmHWM to the current RSS.
  common.sync(step())
  return {'allocator_growth_mib': (tf.config.experimental.get_memory_info(
      'CPU:0')['peak'] - current) / MIB,
          'rss_growth_mib': (_rss('VmHWM') - rss) / MIB}


def cross_check(sizes: dict[str, Any], layers: int, recompute: str
               ) -> dict[str, Any]:
  """Runs `_probe` in a fresh child process."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  cmd = [sys.executable, os.path.abspath(__file__), 'probe', str(layers),
         str(sizes['width']), str(sizes['batch']), '1', str(sizes['M']),
         recompute]
  try:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
  except (subprocess.SubprocessError, ValueError, IndexError) as e:
    return {'layers': layers, 'config': recompute, 'error': str(e)[-300:]}
  return {'layers': layers, 'config': recompute, **result}


# ---- The section ----------------------------------------------------------
def run(args: argparse.Namespace, devices: list[str]) -> dict[str, Any]:
  del devices  # Memory always runs on logical devices of this process.
  cfg = sizes(args.tiny)
  devices_lib.configure_logical_cpus(NUM_DEVICES)
  devs = devices_lib.default_devices(NUM_DEVICES)
  rows, start, scale = [], 4, 1.0
  for name, k, recompute in CONFIGS:
    rows.append(_column(cfg, name, k, recompute, devs, start, scale))
    start = max(1, rows[-1]['max_layers']) * 2  # A guess; still measured.
    if name == 'pipeline-1' and rows[-1]['sim_stage_mib']:
      # What the simulator leaves out (gradients, transients), measured.
      scale = rows[-1]['peak_mib'] / rows[-1]['sim_stage_mib']
  common.log('memory: recompute vs not')
  ratio = _recompute_ratio(cfg, devs)
  common.log('memory: RSS cross-check in child processes')
  checks = [cross_check(cfg, max(1, rows[1]['max_layers']), 'always')]
  if not args.tiny:
    checks.insert(0, cross_check(cfg, max(1, rows[0]['max_layers']),
                                 'naive'))
  targets = [
      report.target(f'peak memory, recompute ÷ none ({ratio["network"]}, '
                    f'K={ratio["K"]}, M={ratio["M"]})', ratio['memory_ratio'],
                    '<=', TARGET_MEMORY_RATIO),
      report.target('step time, recompute ÷ none (same run)',
                    ratio['time_ratio'], '<=', TARGET_TIME_RATIO)]
  return {'budget_mib': cfg['budget_mib'], 'M': cfg['M'],
          'sim_scale': scale,
          'network': f'FC({cfg["width"]}→{cfg["width"]}, ReLU) × L, '
                     f'batch {cfg["batch"]}',
          'rows': rows, 'recompute': ratio, 'cross_check': checks,
          'targets': targets}


def render(s: dict[str, Any]) -> str:
  base = max(1, s['rows'][0]['max_layers'])
  rows = [[r['name'], r['max_layers'], f'{r["max_layers"] / base:.1f}×',
           r['first_failing'] or f'none ≤ {r["limit"]}', r['param_mib'],
           r['peak_mib'],
           r['per_device_mib'], r['sim_stage_mib']] for r in s['rows']]
  rc = s['recompute']
  lines = [
      f'Budget: {s["budget_mib"]:g} MiB per device (parameters + gradients + '
      f'input + activations). Network: {s["network"]}; pipelines use '
      f'M={s["M"]} and recompute. K devices = K logical CPU devices sharing '
      'one allocator, which measures the whole process; "per device" is '
      'measured for K=1 and, for K>1, the larger of total ÷ K and the '
      'simulator\'s largest stage (FPropMeta bytes) × '
      f'{s.get("sim_scale", 1.0):.2f} (pipeline-1\'s measured ÷ simulated '
      'peak: the gradients and transients the simulator omits).',
      '',
      report.table(['config', 'max layers', 'vs naive', 'first failing',
                    'params (MiB)', 'measured peak, total (MiB)',
                    'per device (MiB)', 'simulated largest stage (MiB)'],
                   rows),
      '',
      'GPipe Table 1 for comparison (AmoebaNet-D, (L, D), parameters, '
      'parameter memory, peak activation memory):',
      '',
      report.table(['config', '(L, D)', 'params', 'param. memory',
                    'peak act. memory'],
                   [list(r) for r in reference.GPIPE_TABLE1_AMOEBANET]),
      '',
      'Transformer-L on TPUv3: ' + ', '.join(
          f'{n} {l} layers ({p})'
          for n, l, p in reference.GPIPE_TABLE1_TRANSFORMER) + '.',
      '',
      f'Recompute vs none ({rc["network"]}, K={rc["K"]}, M={rc["M"]}): peak '
      f'{rc["peak_mib"]["always"]:.1f} vs {rc["peak_mib"]["never"]:.1f} MiB, '
      f'step {rc["step_s"]["always"]:.3g} vs {rc["step_s"]["never"]:.3g} s.',
      '',
      report.target_lines(s['targets']),
  ]
  if not s['targets'][0]['met']:
    lines.append('- What limits it: the stage inputs of all M micro-batches '
                 'and the gradients are kept either way; with few layers per '
                 'stage they are a large share of the peak.')
  if not s['targets'][1]['met']:
    lines.append('- What limits it: recompute re-runs every stage\'s forward '
                 '(+33% if backward = 2 × forward); beyond that, on logical '
                 'devices the extra ops share one thread pool with the rest '
                 'of the step. See Overheads for the ratio implied by the '
                 'op times.')
  lines += ['', 'Cross-check in a fresh child process (growth during its '
            'first step — graph optimisation included — by the allocator '
            'and by peak RSS; the allocator figure omits the weights):', '']
  lines.append(report.table(
      ['layers', 'config', 'allocator growth (MiB)', 'RSS growth (MiB)'],
      [[c['layers'], c['config'], c.get('allocator_growth_mib'),
        c.get('rss_growth_mib', c.get('error'))] for c in s['cross_check']]))
  return '\n'.join(lines)


if __name__ == '__main__':
  if len(sys.argv) != 8 or sys.argv[1] != 'probe':
    sys.exit('usage: memory.py probe LAYERS WIDTH BATCH K M '
             '{naive,always,never}')
  print(json.dumps(_probe(*(int(a) for a in sys.argv[2:7]), sys.argv[7])))
