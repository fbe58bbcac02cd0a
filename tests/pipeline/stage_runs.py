"""Runs a transparency stack on stage processes, and its one-process twin.

`run` starts K·R real processes on 127.0.0.1 (stage_proc.py), one per stage
and replica, that run one FPropLoss step and write what they computed (or
the GraphDef of the step they traced); `reference` computes the same step
in this process. Shared by test_stage_processes.py and test_engine.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import fprop_context

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order
import runtime_procs  # pylint: disable=g-bad-import-order

_PROC = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                     'stage_proc.py')


def reference(model, num_stages, num_micro_batches, schedule, recompute):
  """(metrics, gradients by variable name, statistics, float64 gradients)
  of one step in this process."""
  net, inputs = stacks.net(model, num_stages=num_stages,
                           num_micro_batches=num_micro_batches,
                           schedule=schedule, recompute=recompute)
  labels = stacks.loss_labels(model)

  @tf.function(autograph=False)
  def step():
    collector = fprop_context.StatsCollector()
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=7, stats=collector):
        metrics = net.FPropLoss(net.theta, inputs, labels,
                                stacks.weighted_loss)
    grads = tape.gradient(metrics['loss'][0], net.trainable_variables)
    return metrics, grads, collector.stats

  # The float64 leg: the same layers computing in float64 on net.theta, in
  # one stage, so float32 rounding can be told from a pipeline error.
  twin = stacks.float64_twin(net)

  @tf.function(autograph=False)
  def step64():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=7):
        loss = twin.FPropLoss(net.theta, inputs, labels,
                              stacks.weighted_loss)['loss'][0]
    return tape.gradient(loss, net.trainable_variables)

  metrics, grads, stats = step()
  variables = net.trainable_variables
  return ({k: [float(v[0]), float(v[1])] for k, v in metrics.items()},
          {v.name: np.asarray(g) for v, g in zip(variables, grads)},
          {k: {n: np.asarray(x) for n, x in s.items()}
           for k, s in stats.items()},
          {v.name: np.asarray(g) for v, g in zip(variables, step64())})


def run(tmp_path, model, k, r, m, schedule, recompute, costs='',
        graphs=False, extra=()):
  """Each task's JSON results, or (`graphs`) each task's traced GraphDef.

  `m` is each replica's M (the global batch has r · m micro-batches);
  `schedule` is a name or a schedule's text; `extra`: more stage_proc.py
  flags (--train_steps=N: train N steps and write weights and norms).
  """
  flags = [f'--model={model}', f'--num_stages={k}',
           f'--num_micro_batches={r * m}',  # Of the global batch.
           f'--schedule={schedule}', f'--recompute={recompute}',
           f'--costs={costs}', *extra]
  cluster = runtime_procs.spec(runtime_procs.free_ports(k * r))
  outs = [tmp_path / f'task{t}.json' for t in range(k * r)]
  graph_outs = [tmp_path / f'task{t}.graph' for t in range(k * r)]
  with runtime_procs.Tasks(tmp_path) as tasks:
    for t in range(k * r):
      graph = [f'--graph_out={graph_outs[t]}'] if graphs else []
      tasks.start([_PROC, f'--cluster_spec={cluster}', f'--task={t}',
                   f'--out={outs[t]}'] + flags + graph, f'task{t}')
    codes = [proc.wait(timeout=runtime_procs.TIMEOUT_S)
             for proc in tasks.procs]
    # Every task's end: the first to fail is often not the first listed.
    assert codes == [0] * len(codes), [
        (t, code, tasks.output(t)[1][-2000:]) for t, code in enumerate(codes)
        if code]
  if graphs:
    out = []
    for path in graph_outs:
      graph_def = tf.compat.v1.GraphDef()
      graph_def.ParseFromString(path.read_bytes())
      out.append(graph_def)
    return out
  return [json.loads(p.read_text()) for p in outs]
