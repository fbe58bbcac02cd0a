"""The memory preflight's prediction against the allocator's measured peak.

`lingvo_pipe.pipeline.memory.predict` gives each stage's peak bytes from
FPropMeta before a run. Here one GPipe training step of a PipeliningLayer
(the engine runs only GPipe today) is measured: TF's allocator peak
(`get_memory_info('CPU:0')['peak']` after `reset_memory_stats`, the BFC
allocator forced on by TF_CPU_ALLOCATOR_USE_BFC, set before TensorFlow
starts) minus what was allocated before the net was built: parameters,
gradients, input, activations, everything of that step.

Logical CPU devices share one allocator, so a per-stage figure needs the
stage alone in a process: for K=2 the measured stage runs on this (client)
process and the other on a TF worker process, then the other way round.
K=1 runs on the client alone. Each configuration's step runs once to warm
up, then `steps` times measured; the table gives min–max of the peaks (the
executor's op order varies from step to step).

A Transformer stack shows the model's known gap: FPropMeta counts a layer's
outputs, not the attention probabilities and feed-forward activations it
keeps for its backward.

Register in sections.py as ('Memory preflight', 0, this module); until then:

    python tools/bench/memory_preflight.py [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from bench import common  # pylint: disable=g-import-not-at-top
from bench import report  # pylint: disable=g-import-not-at-top
from lingvo_pipe.core import fprop_context  # pylint: disable=C0413
from lingvo_pipe.core import gpipe  # pylint: disable=C0413
from lingvo_pipe.layers import transformer  # pylint: disable=C0413
from lingvo_pipe.pipeline import cluster  # pylint: disable=C0413
from lingvo_pipe.pipeline import memory  # pylint: disable=C0413

MIB = 2**20


def sizes(tiny: bool) -> dict[str, Any]:
  if tiny:
    return {'fc': common.NetSpec(4, 64, 256), 'Ms': (1, 4), 'steps': 1,
            'tr': (2, 32, 16, 8)}
  # 4 MiB per activation, 1 MiB per weight matrix: well above the 256 KiB
  # under which TF's CPU allocator statistics miss allocations.
  return {'fc': common.NetSpec(8, 512, 2048), 'Ms': (1, 4, 16), 'steps': 3,
          'tr': (4, 256, 64, 32)}  # layers, D, T, batch.


def _peaks(build: Callable[[], tuple[Any, Callable[[], Any]]],
           steps: int) -> tuple[Any, list[float]]:
  """Builds a net and its step; the allocator peak of `steps` steps."""
  common.release()
  before = tf.config.experimental.get_memory_info('CPU:0')['current']
  net, step = build()
  common.sync(step())
  peaks = []
  for _ in range(steps):
    tf.config.experimental.reset_memory_stats('CPU:0')
    common.sync(step())
    peaks.append(tf.config.experimental.get_memory_info('CPU:0')['peak'] -
                 before)
  return net, peaks


def _row(name: str, net: Any, stage: int, m: int, recompute: str,
         input_bytes: int, peaks: list[float]) -> dict[str, Any]:
  pred = memory.predict(net.metas, net.boundaries, m,
                        input_bytes=input_bytes, recompute=recompute,
                        optimizer=None)  # The bench step is plain SGD.
  s = pred.stages[stage]
  return {'network': name, 'K': len(net.boundaries) - 1, 'stage': stage,
          'M': m, 'recompute': recompute,
          'predicted_mib': {f: getattr(s, f) / MIB
                            for f in memory.COMPONENTS},
          'predicted_total_mib': s.total / MIB,
          'measured_mib': [p / MIB for p in peaks],
          'ratio': s.total / max(peaks)}


def _fc(cfg: dict[str, Any], devices: list[str], stage: int, m: int,
        recompute: str) -> dict[str, Any]:
  spec = cfg['fc']

  def _build() -> tuple[Any, Callable[[], Any]]:
    net = common.pipeline_params(spec, len(devices), m, devices,
                                 recompute).Instantiate()
    return net, common.pipeline_step(net, common.make_input(spec,
                                                            devices[0]))

  net, peaks = _peaks(_build, cfg['steps'])
  row = _row(spec.describe(), net, stage, m, recompute,
             spec.batch * spec.width * 4, peaks)
  common.log(f'memory preflight: {row["network"]} K={row["K"]} stage '
             f'{stage} M={m} {recompute}: predicted '
             f'{row["predicted_total_mib"]:.1f} MiB, measured '
             f'{max(row["measured_mib"]):.1f} MiB')
  return row


def _transformer(cfg: dict[str, Any], device: str, m: int) -> dict[str, Any]:
  layers, d, t, batch = cfg['tr']
  params = [transformer.TransformerEncoderLayer.Params().Set(
      name=f'enc{i}', input_dim=d, num_heads=4, hidden_dim=4 * d)
            for i in range(layers)]

  def _build() -> tuple[Any, Callable[[], Any]]:
    net = gpipe.PipeliningLayer.Params().Set(
        name='net', layers=params, num_micro_batches=m, devices=[device],
        input_shapes=[[batch, t, d], [batch, t]]).Instantiate()
    with tf.device(device):
      x = tf.Variable(tf.ones([batch, t, d]), trainable=False)
      pad = tf.Variable(tf.zeros([batch, t]), trainable=False)
    variables = list(net.trainable_variables)

    @tf.function
    def _step() -> tf.Tensor:
      with tf.GradientTape() as tape:
        with fprop_context.scope(training=True, step=0):
          y, _ = net.FProp(net.theta, x, pad)
        loss = common.square_loss(y)
      common.sgd_update(variables, tape.gradient(loss, variables))
      return loss

    return net, _step

  net, peaks = _peaks(_build, cfg['steps'])
  name = f'{layers} × TransformerEncoder(D={d}, T={t}), batch {batch}'
  return _row(name, net, 0, m, 'always', batch * t * (d + 1) * 4, peaks)


def run(args: argparse.Namespace, devices: list[str]) -> dict[str, Any]:
  del devices  # Needs its own client/worker layout (see the module doc).
  cfg = sizes(args.tiny)
  cluster.pin_client([0])
  client = cluster.CLIENT_DEVICE
  rows = []
  for recompute in ('always', 'never'):
    for m in cfg['Ms']:
      rows.append(_fc(cfg, [client], 0, m, recompute))
  rows.append(_transformer(cfg, client, cfg['Ms'][1]))
  with cluster.LocalCluster(1, first_core=1) as workers:
    worker = workers.devices[0]
    for recompute in ('always', 'never'):
      for m in cfg['Ms'][1:]:
        rows.append(_fc(cfg, [client, worker], 0, m, recompute))
        rows.append(_fc(cfg, [worker, client], 1, m, recompute))
  ratios = [r['ratio'] for r in rows if 'Transformer' not in r['network']]
  return {'rows': rows, 'steps': cfg['steps'],
          'fc_ratio_range': [min(ratios), max(ratios)]}


def render(s: dict[str, Any]) -> str:
  fields = ('parameters', 'gradients', 'activations', 'workspace', 'io')
  rows = [[r['network'], r['K'], r['stage'], r['M'], r['recompute'],
           ' / '.join(f'{r["predicted_mib"][f]:.1f}' for f in fields),
           f'{r["predicted_total_mib"]:.1f}',
           f'{min(r["measured_mib"]):.1f}–{max(r["measured_mib"]):.1f}',
           f'{r["ratio"]:.2f}'] for r in s['rows']]
  lo, hi = s['fc_ratio_range']
  return '\n'.join([
      f'One GPipe training step (plain SGD: no optimizer slots), measured '
      f'{s["steps"]} times after a warm-up step; the measured stage alone in '
      'its process.', '',
      report.table(['network', 'K', 'stage', 'M', 'recompute',
                    'predicted MiB: params / grads / activations / '
                    'workspace / io', 'predicted total (MiB)',
                    'measured peak (MiB)', 'predicted ÷ measured (max)'],
                   rows), '',
      f'FC stack: predicted ÷ measured (max) from {lo:.2f} to {hi:.2f}.'])


if __name__ == '__main__':
  _parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  _parser.add_argument('--tiny', action='store_true')
  _section = run(_parser.parse_args(), [])
  print(json.dumps(_section))
  print(render(_section))
