"""I + W ÷ B: what splitting a stage's backward costs (issue 25).

Zero-bubble schedules pay only if I (the input gradient) plus W (the
weight gradients, run later) cost what the fused backward B costs; a tape
asked twice would cost ~1.5 B. Each network here is one stage, timed in
this process on one core with single-threaded TF (as a stage process
runs), graph mode, each op its own `tf.function` call, the calls
alternating (B, I, W, B, I, W, ...) and summarised by medians:

* with recompute: B = stage.py's R+B body; I recomputes the forward too.
* without: F under a tape + B from that tape (one call, as stage.py runs a
  kept stage) against F keeping `saved`, then I, then W (three calls).

The four networks: the three test stacks of tests/pipeline_stacks.py
(conv+BN, Transformer, a skip connection), scaled up so that compute, not
the ~0.1 ms of a call, is what is timed, and 16 × FC 512 at batch 64.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import tensorflow as tf

from bench import common
from bench import report
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import conv
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import pooling
from lingvo_pipe.layers import shape
from lingvo_pipe.layers import transformer
from lingvo_pipe.pipeline import stage as stage_lib
from lingvo_pipe.pipeline.split_backward import SplitStage, Traced
from lingvo_pipe.pipeline.stage import Stage

TARGET = 1.1  # I + W ÷ B (the issue asks for about 1.0–1.1).
_FIRST = ['B', 'F+B kept', 'I', 'W', 'F saving', 'I saved']
DEVICE = '/device:CPU:0'


def _sequential(params: list[Any]) -> tuple[Any, Any]:
  """fprop and theta of layers run one after another."""
  layers = [p.Instantiate() for p in params]

  def _fprop(theta: Any, x: tuple[Any, ...]) -> tuple[Any, ...]:
    for layer, th in zip(layers, theta):
      out = layer.FProp(th, *x)
      x = out if isinstance(out, tuple) else (out,)
    return x
  return _fprop, [layer.theta for layer in layers]


def _mlp(tiny: bool) -> tuple[Any, Any, list[tf.TensorShape]]:
  n, width, batch = (2, 32, 8) if tiny else (16, 512, 64)
  fprop, theta = _sequential([linear.FCLayer.Params().Set(
      name=f'fc{i}', input_dim=width, output_dim=width, activation='RELU')
                              for i in range(n)])
  return fprop, theta, [[batch, width]]


def _conv_bn(tiny: bool) -> tuple[Any, Any, list[tf.TensorShape]]:
  batch, side, c = (2, 8, 4) if tiny else (32, 32, 32)
  fprop, theta = _sequential([
      conv.Conv2DLayer.Params().Set(name='c0', filter_shape=(3, 3, 8, c),
                                    activation='RELU'),
      normalization.BatchNormLayer.Params().Set(name='bn0', dim=c),
      conv.Conv2DLayer.Params().Set(name='c1', filter_shape=(3, 3, c, c),
                                    filter_stride=(2, 2)),
      normalization.BatchNormLayer.Params().Set(name='bn1', dim=c),
      pooling.PoolingLayer.Params().Set(name='pool'),
      shape.FlattenLayer.Params().Set(name='flat'),
      dropout.DropoutLayer.Params().Set(name='drop', dropout_rate=0.3),
      linear.FCLayer.Params().Set(name='fc', input_dim=(side // 4)**2 * c,
                                  output_dim=10)])
  return fprop, theta, [[batch, side, side, 8]]


def _transformer(tiny: bool) -> tuple[Any, Any, list[tf.TensorShape]]:
  batch, length, dim, n = (2, 4, 8, 1) if tiny else (16, 32, 128, 4)
  fprop, theta = _sequential([
      transformer.TransformerEncoderLayer.Params().Set(
          name=f'enc{i}', input_dim=dim, num_heads=4, hidden_dim=4 * dim,
          residual_dropout_prob=0.1) for i in range(n)])
  return fprop, theta, [[batch, length, dim], [batch, length]]


def _skip(tiny: bool) -> tuple[Any, Any, list[tf.TensorShape]]:
  """x → tanh FC × 6 → + x: the input carried past every layer."""
  batch, dim = (8, 16) if tiny else (64, 512)
  layers = [linear.FCLayer.Params().Set(
      name=f'fc{i}', input_dim=dim, output_dim=dim, activation='TANH')
            .Instantiate() for i in range(6)]

  def _fprop(theta: Any, x: tuple[Any, ...]) -> tuple[Any, ...]:
    h = x[0]
    for layer, th in zip(layers, theta):
      h = layer.FProp(th, h)
    return (h + x[0],)
  return _fprop, [layer.theta for layer in layers], [[batch, dim]]


NETWORKS = {'conv_bn': _conv_bn, 'transformer': _transformer,
            'skip': _skip, 'mlp_16x512': _mlp}


def _scope(m: Any, stats: Any, step: Any) -> Any:
  return fprop_context.scope(training=True, step=step, micro_batch_index=m,
                             stats=stats)


def _calls(fprop: Any, theta: Any, shapes: list[Any]
          ) -> tuple[dict[str, Callable[[], Any]], dict[str, float], Traced]:
  """The timed calls of one network, each a traced function, and the
  seconds of each one's first call (the first I traces the split)."""
  stage = Stage(fprop, theta, DEVICE)
  theta = tf.nest.map_structure(tf.convert_to_tensor, theta)
  x = tuple(tf.random.stateless_uniform(s, seed=[i, 1])
            for i, s in enumerate(shapes))
  with _scope(0, None, 0):
    y = fprop(theta, x)
  dys = [tf.random.stateless_normal(t.shape, seed=[9, 2], dtype=t.dtype)
         for t in stage_lib.float_leaves(y)]
  acc = tf.nest.map_structure(tf.zeros_like, theta)
  m, step = tf.constant(0), tf.constant(0, tf.int64)
  ops = stage_lib.StageBodies(stage, _scope, stage_lib.Clock(False))
  split = SplitStage(stage, _scope)
  calls: dict[str, Callable[[], Any]] = {}
  first: dict[str, float] = {}

  def _add(name: str, body: Callable[[], Any]) -> Any:
    calls[name] = tf.function(body, autograph=False)
    first[name] = common.first_call(calls[name])
    return calls[name]()

  def _kept_fused() -> Any:
    xk, yk, _, _, tape = ops.kept_forward(theta, x, None, [], m, step)
    return ops.kept_backward(tape, theta, xk, yk, dys, [], acc)[:2]

  # pylint: disable=protected-access
  _add('F', lambda: ops._forward(theta, x, None, [], m, step)[:2])
  _add('B', lambda: ops._backward(theta, x, None, dys, [], m, step, acc)[:2])
  # pylint: enable=protected-access
  _add('F+B kept', _kept_fused)
  kept = _add('I', lambda: split.input_grad(theta, x, None, dys, m, step))[1]
  saved = _add('F saving', lambda: split.forward(theta, x, None, m, step))[2]
  _add('W', lambda: split.weight_grad(theta, kept, acc))
  _add('I saved', lambda: split.input_grad_saved(theta, x, None, saved, dys))
  return calls, first, split.trace(theta, x)


