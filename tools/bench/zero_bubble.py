"""Zero-bubble schedules beside 1F1B: step time, memory, and torch's.

ZB-H1 and ZB-V split each backward into I (the input gradient, which the
previous stage waits for) and W (the weight gradients, which nothing waits
for), and run W where 1F1B idles. On the `schedules` section's network,
K=2 stage processes, M=8 and 16, recompute never and always. Per round
and M, two launches in alternating order: 1F1B's, and zb_h1's and zb_v's in
alternation, each launch with the inter-op threads the trainer gives its
schedules (`processes.inter_op_threads_for`: one per core, one more for a
split backward); each records one step of each configuration.
torch.distributed.pipelining's 1F1B, `ScheduleInterleavedZeroBubble`
and `ScheduleZBVZeroBubble` (gloo, two processes pinned like ours) run on
the same network between our rounds.

Per configuration: the wall step (median of alternating steps, then over
rounds); the recorded step's span beside the simulator's prediction from
that step's own median F, R, B, I and W durations
(`timeline.calibrated_costs`): where they differ, the step left its
schedule (dispatch, transfers, noise); the activation peak per process
(allocator peak over one step − bytes before − one copy of the stage's
weights, as in `schedules`) beside the memory model's (`memory.predict`
with each layer's kept bytes, `split_backward.layer_bytes`).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench import common
from bench import peer
from bench import report
from bench import stage_procs

K = 2
MS = (8, 16)
RECOMPUTES = ('never', 'always')
SCHEDULES = ('1f1b', 'zb_h1', 'zb_v')
# torch's zero-bubble schedules beside ours (torch_peer.py's names).
TORCH = {'1f1b': '1f1b', 'zb_h1': 'zb_interleaved', 'zb_v': 'zb_v'}
TARGET_STEP = {'zb_v': 0.93, 'zb_h1': 0.97}
TARGET_PREDICTION, TARGET_MEMORY, TARGET_MODEL = 0.05, 1.1, 0.15
TARGET_TORCH = 0.9
MIB = 2**20


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    # One M (two launches): the CI budget.
    return {'net': common.NetSpec(4, 32, 32), 'reps': 1, 'rounds': 1,
            'ms': MS[:1]}
  return {'net': common.NetSpec(16, 512, 1024), 'reps': 7, 'rounds': 3,
          'ms': MS}


def _name(schedule: str, recompute: str, m: int) -> str:
  return f'{schedule} {recompute} M={m}'


def _ours(net: common.NetSpec, reps: int, ms: tuple[int, ...],
          first_split: bool) -> dict[str, dict[str, Any]]:
  """Launches per M (a transfer's collective instance keeps its shape for
  the process's life, and M changes the micro-batch's) and per thread
  count (1F1B's, the split schedules'): every configuration, timed,
  recorded, memory measured."""
  from lingvo_pipe.pipeline import schedule as schedule_lib  # pylint: disable=C0415
  groups = [tuple(s for s in SCHEDULES
                  if schedule_lib.splits_backward(s) == split)
            for split in (False, True)]
  out = {}
  for m in ms:
    for schedules in groups[::-1] if first_split else groups:
      out.update(_launch(net, reps, m, schedules))
  return out


def _launch(net: common.NetSpec, reps: int, m: int,
            schedules: tuple[str, ...]) -> dict[str, dict[str, Any]]:
  from lingvo_pipe.pipeline import schedule as schedule_lib  # pylint: disable=C0415
  from lingvo_pipe.pipeline import simulator  # pylint: disable=C0415
  from lingvo_pipe.pipeline import step_gaps  # pylint: disable=C0415
  from lingvo_pipe.pipeline import timeline  # pylint: disable=C0415
  configs = [{'name': _name(s, r, m), 'scope': 'run', 'K': K, 'M': m,
              'schedule': s, 'recompute': r,
              'net': [net.num_layers, net.width, net.batch]}
             for r in RECOMPUTES for s in schedules]
  run = stage_procs.launch({'configs': configs, 'warmup': 1, 'reps': reps,
                            'record': 1, 'memory': True}, K)
  out = {}
  for c in configs:
    measured = timeline.normalized(stage_procs.median_by_span(
        stage_procs.records(run, c['name'])))
    predicted = simulator.simulate(timeline.calibrated_costs(measured),
                                   c['M'], c['recompute'], c['schedule'])
    with_gaps = step_gaps.predicted_with_gaps(
        measured, schedule_lib.make_schedule(c['schedule'], K, c['M'],
                                             c['recompute']))
    mem = []
    for task, result in enumerate(run.config(c['name'])):
      got = result['memory']
      pred = got['predicted'][task]
      mem.append((got['peak_bytes'] - got['before_bytes'] -
                  got['param_bytes'], pred['activation_bytes'] +
                  pred['workspace_bytes'] + pred['transfer_bytes']))
    out[c['name']] = {
        'step_s': stage_procs.median_step(run, c['name']),
        'span_s': stage_procs.span(measured),
        'predicted_s': predicted.step_time,
        'predicted_gaps_s': with_gaps.step_time,
        'activation_mib': [a / MIB for a, _ in mem],
        'predicted_mib': [p / MIB for _, p in mem]}
  return out


def run(args: argparse.Namespace) -> dict[str, Any]:
  cfg = sizes(args.tiny)
  reps = args.reps or cfg['reps']
  rounds, theirs = [], []
  torch_ok = peer.have_torch()
  for i in range(cfg['rounds']):
    common.log(f'zero_bubble: round {i + 1}, ours ({cfg["net"].describe()})')
    rounds.append(_ours(cfg['net'], reps, cfg['ms'], bool(i % 2)))
    if torch_ok:
      for m in cfg['ms']:
        common.log(f'zero_bubble: round {i + 1}, torch M={m}')
        theirs.append((m, peer._torch(  # pylint: disable=protected-access
            cfg['net'], reps, m, tuple(TORCH.values()))))
  names = list(rounds[0])
  out: dict[str, Any] = {
      'network': cfg['net'].describe(), 'reps': reps, 'ms': cfg['ms'],
      'rounds': rounds,
      'step_s': {n: statistics.median(r[n]['step_s'] for r in rounds)
                 for n in names},
      'torch': None, 'torch_missing': None if torch_ok else peer.TORCH_MISSING}
  if torch_ok:
    out['torch'] = {f'{c} M={m}': statistics.median(
        t['step_s'][c] for mm, t in theirs if mm == m)
                    for m in cfg['ms'] for c in TORCH.values()}
    out['torch_version'] = theirs[0][1]['version']
  out['targets'] = _targets(out)
  return out


def _targets(s: dict[str, Any]) -> list[dict[str, Any]]:
  rounds, m = s['rounds'], MS[0]
  one = _name('1f1b', 'never', m)
  out = []
  for z, limit in TARGET_STEP.items():
    mine = _name(z, 'never', m)
    worst = max(r[mine]['step_s'] / r[one]['step_s'] for r in rounds)
    out.append(report.target(
        f'{z} step ÷ 1F1B, K={K}, M={m}, recompute never, worst of '
        f'{len(rounds)} round(s)', worst, '<=', limit))
  for z in TARGET_STEP:
    row = rounds[-1][_name(z, 'never', m)]
    out.append(report.target(
        f'{z}: |predicted ÷ measured span − 1|, M={m}, recompute never '
        '(the step\'s op durations and gaps)',
        abs(row['predicted_gaps_s'] / row['span_s'] - 1), '<=',
        TARGET_PREDICTION, ''))
  for z in TARGET_STEP:
    for mm in s['ms']:
      ratio = (max(rounds[-1][_name(z, 'never', mm)]['activation_mib']) /
               max(max(rounds[-1][_name('1f1b', 'never', mm)]
                       ['activation_mib']), 1e-9))
      out.append(report.target(
          f'{z} peak activation memory ÷ 1F1B, M={mm}, recompute never',
          ratio, '<=', TARGET_MEMORY))
  worst = max(abs(p / max(a, 1e-9) - 1)
              for n, row in rounds[-1].items() if ' always ' in n
              and not n.startswith('1f1b')
              for a, p in zip(row['activation_mib'], row['predicted_mib']))
  out.append(report.target(
      'zero bubble with recompute: worst |memory model ÷ measured − 1|',
      worst, '<=', TARGET_MODEL, ''))
  if s['torch']:
    for z in TARGET_STEP:
      out.append(report.target(
          f'{z} ÷ torch {TORCH[z]}, M={m}, recompute never',
          s['step_s'][_name(z, 'never', m)] / s['torch'][f'{TORCH[z]} M={m}'],
          '<=', TARGET_TORCH))
  return out


def render(s: dict[str, Any]) -> str:
  last = s['rounds'][-1]
  rows = []
  for name, step in s['step_s'].items():
    sched, recompute, m = name.split()
    row = last[name]
    torch_s = (s['torch'] or {}).get(f'{TORCH[sched]} {m}') \
        if recompute == 'never' else None
    rows.append([sched, recompute, m[2:], step,
                 step / s['step_s'][_name('1f1b', recompute, int(m[2:]))],
                 row['span_s'], row['predicted_s'],
                 row.get('predicted_gaps_s', '–'),
                 ' / '.join(f'{a:.2f}' for a in row['activation_mib']),
                 ' / '.join(f'{p:.2f}' for p in row['predicted_mib']),
                 torch_s if torch_s is not None else '–'])
  lines = [
      f'Network: {s["network"]}; K={K} stage processes (core 0, core 1), '
      f'SGD; 1F1B and the split schedules in launches of their own, each '
      'with the trainer\'s inter-op threads (one per core; one more for a '
      f'split backward). Wall step: median of {s["reps"]} alternating steps, '
      f'then over {len(s["rounds"])} round(s). Span and prediction: one recorded '
      'step; predicted by the simulator from that step\'s own median F, R, '
      'B, I and W durations, and "with gaps" also from its mean dispatch '
      'and hand-off gaps (`step_gaps.predicted_with_gaps`). Activations '
      'per process (stage 0 / 1): allocator peak − bytes before − one '
      'copy of the weights; predicted: '
      'the memory model with each layer\'s kept bytes. torch: '
      '`Schedule1F1B`, `ScheduleInterleavedZeroBubble` with one stage per '
      'rank (ZB1P, i.e. ZB-H1) and `ScheduleZBVZeroBubble` (two per rank '
      'in a V), no recompute, the same network, between our rounds.', '',
      report.table(['schedule', 'recompute', 'M', 'step (s)', '÷ 1F1B',
                    'span (s)', 'predicted (s)', 'with gaps (s)',
                    'activations (MiB)',
                    'predicted (MiB)', 'torch step (s)'], rows), '']
  if s['torch'] is None:
    lines += [f'_{s["torch_missing"]}; the peer column is empty._', '']
  lines.append(report.target_lines(s['targets']))
  alone = [last[_name(z, 'never', MS[0])] for z in ('1f1b', *TARGET_STEP)]
  lines.append(
      '- From op durations alone (no gaps), |predicted ÷ measured span − 1| '
      f'at M={MS[0]}, recompute never: ' + ', '.join(
          f'{z} {abs(r["predicted_s"] / r["span_s"] - 1):.3f}'
          for z, r in zip(('1f1b', *TARGET_STEP), alone)) + '.')
  return '\n'.join(lines)
