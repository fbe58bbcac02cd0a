"""What the schedule costs in activation memory and in step time.

Memory. At K=2, one stage process per stage, recompute off: GPipe runs all
M forwards before any backward, so each stage holds M micro-batches of
activations; 1F1B (PipeDream-flush) holds at most K−k on stage k. The
micro-batch size is fixed (the batch grows with M), so GPipe's activation
peak should grow ∝ M and 1F1B's not at all. Measured per process, by TF's
BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true, set before TF starts): the
peak over one training step minus the bytes in use before it (weights,
optimizer-free SGD, the batch), minus one copy of the stage's weights (the
accumulated gradients, which every schedule holds alike) = the activation
peak. Predicted: the memory model (`memory.predict`) of the same
PipeliningLayer — the simulator's activation peak (FPropMeta bytes on the
schedule's op order), the backward's workspace and the transfers in
flight.

Step time. The same 2 processes run GPipe, 1F1B and interleaved 1F1B
(v=2 virtual stages per process) at M=8, recompute always, needed and
never, timed in alternation. 'needed' should match 'always' in memory and
save the recomputes that directly follow their forward.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench import common
from bench import report
from bench import stage_procs

MIB = 2**20
K = 2
TIME_M = 8
MEMORY_MS = (8, 32)
TARGET_RATIO, TARGET_GROWTH, TARGET_SIM = 0.25, 1.2, 0.25
TARGET_TIME = 1.05
TARGET_RECOMPUTE_MEMORY, TARGET_RECOMPUTE_TIME = 0.40, 1.33
TARGET_NEEDED_MEMORY = 1.05  # Ours: 'needed' must not cost memory.


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'net': common.NetSpec(4, 32, 32), 'layers': 4, 'width': 32,
            'micro': 64, 'reps': 1}
  # Activation-heavy, so gradients hardly count: a micro-batch's output of
  # one layer is 512 KiB, its weights 64 KiB. At M=32 GPipe holds 32 × 8
  # layers × 512 KiB per stage; 1F1B at most 2 micro-batches.
  return {'net': common.NetSpec(16, 512, 1024), 'layers': 16, 'width': 128,
          'micro': 1024, 'reps': 7}


def _memory(cfg: dict[str, Any]) -> list[dict[str, Any]]:
  configs = []
  for schedule, recompute in (('gpipe', 'never'), ('1f1b', 'never'),
                              ('gpipe', 'always'), ('gpipe', 'needed')):
    for m in MEMORY_MS:
      configs.append({'name': f'{schedule} {recompute} M={m}', 'scope': 'run',
                      'K': K, 'M': m, 'schedule': schedule,
                      'recompute': recompute,
                      'net': [cfg['layers'], cfg['width'], cfg['micro'] * m]})
  common.log(f'schedules: memory, {len(configs)} configurations on {K} '
             'processes')
  run = stage_procs.launch({'configs': configs, 'warmup': 1, 'reps': 1,
                            'memory': True}, K)
  rows = []
  for c in configs:
    for task, result in enumerate(run.config(c['name'])):
      mem = result['memory']
      growth = mem['peak_bytes'] - mem['before_bytes']
      pred = mem['predicted'][task]
      rows.append({'schedule': c['schedule'], 'recompute': c['recompute'],
                   'M': c['M'], 'stage': task,
                   'growth_mib': growth / MIB,
                   'grads_mib': mem['param_bytes'] / MIB,
                   'activation_mib': (growth - mem['param_bytes']) / MIB,
                   'sim_mib': pred['activation_bytes'] / MIB,
                   'workspace_mib': pred['workspace_bytes'] / MIB,
                   'transfers_mib': pred['transfer_bytes'] / MIB,
                   'predicted_mib': (pred['activation_bytes'] +
                                     pred['workspace_bytes'] +
                                     pred['transfer_bytes']) / MIB})
  return rows


def _times(cfg: dict[str, Any], reps: int) -> dict[str, float]:
  net = cfg['net']
  configs = [{'name': f'{schedule} {recompute}', 'scope': 'run', 'K': K,
              'M': TIME_M, 'schedule': schedule, 'recompute': recompute,
              'chunks': 2, 'net': [net.num_layers, net.width, net.batch]}
             for recompute in ('always', 'needed', 'never')
             for schedule in ('gpipe', '1f1b', 'interleaved')]
  common.log(f'schedules: step times, {net.describe()}, M={TIME_M}')
  run = stage_procs.launch({'configs': configs, 'warmup': 1, 'reps': reps},
                           K)
  return {c['name']: stage_procs.median_step(run, c['name'])
          for c in configs}


def _peak(rows: list[dict[str, Any]], schedule: str, recompute: str, m: int,
          field: str = 'activation_mib') -> float:
  """The fuller stage's figure."""
  return max(r[field] for r in rows if (r['schedule'], r['recompute'],
                                        r['M']) == (schedule, recompute, m))


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  rows = _memory(cfg)
  times = _times(cfg, args.reps or cfg['reps'])
  lo, hi = MEMORY_MS
  one, gp = (lambda m, s=s: _peak(rows, s, 'never', m)
             for s in ('1f1b', 'gpipe'))
  sim_rows = [r for r in rows if r['recompute'] == 'never']
  worst = max(sim_rows, key=lambda r: abs(
      r['predicted_mib'] / max(r['activation_mib'], 1e-9) - 1))
  sim_error = abs(worst['predicted_mib'] / max(worst['activation_mib'], 1e-9)
                  - 1)
  targets = [
      report.target(f'peak activation memory 1F1B ÷ GPipe, K={K}, M={hi}',
                    one(hi) / gp(hi), '<=', TARGET_RATIO),
      report.target(f'1F1B growth M={lo} → M={hi}', one(hi) / one(lo), '<=',
                    TARGET_GROWTH),
      report.target(f'GPipe growth M={lo} → M={hi} (∝ M: {hi // lo}×)',
                    gp(hi) / gp(lo), '>=', 0.75 * hi / lo),
      report.target(
          f'memory model, worst |predicted ÷ measured − 1| (stage '
          f'{worst["stage"]}, {worst["schedule"]}, M={worst["M"]})',
          sim_error, '<=', TARGET_SIM, ''),
      report.target(f'step time 1F1B ÷ GPipe, K={K}, M={TIME_M}, '
                    'recompute never', times['1f1b never'] /
                    times['gpipe never'], '<=', TARGET_TIME),
      report.target(f'step time 1F1B ÷ GPipe, K={K}, M={TIME_M}, '
                    'recompute always', times['1f1b always'] /
                    times['gpipe always'], '<=', TARGET_TIME),
      report.target(f'GPipe peak step growth, recompute always ÷ never '
                    f'(M={hi})', _peak(rows, 'gpipe', 'always', hi,
                                       'growth_mib') /
                    _peak(rows, 'gpipe', 'never', hi, 'growth_mib'), '<=',
                    TARGET_RECOMPUTE_MEMORY),
      report.target(f'GPipe step time, recompute always ÷ never (M={TIME_M})',
                    times['gpipe always'] / times['gpipe never'], '<=',
                    TARGET_RECOMPUTE_TIME),
      report.target(f'GPipe step time, recompute needed ÷ never (M={TIME_M})',
                    times['gpipe needed'] / times['gpipe never'], '<=',
                    TARGET_RECOMPUTE_TIME),
      report.target(f'GPipe peak step growth, recompute needed ÷ always '
                    f'(M={hi}; the same peak is expected)',
                    _peak(rows, 'gpipe', 'needed', hi, 'growth_mib') /
                    _peak(rows, 'gpipe', 'always', hi, 'growth_mib'), '<=',
                    TARGET_NEEDED_MEMORY),
  ]
  return {'memory_network': f'{cfg["layers"]} × FC({cfg["width"]}→'
                            f'{cfg["width"]}, ReLU), micro-batch '
                            f'{cfg["micro"]} (batch {cfg["micro"]}·M)',
          'time_network': cfg['net'].describe(), 'memory': rows,
          'step_s': times, 'targets': targets}