def _interleaved(calls: dict[str, Callable[[], Any]],
                 reps: int) -> dict[str, float]:
  """Median wall seconds of each call, the calls alternating.

  A call of a traced function returns once it has run (eager execution is
  synchronous), so each is waited for by fetching its smallest output:
  fetching all of them (common.sync) copies every output to numpy, ~20 ms
  for I's 16 MiB of kept tensors, which B does not return.
  """
  times: dict[str, list[float]] = {name: [] for name in calls}
  for _ in range(reps):
    for name, call in calls.items():
      start = time.perf_counter()
      min(tf.nest.flatten(call()), key=lambda t: t.shape.num_elements()
         ).numpy()
      times[name].append(time.perf_counter() - start)
  return {name: common.median(t) for name, t in times.items()}


def _measure(name: str, tiny: bool, reps: int) -> dict[str, Any]:
  fprop, theta, shapes = NETWORKS[name](tiny)
  calls, first, traced = _calls(fprop, theta, shapes)
  times = _interleaved(calls, reps)
  return {'network': name, 'ms': {k: v * 1e3 for k, v in times.items()},
          'ratio': (times['I'] + times['W']) / times['B'],
          'ratio_kept': (times['F saving'] + times['I saved'] + times['W']) /
                        times['F+B kept'],
          'kept_bytes': traced.kept_bytes, 'saved_bytes': traced.saved_bytes,
          'first_call_s': first, 'whole': traced.whole,
          'split': traced.split, 'reason': traced.reason}


def _pin_one_core() -> str:
  """The last core this process may use, and single-threaded TF."""
  core = max(os.sched_getaffinity(0))
  os.sched_setaffinity(0, {core})
  try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
  except RuntimeError:
    common.log('split: TF already started; thread pools unchanged')
  return f'this process, pinned to core {core} (single-threaded TF)'


def run(args: argparse.Namespace) -> dict[str, Any]:
  reps = args.reps or (1 if args.tiny else 15)
  devices = ('this process' if args.tiny else _pin_one_core())
  rows = []
  for name in NETWORKS:
    common.log(f'split: {name}')
    start = time.time()
    rows.append(_measure(name, args.tiny, reps))
    common.log(f'split: {name} I + W ÷ B = {rows[-1]["ratio"]:.3f} '
               f'({time.time() - start:.0f} s)')
    common.release()
  targets = [report.target(f'I + W ÷ B, {r["network"]}', r['ratio'], '<=',
                           TARGET) for r in rows]
  return {'rows': rows, 'reps': reps, 'targets': targets, 'devices': devices}


def render(s: dict[str, Any]) -> str:
  rows = [[r['network'], r['ms']['F'], r['ms']['B'], r['ms']['I'],
           r['ms']['W'], r['ratio'], r['ms']['F+B kept'],
           r['ms']['F saving'] + r['ms']['I saved'] + r['ms']['W'],
           r['ratio_kept'], r['kept_bytes'] / 2**20, r['saved_bytes'] / 2**20]
          for r in s['rows']]
  lines = [
      f'One stage per network, one core, graph mode; medians of {s["reps"]} '
      'alternating calls (ms). B recomputes the forward (R+B); I recomputes '
      'it too. "kept": the forward keeps its activations (a tape for B; '
      'plain tensors, `saved`, for I).',
      '',
      report.table(['network', 'F', 'B (R+B)', 'I (R+I)', 'W', 'I + W ÷ B',
                    'F+B kept', 'F+I+W kept', 'ratio kept',
                    'kept MiB / micro-batch', 'saved MiB / micro-batch'],
                   rows),
      '',
      report.target_lines(s['targets']),
      '',
      'First call of each (s: tracing, graph optimisation, one run); the '
      'first I also traces the stage\'s split, which every later piece '
      'reuses:',
      '',
      report.table(['network'] + _FIRST, [
          [r['network']] + [r['first_call_s'][k] for k in _FIRST]
          for r in s['rows']]),
  ]
  whole = {r['network']: r['whole'] for r in s['rows'] if r['whole']}
  if whole:
    lines.append(f'- Taken whole (W re-runs their backward): {whole}.')
  unsplit = [r['network'] for r in s['rows'] if not r['split']]
  if unsplit:
    lines.append(f'- Not split (I computes dθ, W adds it): {unsplit}.')
  return '\n'.join(lines)
