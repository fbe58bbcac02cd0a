"""One stage process of a test pipeline (tests/pipeline/test_stage_processes.py).

    python tests/pipeline/stage_proc.py --cluster_spec=worker=... --task=i \\
        --model=nested --num_stages=2 --num_micro_batches=2 --schedule=1f1b \\
        --out=/tmp/task_i.json

Builds one of the transparency stacks (tests/core/pipeline_stacks.py) as a
PipeliningLayer placed on the run's processes, takes its replica's slice of
the batch, runs one FPropLoss step under tf.function twice (the same step:
keys are reused), and writes the metrics, the gradients of its own
variables (by variable name) and its BatchNorm statistics as JSON.
"""

import json
import os
import sys

from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top,C0413
_startup.import_tensorflow(sys.argv)  # Without Keras's pyplot: less start-up.
from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))  # tests/: pipeline_stacks.

from lingvo_pipe.pipeline import processes  # pylint: disable=g-import-not-at-top

processes.define_flags()
_MODEL = flags.DEFINE_string('model', 'nested', 'A pipeline_stacks model.')
_NUM_STAGES = flags.DEFINE_integer('num_stages', 2, 'K.')
_M = flags.DEFINE_integer('num_micro_batches', 2, 'M of the global batch '
                          '(each of R replicas runs M ÷ R).')
_SCHEDULE = flags.DEFINE_string('schedule', 'gpipe', 'Schedule.')
_RECOMPUTE = flags.DEFINE_string('recompute', 'always', 'Policy.')
_COSTS = flags.DEFINE_string('costs', '', "'profile': p.costs='profile' "
                             '(each process profiles); else FPropMeta flops.')
_OUT = flags.DEFINE_string('out', '', 'Where the JSON goes.')
_TRAIN_STEPS = flags.DEFINE_integer(
    'train_steps', 0, 'Instead: train this many steps (pipeline_stacks.'
    'train: the trainer\'s clipping) and write the weights and norms.')
_GRAPH_OUT = flags.DEFINE_string('graph_out', '', 'Where the traced step\'s '
                                 'GraphDef goes (with its functions).')


def _step(net, inputs, labels, loss_fn):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core import fprop_context  # pylint: disable=g-import-not-at-top

  @tf.function(autograph=False)
  def step():
    collector = fprop_context.StatsCollector()
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=7, stats=collector):
        metrics = net.FPropLoss(net.theta, inputs, labels, loss_fn)
    grads = tape.gradient(metrics['loss'][0], net.trainable_variables)
    return metrics, grads, collector.stats
  return step


def main(argv):
  del argv
  with processes.start_from_flags() as peers:
    from lingvo_pipe.pipeline import placement  # pylint: disable=g-import-not-at-top
    placement.use(peers)
    import numpy as np  # pylint: disable=g-import-not-at-top
    import pipeline_stacks as stacks  # pylint: disable=g-import-not-at-top
    net, inputs = stacks.net(_MODEL.value, num_stages=_NUM_STAGES.value,
                             num_micro_batches=_M.value,
                             schedule=_SCHEDULE.value,
                             recompute=_RECOMPUTE.value,
                             costs=_COSTS.value or None)
    labels = stacks.loss_labels(_MODEL.value)
    replicas = peers.num_tasks // _NUM_STAGES.value
    r, n = peers.task // _NUM_STAGES.value, stacks.BATCH // replicas
    inputs = tuple(x[r * n:(r + 1) * n] for x in inputs)
    labels = labels.Transform(lambda x: x[r * n:(r + 1) * n])
    if _TRAIN_STEPS.value:
      with open(_OUT.value, 'w') as f:
        json.dump(stacks.train(net, inputs, labels, _TRAIN_STEPS.value), f)
      return
    step = _step(net, inputs, labels, stacks.weighted_loss)
    if _GRAPH_OUT.value:
      with open(_GRAPH_OUT.value, 'wb') as f:
        f.write(step.get_concrete_function().graph.as_graph_def()
                .SerializeToString())
    for _ in range(2):  # The same keys on every step.
      metrics, grads, stats = step()
    out = {
        'metrics': {k: [float(v[0]), float(v[1])] for k, v in
                    metrics.items()},
        'grads': {v.name: np.asarray(g).tolist() for v, g in
                  zip(net.trainable_variables, grads)},
        'stats': {k: {n: np.asarray(x).tolist() for n, x in s.items()}
                  for k, s in stats.items()},
        'num_variables': len(net.trainable_variables),
        'costs': list(net.plan.costs),
        'boundaries': list(net.plan.boundaries),
    }
    with open(_OUT.value, 'w') as f:
      json.dump(out, f)


if __name__ == '__main__':
  app.run(main)
