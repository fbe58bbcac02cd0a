"""One stage process of the activation-memory test (test_stage_processes.py).

    python tests/pipeline/memory_proc.py --cluster_spec=worker=... --task=i \\
        --out=/tmp/task_i.json

For each schedule and M, a K=2 pipeline of FC layers (recompute off, the
loss inside the pipeline) runs a training step twice; a third step is
measured by TF's allocator: its peak minus the bytes in use before it. The
micro-batch is fixed, so the batch grows with M. Writes
{"<schedule> <M>": bytes, ...} as JSON.
"""

import json
import os
import sys

# The allocator's statistics need TF's BFC allocator on the CPU too; it must
# be chosen before TensorFlow starts.
os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top,C0413
_startup.import_tensorflow(sys.argv)  # Without Keras's pyplot: less start-up.
from absl import app  # pylint: disable=g-import-not-at-top,C0413
from absl import flags  # pylint: disable=g-import-not-at-top,C0413

from lingvo_pipe.pipeline import processes  # pylint: disable=C0413

processes.define_flags()
_OUT = flags.DEFINE_string('out', '', 'Where the JSON goes.')

WIDTH = 256  # One layer's output per micro-batch: MICRO × WIDTH × 4 bytes.
MICRO = 256
LAYERS = 8
CASES = (('1f1b', 4), ('1f1b', 16), ('gpipe', 4), ('gpipe', 16))


def _growth(tf, peers, schedule, m):
  from lingvo_pipe.core import fprop_context  # pylint: disable=C0415
  from lingvo_pipe.core import gpipe  # pylint: disable=C0415
  from lingvo_pipe.layers import linear  # pylint: disable=C0415
  batch = MICRO * m
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', num_stages=2, num_micro_batches=m, schedule=schedule,
      recompute='never', input_shapes=[[batch, WIDTH]],
      layers=[linear.FCLayer.Params().Set(
          name=f'fc{i}', input_dim=WIDTH, output_dim=WIDTH,
          activation='RELU') for i in range(LAYERS)]).Instantiate()
  with tf.device(peers.device):
    x = tf.Variable(tf.random.stateless_normal([batch, WIDTH], seed=[1, 2]),
                    trainable=False)
    labels = tf.Variable(tf.zeros([batch]), trainable=False)

  def loss_fn(y, unused_labels):
    n = tf.cast(tf.shape(y)[0], y.dtype)
    return {'loss': (tf.reduce_sum(tf.square(y)) / n, n)}

  @tf.function(autograph=False)
  def step():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        loss = net.FPropLoss(net.theta, (x,), labels, loss_fn)['loss'][0]
    return tape.gradient(loss, net.trainable_variables)

  for _ in range(2):
    step()
  tf.config.experimental.reset_memory_stats('CPU:0')
  before = tf.config.experimental.get_memory_info('CPU:0')['current']
  tf.nest.map_structure(lambda g: g.numpy(), step())
  return tf.config.experimental.get_memory_info('CPU:0')['peak'] - before


def main(argv):
  del argv
  with processes.start_from_flags() as peers:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from lingvo_pipe.pipeline import placement  # pylint: disable=C0415
    placement.use(peers)
    out = {f'{schedule} {m}': _growth(tf, peers, schedule, m)
           for schedule, m in CASES}
    with open(_OUT.value, 'w') as f:
      json.dump(out, f)


if __name__ == '__main__':
  app.run(main)
