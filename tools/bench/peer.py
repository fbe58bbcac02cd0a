"""The peer: torch.distributed.pipelining (gloo) beside our stage
processes, same network, K=2, M=8, in one run.

Both sides: L × FC(W→W, ReLU), square loss ÷ batch, SGD, no recompute
(torch's schedules keep activations), M=8, GPipe and 1F1B, two processes
pinned to cores 0 and 1 with one compute thread each; and each side's
one-process step of the whole model (K=1) as the reference that separates
kernel speed from pipeline runtime. Ours and torch's runs alternate
(ours, torch, ours, torch): each side's figure is the median over its
rounds. torch is an optional extra (pip install '.[peers]', a CPU wheel);
without it the section says so and skips the peer rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from bench import common
from bench import report
from bench import stage_procs

K, M = 2, 8
TORCH_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            'torch_peer.py')
CONFIGS = ('k1', 'gpipe', '1f1b')
TORCH_MISSING = "torch not installed: pip install '.[peers]'"


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'net': common.NetSpec(4, 32, 32), 'reps': 1, 'rounds': 1}
  return {'net': common.NetSpec(16, 512, 1024), 'reps': 7, 'rounds': 2}


def have_torch() -> bool:
  return importlib.util.find_spec('torch') is not None


def _ours(net: common.NetSpec, reps: int) -> dict[str, Any]:
  dims = [net.num_layers, net.width, net.batch]
  configs = [{'name': 'k1', 'scope': 'local', 'tasks': [0], 'K': 1, 'M': M,
              'recompute': 'never', 'net': dims}] + [
                  {'name': s, 'scope': 'run', 'K': K, 'M': M, 'schedule': s,
                   'recompute': 'never', 'net': dims}
                  for s in ('gpipe', '1f1b')]
  run = stage_procs.launch({'configs': configs, 'warmup': 1, 'reps': reps,
                            'record': 2}, K)
  out = {'step_s': {c: stage_procs.median_step(run, c) for c in CONFIGS}}
  for c in CONFIGS:
    recs = stage_procs.median_by_span(stage_procs.records(run, c))
    out.setdefault('busy_s', {})[c] = [
        stage_procs.busy(recs, d, 1 if c == 'k1' else K)
        for d in range(1 if c == 'k1' else K)]
    out.setdefault('span_s', {})[c] = stage_procs.span(recs)
  return out


def _torch(net: common.NetSpec, reps: int) -> dict[str, Any]:
  """Two torch processes, pinned like ours; stopped by PID whatever
  happens."""
  port = stage_procs.free_port()
  with tempfile.TemporaryDirectory(prefix='lp_torch_') as tmp:
    procs, logs = [], []
    try:
      for rank in range(K):
        log = open(os.path.join(tmp, f'r{rank}.log'), 'w+')
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, TORCH_WORKER, f'--rank={rank}', f'--world={K}',
             f'--port={port}', f'--layers={net.num_layers}',
             f'--width={net.width}', f'--batch={net.batch}',
             f'--micro_batches={M}', f'--reps={reps}',
             f'--out={os.path.join(tmp, f"r{rank}.json")}'],
            stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda r=rank: os.sched_setaffinity(0, {r % 2})))
      for rank, proc in enumerate(procs):
        if proc.wait(timeout=stage_procs.TIMEOUT_S):
          logs[rank].seek(0)
          raise stage_procs.LaunchError(
              f'torch rank {rank} failed:\n{logs[rank].read()[-3000:]}')
    finally:
      for proc in procs:
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL)
          proc.wait()
      for log in logs:
        log.close()
    ranks = []
    for rank in range(K):
      with open(os.path.join(tmp, f'r{rank}.json')) as f:
        ranks.append(json.load(f))
  step = {}
  for c in CONFIGS:
    per_rank = [r['times_s'][c] for r in ranks if r['times_s'][c]]
    step[c] = statistics.median(max(ts) for ts in zip(*per_rank))
  return {'step_s': step, 'version': ranks[0]['torch']}


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  reps = args.reps or cfg['reps']
  ours, theirs = [], []
  torch_ok = have_torch()
  for i in range(cfg['rounds']):
    common.log(f'peer: round {i + 1}, ours ({cfg["net"].describe()})')
    ours.append(_ours(cfg['net'], reps))
    if torch_ok:
      common.log(f'peer: round {i + 1}, torch.distributed.pipelining')
      theirs.append(_torch(cfg['net'], reps))
  med = lambda runs, c: statistics.median(r['step_s'][c] for r in runs)
  out: dict[str, Any] = {
      'network': cfg['net'].describe(), 'rounds': cfg['rounds'],
      'reps': reps, 'ours': {c: med(ours, c) for c in CONFIGS},
      'ours_detail': ours[-1], 'torch': None,
      'torch_missing': None if torch_ok else TORCH_MISSING}
  if torch_ok:
    out['torch'] = {c: med(theirs, c) for c in CONFIGS}
    out['torch_version'] = theirs[0]['version']
  return out


def render(s: dict[str, Any]) -> str:
  o, t = s['ours'], s['torch']
  lines = [
      f'Network: {s["network"]}; K={K}, M={M}, no recompute, SGD; two '
      'processes, core 0 and core 1, one compute thread each. Medians of '
      f'{s["reps"]} alternating steps per run, then over {s["rounds"]} '
      'runs per side (ours and torch\'s runs alternate).',
      '']
  if t is None:
    lines += [f'_{s["torch_missing"]}; the peer rows are skipped._', '',
              report.table(['config', 'lingvo_pipe step (s)'],
                           [[c, o[c]] for c in CONFIGS])]
    return '\n'.join(lines)
  rows = [[c, o[c], t[c], o[c] / t[c]] for c in CONFIGS]
  rows += [[f'speed-up K=1 ÷ {c}', o['k1'] / o[c], t['k1'] / t[c], None]
           for c in ('gpipe', '1f1b')]
  lines += [
      report.table(['config', 'lingvo_pipe (s)',
                    f'torch {s.get("torch_version", "")} (s)',
                    'ours ÷ torch'], rows)]
  slower = [c for c in CONFIGS if o[c] > t[c]]
  if slower:
    lines += ['', _limits(s, slower)]
  return '\n'.join(lines)


def _limits(s: dict[str, Any], slower: list[str]) -> str:
  o, t, d = s['ours'], s['torch'], s['ours_detail']
  notes = [f'we are slower at {", ".join(slower)}']
  notes.append(
      f'one process alone, the same work takes {o["k1"] * 1e3:.0f} ms here '
      f'vs {t["k1"] * 1e3:.0f} ms in torch ({o["k1"] / t["k1"]:.2f}×: '
      'kernel speed and per-op dispatch, no pipelining involved)')
  for c in ('gpipe', '1f1b'):
    if c in slower:
      busy = d['busy_s'][c]
      notes.append(
          f'{c}: pipelining turns K=1 into {o["k1"] / o[c]:.2f}× here vs '
          f'{t["k1"] / t[c]:.2f}× in torch; our stages were busy '
          + ' and '.join(f'{b * 1e3:.0f} ms' for b in busy) +
          f' of a {d["span_s"][c] * 1e3:.0f} ms recorded span, the rest of '
          f'the {o[c] * 1e3:.0f} ms step is the update, the end-of-step '
          'all-reduce and dispatch')
  return '- What limits it: ' + '; '.join(notes) + '.'
