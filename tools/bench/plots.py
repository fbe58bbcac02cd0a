"""PNG plots of the JSON results (the timeline section draws its own)."""

from __future__ import annotations

import os
from typing import Any

THROUGHPUT_PNG = 'throughput.png'
FIDELITY_PNG = 'fidelity.png'
MEMORY_PNG = 'memory.png'


def _pyplot() -> Any:
  import matplotlib  # Late: only the plots need it.
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt
  return plt


def throughput(s: dict[str, Any], path: str) -> None:
  plt = _pyplot()
  ms = [r['M'] for r in s['rows']]
  fig, ax = plt.subplots(figsize=(6, 3.6))
  ax.plot(ms, [r['speedup'] for r in s['rows']], 'o-', label='measured')
  ax.plot(ms, [r['ideal'] for r in s['rows']], 's--',
          label=f'ideal C·M/(M+1), C={s["ceiling"]["ceiling"]:.2f}')
  ax.plot(ms, [2 * m / (m + 1) for m in ms], ':', color='gray',
          label='2·M/(M+1) (perfect cores)')
  ax.set_xscale('log', base=2)
  ax.set_xticks(ms, [str(m) for m in ms])
  ax.set_xlabel('micro-batches M')
  ax.set_ylabel('speed-up K=2 ÷ K=1')
  ax.set_title('Pipeline speed-up, K=2 ÷ K=1 (same M)', fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def fidelity(s: dict[str, Any], path: str) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for k, marker in ((1, 'o'), (2, 's')):
    rows = [r for r in s['rows'] if r['K'] == k]
    ms = [r['M'] for r in rows]
    line = ax.plot(ms, [r['measured_s'] for r in rows], marker + '-',
                   label=f'K={k} measured')[0]
    ax.plot(ms, [r['predicted_s'] for r in rows], marker + '--',
            color=line.get_color(), alpha=0.6, label=f'K={k} predicted')
  ax.set_xlabel('micro-batches M')
  ax.set_ylabel('step (s)')
  ax.set_ylim(bottom=0)
  ax.set_title('Simulator vs measured (calibrated on K=1 at M=1 and '
               'max M, and K=2 at M=1)', fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def memory(s: dict[str, Any], path: str) -> None:
  plt = _pyplot()
  rows = s['rows']
  fig, ax = plt.subplots(figsize=(6, 3.6))
  names = [r['name'] for r in rows]
  ax.bar(names, [r['max_layers'] for r in rows], color='#4C72B0')
  for i, r in enumerate(rows):
    ax.text(i, r['max_layers'], str(r['max_layers']), ha='center',
            va='bottom', fontsize=9)
  ax.set_ylabel('largest trainable layers')
  ax.set_title(f'Largest model within {s["budget_mib"]:g} MiB per device',
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(out_dir: str, results: dict[str, Any]) -> list[str]:
  """Writes the plot of every section present; returns the paths."""
  written = []
  for key, fn, name in (('throughput', throughput, THROUGHPUT_PNG),
                        ('fidelity', fidelity, FIDELITY_PNG),
                        ('memory', memory, MEMORY_PNG)):
    if key in results:
      path = os.path.join(out_dir, name)
      try:
        fn(results[key], path)
      except (KeyError, IndexError, TypeError):  # Written by an older tool.
        continue
      written.append(path)
  return written
