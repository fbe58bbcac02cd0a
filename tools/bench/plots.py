"""PNG plots of the JSON results (the timeline section draws its own)."""

from __future__ import annotations

import os
from typing import Any

FIDELITY_PNG = 'fidelity.png'
TABLE1_PNG = 'table1.png'
SCHEDULES_PNG = 'schedules_memory.png'


def _pyplot() -> Any:
  import matplotlib  # Late: only the plots need it.
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt
  return plt


def fidelity(s: dict[str, Any], path: str) -> None:
  """Measured vs predicted step per K and schedule (the last round)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.6))
  rows = s['rounds'][-1]['rows']
  for (k, schedule), marker in (((1, 'gpipe'), 'o'), ((1, '1f1b'), 'v'),
                                ((2, 'gpipe'), 's'), ((2, '1f1b'), 'D')):
    sel = [r for r in rows if r['K'] == k and r['schedule'] == schedule]
    if not sel:
      continue
    ms = [r['M'] for r in sel]
    line = ax.plot(ms, [r['measured_s'] for r in sel], marker + '-',
                   label=f'K={k} {schedule} measured')[0]
    ax.plot(ms, [r['predicted_s'] for r in sel], marker + '--',
            color=line.get_color(), alpha=0.6, label='predicted')
  ax.set_xlabel('micro-batches M')
  ax.set_ylabel('wall-clock step (s)')
  ax.set_ylim(bottom=0)
  ax.set_title('Simulator vs stage processes (last round)', fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def table1(s: dict[str, Any], path: str) -> None:
  plt = _pyplot()
  rows = s['rows']
  fig, ax = plt.subplots(figsize=(6, 3.6))
  ax.bar([r['name'] for r in rows], [r['max_layers'] for r in rows],
         color='#4C72B0')
  for i, r in enumerate(rows):
    ax.text(i, r['max_layers'], str(r['max_layers']), ha='center',
            va='bottom', fontsize=9)
  ax.set_ylabel('largest trainable layers')
  ax.set_title(f'Largest model within {s["budget_mib"]:g} MiB per process '
               '(TF allocator limit)', fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def schedules(s: dict[str, Any], path: str) -> None:
  """Activation peak of the fuller stage vs M, measured and predicted."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for schedule, recompute in (('gpipe', 'never'), ('1f1b', 'never'),
                              ('gpipe', 'always')):
    sel = [r for r in s['memory'] if (r['schedule'], r['recompute']) ==
           (schedule, recompute)]
    ms = sorted({r['M'] for r in sel})
    peak = [max(r['activation_mib'] for r in sel if r['M'] == m) for m in ms]
    sim = [max(r['predicted_mib'] for r in sel if r['M'] == m) for m in ms]
    line = ax.plot(ms, peak, 'o-', label=f'{schedule}, recompute '
                   f'{recompute}')[0]
    ax.plot(ms, sim, 's--', color=line.get_color(), alpha=0.6,
            label='predicted')
  ax.set_xlabel('micro-batches M (fixed micro-batch size)')
  ax.set_ylabel('activation peak, fuller stage (MiB)')
  ax.set_title('Activation memory per stage process, K=2', fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(out_dir: str, results: dict[str, Any]) -> list[str]:
  """Writes the plot of every section present; returns the paths."""
  written = []
  for key, fn, name in (('fidelity', fidelity, FIDELITY_PNG),
                        ('table1', table1, TABLE1_PNG),
                        ('schedules', schedules, SCHEDULES_PNG)):
    if key in results:
      path = os.path.join(out_dir, name)
      try:
        fn(results[key], path)
      except (KeyError, IndexError, TypeError):  # Written by an older tool.
        continue
      written.append(path)
  return written