def render(s: dict[str, Any]) -> str:
  mem = [[r['schedule'], r['recompute'], r['M'], r['stage'], r['growth_mib'],
          r['grads_mib'], r['activation_mib'], r.get('sim_mib', '–'),
          r.get('workspace_mib', '–'), r.get('transfers_mib', '–'),
          r['predicted_mib'],
          f'{r["predicted_mib"] / max(r["activation_mib"], 1e-9):.2f}']
         for r in s['memory']]
  t = s['step_s']
  times = [[name, v, v / t['gpipe ' + name.split()[1]]]
           for name, v in t.items()]
  lines = [
      f'**Memory** — {s["memory_network"]}, K={K} stage processes; per '
      'process: allocator peak over one step − bytes in use before it '
      '(= step growth); − one copy of the stage\'s weights (its gradients) '
      '= activations. Predicted by the memory model (`memory.predict`, from '
      'FPropMeta): the simulator\'s activation peak on the schedule\'s op '
      'order, plus the backward\'s workspace (the gradient into and out of '
      'a layer, and one micro-batch\'s weight gradient before it joins the '
      'sum), plus the transfers in flight (per boundary a stage process '
      'crosses: the recvs posted ahead of their reader and a send not yet '
      'taken). The '
      'batch is a variable, resident before the step, in neither figure.',
      '',
      report.table(['schedule', 'recompute', 'M', 'stage', 'step growth '
                    '(MiB)', 'gradients (MiB)', 'activations (MiB)',
                    'simulator (MiB)', 'workspace (MiB)', 'transfers (MiB)',
                    'predicted (MiB)',
                    'predicted ÷ measured'], mem),
      '',
      '![Activation memory per stage vs M](schedules_memory.png)',
      '',
      f'**Step time** — {s["time_network"]}, K={K} stage processes, '
      f'M={TIME_M}; interleaved has v=2 stages per process. Medians of '
      'alternating steps.',
      '',
      report.table(['schedule, recompute', 'step (s)', '÷ GPipe (same '
                    'recompute)'], times),
      '',
      report.target_lines(s['targets']),
  ]
  notes = _limits(s)
  if notes:
    lines.append(notes)
  return '\n'.join(lines)


