"""What the compute threads' short scheduler slice buys.

`--compute_slice_us=100` gives TensorFlow's compute threads of a stage
process a 100 µs slice (`processes.shorten_slices`; off by default): a
boundary transfer wakes several threads in turn, and under Linux's EEVDF
scheduler each one can wait for the running compute thread's default
slice. This section measures whether that helps on K=2 stage processes,
and on K=1 in one of them (no transfers: nothing to gain): each
configuration runs twice, with the kernel's default slice ("off") and
with 100 µs ("on"), the two timed in alternation within one launch — from
one launch to the next a step moves by more than the gain. Several
launches (one per M); each gives its own on ÷ off.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench import common
from bench import report
from bench import stage_procs

SLICE_US = 100
# (name, K, schedule, M): the pipelines, and one process's reference.
CONFIGS = (('K=2 gpipe M=8', 2, 'gpipe', 8), ('K=2 1f1b M=8', 2, '1f1b', 8),
           ('K=2 1f1b M=16', 2, '1f1b', 16), ('K=1 M=8', 1, 'gpipe', 8))


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'net': common.NetSpec(4, 32, 32), 'reps': 1, 'launches': 1}
  return {'net': common.NetSpec(16, 512, 1024), 'reps': 15, 'launches': 2}


def _spec(net: common.NetSpec, reps: int, micro: int) -> dict[str, Any]:
  """The configurations with M = `micro`: one launch holds one M (the
  boundary transfers' collective keys do not name the configuration, so
  two Ms in one launch would meet with different shapes)."""
  full = [net.num_layers, net.width, net.batch]
  configs = []
  for name, k, schedule, m in CONFIGS:
    if m != micro:
      continue
    base = {'net': full, 'K': k, 'M': m, 'schedule': schedule,
            'recompute': 'always'}
    if k == 1:
      base.update(scope='local', tasks=[0])
    else:
      base.update(scope='run')
    for arm, slice_us in (('off', 0), ('on', SLICE_US)):
      configs.append(dict(base, name=f'{name} {arm}', slice_us=slice_us))
  return {'configs': configs, 'warmup': 1, 'reps': reps, 'record': 0}


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  reps = args.reps or cfg['reps']
  launches = []
  for i in range(cfg['launches']):
    steps = {}
    for m in sorted({c[3] for c in CONFIGS}):
      common.log(f'slices: launch {i + 1}, M={m} ({cfg["net"].describe()})')
      result = stage_procs.launch(_spec(cfg['net'], reps, m), 2)
      steps.update({name: {arm: stage_procs.median_step(
          result, f'{name} {arm}') for arm in ('off', 'on')}
                    for name, *_, mm in CONFIGS if mm == m})
    launches.append(steps)
  ratios = {name: [l[name]['on'] / l[name]['off'] for l in launches]
            for name, *_ in CONFIGS}
  return {'network': cfg['net'].describe(), 'reps': reps,
          'launches': launches, 'ratios': ratios,
          'median_ratio': {n: statistics.median(r)
                           for n, r in ratios.items()}}


def render(s: dict[str, Any]) -> str:
  n = len(s['launches'])
  header = (['configuration'] +
            [f'launch {i + 1}: off / on (s)' for i in range(n)] +
            [f'on ÷ off, launch {i + 1}' for i in range(n)])
  rows = []
  for name, *_ in CONFIGS:
    rows.append([name] + [
        f'{l[name]["off"]:.4g} / {l[name]["on"]:.4g}' for l in s['launches']
    ] + s['ratios'][name])
  gains = [f'{name}: {(1 - r) * 100:+.1f}%'.replace('+-', '−')
           for name, r in s['median_ratio'].items()]
  return '\n'.join([
      f'Network: {s["network"]}; recompute=always, GPipe unless named; '
      f'"on": compute threads with a {SLICE_US} µs scheduler slice '
      '(`--compute_slice_us`), "off": the kernel\'s default (what stage '
      'processes run with). Each launch '
      f'times both arms in alternation, medians of {s["reps"]} steps per '
      'arm.', '',
      report.table(header, rows), '',
      '- Step time saved by the short slice (median over launches): '
      + '; '.join(gains) + '. K=1 has no transfers: it shows what the '
      'slice costs where it cannot help.'])
