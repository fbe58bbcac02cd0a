"""The simulator at scale, on paper: K stages × R replicas on a described
cluster, beside GPipe's Table 2 and torchgpipe's speed-ups.

Nothing runs here: every figure comes from `simulator.simulate` (GPipe
schedule, recompute always) with transfers and all-reduces priced by
`links.Cluster`, for a stack of identical Transformer layers. The
assumptions are data (`ASSUMPTIONS`), printed with the tables.

Throughput = R × M × micro-batch ÷ step, where the step ends when the last
stage's gradient all-reduce over its R replicas ends (a ring over tasks
s, K+s, …; with ≥ 8 stages per replica those sit on R different hosts).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from bench import reference
from bench import report
from lingvo_pipe.pipeline import links
from lingvo_pipe.pipeline import simulator

D_MODEL, D_FF, SEQ = 1024, 4096, 512
BYTES = 4  # float32 activations and gradients.
ASSUMPTIONS = {
    'layer': f'Transformer layer, d_model {D_MODEL}, d_ff {D_FF}, '
             f'{SEQ} tokens per example, float32',
    'forward_flops_per_example': 2 * SEQ * (4 * D_MODEL**2 +
                                            2 * D_MODEL * D_FF) +
                                 4 * SEQ**2 * D_MODEL,
    'param_bytes_per_layer': (4 * D_MODEL**2 + 2 * D_MODEL * D_FF) * BYTES,
    'boundary_bytes_per_example': SEQ * D_MODEL * BYTES,
    'micro_batch': 8,
    'device_flops': 50e12,  # e.g. a 125 TFLOP/s accelerator at 40%.
    'devices_per_host': 8,
    'inside': links.Link(1.2e12, 5e-6),  # NVLink-class, 150 GB/s.
    'between': links.Link(100e9, 10e-6),  # One 100 Gbit/s NIC per host.
}
TABLE2_LAYERS = 48  # Transformer-48's depth; one host of 8 devices.
SCALE_LAYERS = 128
SCALE_STAGES = (8, 16, 32, 64)
SCALE_REPLICAS = (1, 2, 4, 8, 16, 32, 64)
SLOW_BETWEEN = links.Link(10e9, 10e-6)  # 10 Gbit/s Ethernet between hosts.


@functools.lru_cache(maxsize=None)
def _pipeline(layers: int, k: int, m: int, between: links.Link
              ) -> tuple[tuple[float, ...], float]:
  """(when each stage's last op ends, its gradients' bytes) for one
  replica of K equal stages; R does not change it (replica r's hops are
  replica 0's: K is a multiple of the devices per host, or one host)."""
  a = ASSUMPTIONS
  n = a['micro_batch']
  per_stage = layers / k
  boundary = a['boundary_bytes_per_example'] * n
  stages = [simulator.StageCost(
      forward=per_stage * a['forward_flops_per_example'] * n /
      a['device_flops'], boundary_bytes=boundary,
      param_bytes=per_stage * a['param_bytes_per_layer'])] * k
  result = simulator.simulate(
      stages, m, 'always', 'gpipe', transfer_time=_cluster(
          k, between).transfer_time_fn([boundary] * k))
  ends = tuple(max(e.end for e in result.events if e.stage == s)
               for s in range(k))
  return ends, stages[0].param_bytes


def _cluster(num_devices: int, between: links.Link) -> links.Cluster:
  per_host = ASSUMPTIONS['devices_per_host']
  return links.Cluster(max(1, math.ceil(num_devices / per_host)), per_host,
                       ASSUMPTIONS['inside'], between)


def throughput(layers: int, k: int, m: int, r: int,
               between: links.Link | None = None) -> float:
  """Examples per second of K stages × R replicas (see module doc)."""
  between = between or ASSUMPTIONS['between']
  ends, grads = _pipeline(layers, k, m, between)
  step = links.step_with_all_reduce(ends, [grads] * k,
                                    _cluster(k * r, between), r)
  return r * m * ASSUMPTIONS['micro_batch'] / step


def predictions(tiny: bool = False) -> dict[str, Any]:
  """Table 2's cells (K=2, 4, 8 × M=1, 4, 32) and the scale-out grids,
  one per link between hosts (`tiny`: K ≤ 16, R ≤ 4)."""
  base = throughput(TABLE2_LAYERS, 2, 1, 1)
  table2 = [{'K': k, 'M': m,
             'predicted': throughput(TABLE2_LAYERS, k, m, 1) / base,
             'gpipe_transformer': reference.GPIPE_TRANSFORMER[(k, m)],
             'gpipe_amoebanet': reference.GPIPE_AMOEBANET[(k, m)],
             'torchgpipe_p40': reference.TORCHGPIPE_P40[(k, m)]}
            for m in reference.PAPER_MICRO_BATCHES
            for k in reference.PAPER_STAGES]
  a = ASSUMPTIONS
  ideal_per_device = a['device_flops'] / (
      3 * a['forward_flops_per_example'] * SCALE_LAYERS)  # F + B, no R.
  stages = SCALE_STAGES[:2] if tiny else SCALE_STAGES
  replicas = SCALE_REPLICAS[:3] if tiny else SCALE_REPLICAS
  grids = []
  for between in (a['between'], SLOW_BETWEEN):
    first = throughput(SCALE_LAYERS, stages[0], 4 * stages[0], 1, between)
    grids.append({'between': between.describe(), 'cells': [
        {'K': k, 'R': r, 'M': 4 * k, 'speedup': t / first,
         'efficiency': t / (k * r * ideal_per_device)}
        for k in stages for r in replicas
        for t in [throughput(SCALE_LAYERS, k, 4 * k, r, between)]]})
  return {'table2': table2, 'grids': grids, 'assumptions': {
      key: (v.describe() if isinstance(v, links.Link) else v)
      for key, v in a.items()}}


def render(p: dict[str, Any]) -> str:
  a = p['assumptions']
  gib = lambda x: f'{x / 2**20:.3g} MiB'
  grids = []
  for g in p['grids']:
    cells = {(c['K'], c['R']): c for c in g['cells']}
    ks = sorted({c['K'] for c in g['cells']})
    rs = sorted({c['R'] for c in g['cells']})
    grids += ['', f'Between hosts {g["between"]}:', '', report.table(
        ['K \\ R'] + [str(r) for r in rs],
        [[k] + [f'{cells[(k, r)]["speedup"]:.3g}× '
                f'({100 * cells[(k, r)]["efficiency"]:.0f}%)' for r in rs]
         for k in ks])]
  return '\n'.join([
      '**On paper: the simulator at scale.** Assumptions: '
      f'{a["layer"]}: {a["forward_flops_per_example"] / 1e9:.3g} GFLOP '
      'forward per example and layer (backward 2×, recompute 1×), '
      f'{gib(a["param_bytes_per_layer"])} of gradients per layer, a '
      f'boundary of {gib(a["boundary_bytes_per_example"])} per example; '
      f'micro-batches of {a["micro_batch"]} examples; devices of '
      f'{a["device_flops"] / 1e12:g} TFLOP/s effective, '
      f'{a["devices_per_host"]} per host; links inside a host '
      f'{a["inside"]}, between hosts {a["between"]}; stage s of replica r '
      'on device r·K + s; GPipe schedule; each stage\'s gradients '
      'all-reduced over its R replicas (ring) after its last backward; '
      'transfers and all-reduces never share a link.',
      '',
      f'{TABLE2_LAYERS} layers on one host, normalized to K=2, M=1 as the '
      'papers are (micro-batch size fixed; GPipe varied the batch to fit '
      'memory):',
      '',
      report.table(['M', 'K', 'predicted', 'GPipe Transformer (TPU)',
                    'GPipe AmoebaNet (TPU)', 'torchgpipe (P40)'],
                   [[t['M'], t['K'], t['predicted'], t['gpipe_transformer'],
                     t['gpipe_amoebanet'], t['torchgpipe_p40']]
                    for t in p['table2']]),
      '',
      f'{SCALE_LAYERS} layers, M = 4K, on ⌈K·R ÷ '
      f'{a["devices_per_host"]}⌉ hosts: throughput relative to the first '
      'cell (and its share of K·R devices\' compute, F + B; recompute caps '
      'it at 75%, the bubble (K−1)/(M+K−1) takes ~20% more):',
  ] + grids)
