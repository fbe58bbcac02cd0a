"""GPipe's Table 1, measured — the largest model per memory budget.

Every process gets the same budget, enforced by TensorFlow itself:
`TF_CPU_BFC_MEM_LIMIT_IN_MB` caps the CPU BFC allocator (which benchmark.py
turns on with TF_CPU_ALLOCATOR_USE_BFC=true), so a step that needs more
raises ResourceExhaustedError ("OOM when allocating") instead of using it.
Why not the alternatives: a logical-device memory_limit applies to GPUs,
not CPUs; an RSS or address-space cap (RLIMIT_AS) also counts the TF
runtime's code, thread stacks and reserved virtual memory (GBs of address
space before the first op), and ends the process with a bare MemoryError or
a kill instead of TF's error naming the tensor. The trials run with oneDNN
off (TF_ENABLE_ONEDNN_OPTS=0, TF's Eigen kernels): with it on, a step that
reached the limit often died of SIGSEGV instead of raising (TF 2.21, this
Xeon), so "out of memory" could not be told from a crash.

The family is an activation-heavy FC stack (a big batch of narrow rows), as
AmoebaNet on 480×480 images is: what pipelining and recompute save is
activation memory, so the stack grows in layers. For each configuration
the number of layers is searched — doubled from a guess until a training
step no longer fits, then bisected — every trial a fresh run of processes:

  naive        one process, a plain tape step: no pipeline, no recompute;
  pipeline-1   one process, PipeliningLayer K=1, recompute, M micro-batches;
  pipeline-K   K stage processes (K=2, 4; 4 processes share 2 cores),
               each holding L/K layers under the same budget.

A trial fits if two training steps and a measured one run without running
out; the measured per-process figures are TF's allocator peak over that
step and the process's peak RSS.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from bench import common
from bench import reference
from bench import report
from bench import stage_procs

MIB = 2**20
# (name, K, recompute policy or None for the naive step).
CONFIGS = (('naive', 1, None), ('pipeline-1', 1, 'always'),
           ('pipeline-2', 2, 'always'), ('pipeline-4', 4, 'always'))


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'budget_mib': 4, 'width': 16, 'batch': 4096, 'M': 4,
            'tolerance': 2.0, 'max_layers': 16}
  # Each activation is 8 MiB (2 MiB per micro-batch); weights are small.
  return {'budget_mib': 64, 'width': 64, 'batch': 32768, 'M': 4,
          'tolerance': 1.2, 'max_layers': 1024}


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


def trial(cfg: dict[str, Any], k: int, recompute: str | None,
          layers: int) -> dict[str, Any]:
  """One fresh run of k processes under the budget: fits, and its peaks."""
  net = [layers, cfg['width'], cfg['batch']]
  config = {'name': 'trial', 'scope': 'run', 'K': k, 'M': cfg['M'],
            'net': net, 'recompute': recompute or 'never',
            'kind': 'hand' if recompute is None else 'pipeline'}
  run = stage_procs.launch(
      {'configs': [config], 'warmup': 2, 'reps': 0, 'memory': True}, k,
      env={'TF_CPU_BFC_MEM_LIMIT_IN_MB': str(cfg['budget_mib']),
           'TF_ENABLE_ONEDNN_OPTS': '0'},
      allow_failure=True)
  if run.returncode:
    # Out of memory is the expected failure; anything else (a crash near
    # the limit) also means "does not train", and is kept for the record.
    last = [line for line in run.log.splitlines() if 'error' in line.lower()]
    return {'fits': False, 'oom': run.oom,
            'failure': None if run.oom else (last[-1:] or ['?'])[0][-200:]}
  mems = [c['memory'] for c in run.config('trial')]
  return {'fits': True,
          'peak_mib': [m['peak_bytes'] / MIB for m in mems],
          'rss_mib': [t['peak_rss_bytes'] / MIB for t in run.tasks],
          'param_bytes': sum(m['param_bytes'] for m in mems)}


def _column(cfg: dict[str, Any], name: str, k: int, recompute: str | None,
            start: int) -> dict[str, Any]:
  trials: dict[int, dict[str, Any]] = {}
  failures: list[str] = []

  def _fits(layers: int) -> bool:
    trials[layers] = trial(cfg, k, recompute, layers)
    t = trials[layers]
    common.log(f'table1: {name} {layers} layers: ' + (
        f'fits, allocator peak per process {max(t["peak_mib"]):.1f} MiB'
        if t['fits'] else 'runs out of memory' if t['oom'] else
        f'fails: {t["failure"]}'))
    if not t['fits'] and not t['oom']:
      failures.append(f'{layers} layers: {t["failure"]}')
    return t['fits']

  lo, hi = search(_fits, start, cfg['tolerance'], cfg['max_layers'])
  best = trials.get(lo, {})
  return {'name': name, 'K': k, 'max_layers': lo, 'first_failing': hi,
          'limit': cfg['max_layers'], 'trials': len(trials),
          'params': best.get('param_bytes', 0) // 4,
          'peak_mib': best.get('peak_mib', []),
          'rss_mib': best.get('rss_mib', []), 'failures': failures}


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  rows, start = [], 2
  for name, k, recompute in CONFIGS:
    rows.append(_column(cfg, name, k, recompute, start))
    # A guess for the next search to start from (still measured): recompute
    # saves most, then each doubling of K about doubles the layers.
    start = max(1, rows[-1]['max_layers']) * (4 if name == 'naive' else 2)
  base = max(1, rows[0]['max_layers'])
  return {'budget_mib': cfg['budget_mib'], 'M': cfg['M'],
          'network': f'FC({cfg["width"]}→{cfg["width"]}, ReLU) × L, batch '
                     f'{cfg["batch"]}', 'rows': rows,
          'growth': [r['max_layers'] / base for r in rows]}


def render(s: dict[str, Any]) -> str:
  base = max(1, s['rows'][0]['max_layers'])
  paper = {r[0].lower().replace('naive-1', 'naive'): r
           for r in reference.GPIPE_TABLE1_AMOEBANET}
  rows = []
  for r in s['rows']:
    p = paper.get(r['name'], ('',) * 5)
    rows.append([
        r['name'], r['max_layers'], f'{r["max_layers"] / base:.1f}×',
        r['first_failing'] or f'none ≤ {r["limit"]}', f'{r["params"]:,}',
        ' / '.join(f'{x:.0f}' for x in r['peak_mib']) or '—',
        ' / '.join(f'{x:.0f}' for x in r['rss_mib']) or '—',
        f'{p[1]} {p[2]}'.strip() or '—', p[4] or '—'])
  lines = [
      f'Budget: {s["budget_mib"]} MiB per process, TF\'s own allocator limit '
      '(TF_CPU_BFC_MEM_LIMIT_IN_MB; see the module docstring for why not '
      'an RSS cap), oneDNN off (with it, steps at the limit crashed with '
      f'SIGSEGV instead of raising OOM). Network: {s["network"]}; pipelines use M={s["M"]} and '
      'recompute; pipeline-K runs K stage processes. Every trial is a fresh '
      'run; the layer count doubles, then bisects.',
      '',
      report.table(['config', 'max layers', 'vs naive', 'first failing',
                    'parameters', 'allocator peak per process (MiB)',
                    'peak RSS per process (MiB)',
                    'GPipe Table 1: AmoebaNet-D (L, D), params',
                    'GPipe: peak activation memory'], rows),
      '',
      '![Largest trainable model per configuration](table1.png)',
      '',
      'GPipe Table 1 grows the model 3.9× from Naive-1 to Pipeline-1, 6.6× '
      'to Pipeline-2 and 12.8× to Pipeline-4 (parameters). Transformer-L on '
      'TPUv3: ' + ', '.join(
          f'{n} {l} layers ({p})'
          for n, l, p in reference.GPIPE_TABLE1_TRANSFORMER) + '.',
      '',
      *[f'- {r["name"]}: a trial failed other than by running out of memory '
        f'(counted as not fitting): {f}' for r in s['rows']
        for f in r.get('failures', [])],
      '- The RSS column adds the TF runtime itself (code, threads, gRPC '
      'server: a few hundred MiB per process) to what the allocator holds; '
      'the budget caps only the allocator.',
  ]
  return '\n'.join(lines)