def _limits(s: dict[str, Any]) -> str:
  failed = {i for i, t in enumerate(s['targets']) if not t['met']}
  notes = []
  rows = s['memory']
  if failed & {0, 1, 2}:
    one = [r for r in rows if r['schedule'] == '1f1b']
    notes.append('1F1B activations per stage: ' + ', '.join(
        f'stage {r["stage"]} M={r["M"]} {r["activation_mib"]:.1f} MiB'
        for r in one) + ' — what stays is the gradients\' transients and the '
        'in-flight micro-batches (K−k on stage k)')
  if 3 in failed:
    notes.append('the memory model counts FPropMeta output bytes per layer '
                 '(boundary + activations), a backward\'s workspace of 2 '
                 'gradients and the transfers in flight; TF\'s executor runs '
                 'a backward\'s chain of input gradients first and the '
                 'weight gradients last, so each layer\'s output gradient '
                 'and input stay until then: a backward briefly holds up to '
                 'about one more micro-batch of the stage\'s activations '
                 '(profiler allocation events), which the model does not '
                 'count')
  if failed & {4, 5}:
    t = s['step_s']
    notes.append(f'1F1B interleaves each stage\'s forwards and backwards, so '
                 'a stage waits for the other\'s backward between its '
                 f'forwards: GPipe never {t["gpipe never"]:.3g} s vs 1F1B '
                 f'{t["1f1b never"]:.3g} s')
  return ('- What limits it: ' + '; '.join(notes) + '.') if notes else ''
