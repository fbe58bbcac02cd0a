"""What wrapping a Keras model costs: KerasCnn's network, two ways (issue 28).

The network of `image.fashion_mnist.KerasCnn` (((conv 3×3 → BatchNorm) × 2
→ max-pool) × 2, dropout, dense) is pipelined twice, K=2, M=4, with the
same cut, in one process on 2 logical CPU devices:

* as Keras wrote it: the Keras layers through `from_keras` (KerasLayer:
  each Keras layer's `__call__` in a StatelessScope);
* as the same network written with lingvo_pipe layers (Conv2DLayer,
  BatchNormLayer, PoolingLayer, FlattenLayer, DropoutLayer, FCLayer), with
  the Keras model's weights copied in.

Both train the same: their losses agree (printed beside the times; the
dropout layers have the same path, so the same masks). The training steps
(FPropLoss, gradients, SGD, BatchNorm folded) are timed in alternation;
the target is wrapped ÷ native ≤ 1.1×.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import tensorflow as tf

from bench import common
from bench import report
from lingvo_pipe import keras as lp_keras
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import conv
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import pooling
from lingvo_pipe.layers import shape
from lingvo_pipe.params.image import fashion_mnist
from lingvo_pipe.pipeline import devices as devices_lib

K, M = 2, 4
TARGET = 1.1


def sizes(tiny: bool) -> tuple[int, tuple[int, int], int, int]:
  """(image size, filters, batch, timed repetitions)."""
  if tiny:
    return 8, (4, 8), 16, 1
  return 28, (32, 64), 128, 20


def _native(layer: Any) -> tuple[Any, dict[str, Any]]:
  """The lingvo_pipe layer Params of a Keras layer, and its weights."""
  kind, cfg, name = type(layer).__name__, layer.get_config(), layer.name
  if kind == 'Conv2D':
    act = {'relu': 'RELU', 'linear': 'NONE'}[cfg['activation']]
    return conv.Conv2DLayer.Params().Set(
        name=name, filter_shape=tuple(layer.kernel.shape),
        padding=cfg['padding'].upper(), activation=act), {
            'w': layer.kernel, 'b': layer.bias}
  if kind == 'BatchNormalization':
    return normalization.BatchNormLayer.Params().Set(
        name=name, dim=layer.gamma.shape[0], decay=cfg['momentum'],
        epsilon=cfg['epsilon']), {
            'gamma': layer.gamma, 'beta': layer.beta,
            'moving_mean': layer.moving_mean,
            'moving_variance': layer.moving_variance}
  if kind == 'MaxPooling2D':
    return pooling.PoolingLayer.Params().Set(
        name=name, window_shape=tuple(cfg['pool_size']),
        window_stride=tuple(cfg['strides']),
        padding=cfg['padding'].upper()), {}
  if kind == 'Flatten':
    return shape.FlattenLayer.Params().Set(name=name), {}
  if kind == 'Dropout':
    return dropout.DropoutLayer.Params().Set(
        name=name, dropout_rate=cfg['rate']), {}
  if kind == 'Dense':
    return linear.FCLayer.Params().Set(
        name=name, input_dim=layer.kernel.shape[0],
        output_dim=cfg['units']), {'w': layer.kernel, 'b': layer.bias}
  raise common.BenchError(f'keras: no lingvo_pipe twin for {kind}')


def _nets(image: int, filters: tuple[int, int], batch: int,
          devices: list[str]) -> dict[str, Any]:
  """{'wrapped Keras': net, 'lingvo_pipe layers': net}, same cut."""
  model = fashion_mnist.keras_cnn(image, filters)
  common_params = dict(num_stages=K, num_micro_batches=M, devices=devices,
                       input_shapes=[[batch, image, image, 1]])
  wrapped = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=lp_keras.from_keras(model),
      **common_params).Instantiate()
  twins = [_native(layer) for layer in model.layers]
  native = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=[p for p, _ in twins],
      split_points=wrapped.boundaries[1:-1], **common_params).Instantiate()
  for layer, (_, weights) in zip(native.children.layers, twins):
    for key, value in weights.items():
      layer.vars[key].assign(np.asarray(value.value))
  return {'wrapped Keras': wrapped, 'lingvo_pipe layers': native}


def _loss(logits: tf.Tensor, labels: tf.Tensor) -> dict[str, Any]:
  ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  return {'loss': (tf.reduce_mean(ce), tf.cast(tf.size(ce), tf.float32))}


def _train_step(net: Any, x: tf.Variable, labels: tf.Tensor) -> Any:
  """The trainer's step: FPropLoss, gradients, SGD, BatchNorm folded."""
  variables = list(net.trainable_variables)

  @tf.function(autograph=False)
  def _step() -> tf.Tensor:
    collector = fprop_context.StatsCollector()
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=1, stats=collector):
        loss = net.FPropLoss(net.theta, (x,), labels, _loss)['loss'][0]
    common.sgd_update(variables, tape.gradient(loss, variables))
    net.UpdateStats(collector.stats)
    return loss

  return _step


def run(args: argparse.Namespace) -> dict[str, Any]:
  image, filters, batch, reps = sizes(args.tiny)
  reps = args.reps or reps
  devices_lib.configure_logical_cpus(K)
  devices = devices_lib.default_devices(K)
  nets = _nets(image, filters, batch, devices)
  with tf.device(devices[0]):
    x = tf.Variable(tf.random.stateless_normal([batch, image, image, 1],
                                               seed=[5, 0]), trainable=False)
  labels = tf.range(batch) % 10
  steps = {name: _train_step(net, x, labels) for name, net in nets.items()}
  first = {name: common.first_call(fn) for name, fn in steps.items()}
  losses = {name: float(fn()) for name, fn in steps.items()}
  common.log(f'keras: {reps} alternating steps of each')
  times = common.interleaved(steps, reps)
  step = {name: common.median(t) for name, t in times.items()}
  ratio = step['wrapped Keras'] / step['lingvo_pipe layers']
  cut = nets['wrapped Keras'].boundaries
  return {
      'network': (f'KerasCnn\'s network, {image}×{image} images, filters '
                  f'{filters}, batch {batch}, K={K}, M={M}, cut {cut}'),
      'rows': [{'network': name, 'first_s': first[name], 'step_s': step[name],
                'loss': losses[name]} for name in steps],
      'ratio': ratio, 'reps': reps,
      'targets': [report.target('wrapped Keras ÷ lingvo_pipe layers, step '
                                'time', ratio, '<=', TARGET)],
      'devices': 'this process, 2 logical CPU devices (K=2) sharing its '
                 'cores; the two networks alternate step by step',
  }


def render(s: dict[str, Any]) -> str:
  lines = [
      f'Network: {s["network"]}; the training step (FPropLoss, gradients, '
      f'SGD, BatchNorm folded); median of {s["reps"]} alternating steps.',
      '',
      report.table(['network', 'first call (s)', 'step (s)',
                    'loss of the 2nd step'],
                   [[r['network'], r['first_s'], r['step_s'],
                     f'{r["loss"]:.6f}'] for r in s['rows']]),
      '',
      report.target_lines(s['targets']),
  ]
  if not s['targets'][0]['met']:
    lines.append('- What limits it: the wrapped step runs Keras\'s ops '
                 '(its BatchNormalization upcasts and normalises through '
                 'keras.ops, its Conv2D and Dense add their own casts and '
                 'reshapes) where the native layers call tf.nn directly.')
  return '\n'.join(lines)
