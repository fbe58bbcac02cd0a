"""A stand-in stage process for the runtime tests (not the real worker).

    python tests/pipeline/runtime_worker.py --scenario=chain \\
        --cluster_spec=worker=127.0.0.1:p0,127.0.0.1:p1 --task=0

Scenarios (each prints `READY` once started, results as `RESULT <json>`):
  chain: along tasks 0 → 1 → … → K−1, under one tf.function called on 2
    steps: each task sends a nest (float, int, None leaves) forward and a
    "gradient" back; then an all-reduce (sum and mean) over all tasks and a
    barrier that carries the last task's loss to everyone.
  one_f_one_b: 1F1B order on 4 micro-batches (forwards and backwards
    interleaved), each recv posted behind the previous op of its task and
    no op waiting on a send: the pattern that deadlocks if sends are
    ordered like the other ops (each task would wait on the other's recv);
    then an all-reduce (sum of task + 1 over all tasks).
  mismatch: task 0 waits for key ('F', 0, 0), task 1 sends ('F', 0, 1).
  steps: a barrier every 0.1 s for ever (to be killed); on SIGTERM it
    prints `SIGTERM <task>` and exits 0.
  hold: starts, then sleeps (holds its port).
"""

import json
import os
import signal
import sys
import time

from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top,C0413
_startup.import_tensorflow(sys.argv)  # Without Keras's pyplot: less start-up.
from absl import app
from absl import flags

from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import processes

processes.define_flags()
_SCENARIO = flags.DEFINE_string('scenario', 'chain', 'What to run.')


def _say(*words) -> None:
  print(*words, flush=True)


def _chain(peers) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  t, k = peers.task, peers.num_tasks
  spec = NestedMap(x=tf.TensorSpec([2, 3], tf.float32),
                   ids=tf.TensorSpec([4], tf.int32), mask=None)

  @tf.function
  def step(s):
    tokens = []
    x = tf.fill([2, 3], tf.cast(s, tf.float32) + 10.0 * t)
    ids = tf.range(4) + 100 * s
    if t > 0:
      got = peers.recv(spec, t - 1, ('F', t - 1))
      x = got.x + x
      ids = got.ids
    if t < k - 1:
      tokens.append(peers.send(NestedMap(x=x, ids=ids, mask=None), t + 1,
                               ('F', t)))
      grad = peers.recv(tf.TensorSpec([2, 3], tf.float32), t + 1,
                        ('B', t + 1))
    else:
      grad = -x
    if t > 0:
      tokens.append(peers.send(grad * 2.0, t - 1, ('B', t)))
    total = peers.all_reduce({'v': tf.fill([3], float(t + 1)),
                              'n': tf.constant([t + 1])},
                             range(k), ('sum',))
    mean = peers.all_reduce([tf.constant([2.0 * t])], range(k), ('mean',),
                            op='mean')
    # 3 × 2.3 MiB: more than collective.CHUNK_BYTES, so it goes in chunks.
    big = peers.all_reduce([tf.fill([600_000], float((i + 1) * (t + 1)))
                            for i in range(3)], range(k), ('big',))
    big = [[tf.reduce_min(b), tf.reduce_max(b)] for b in big]
    loss = tf.reduce_sum(x) if t == k - 1 else tf.constant(0.0)
    shared = peers.barrier(tf.stack([loss, 1.0]), after=tokens)
    return x, ids, grad, total, mean, big, shared

  for s in range(2):
    x, ids, grad, total, mean, big, shared = step(tf.constant(s))
    _say('RESULT', json.dumps({
        'step': s, 'x': x.numpy().tolist(), 'ids': ids.numpy().tolist(),
        'grad': grad.numpy().tolist(),
        'sum_v': total['v'].numpy().tolist(),
        'sum_n': total['n'].numpy().tolist(),
        'mean': mean[0].numpy().tolist(), 'shared': shared.numpy().tolist(),
        'big': [[float(v) for v in b] for b in big]}))


def _one_f_one_b(peers, num_micro_batches=4) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  s, k = peers.task, peers.num_tasks
  spec = tf.TensorSpec([2], tf.float32)
  warmup = k - s - 1
  order = [('F', m) for m in range(warmup)]
  for m in range(num_micro_batches):
    if warmup + m < num_micro_batches:
      order.append(('F', warmup + m))
    order.append(('B', m))

  @tf.function
  def step():
    prev, tokens, acts, grads = [], [], {}, []
    for kind, m in order:
      if kind == 'F':
        x = (tf.fill([2], float(m)) if s == 0 else
             peers.recv(spec, s - 1, ('F', s - 1, m), after=prev))
        acts[m] = x + 1.0
        prev = [acts[m]]
        if s < k - 1:
          tokens.append(peers.send(acts[m], s + 1, ('F', s, m)))
      else:
        g = (acts[m] if s == k - 1 else
             peers.recv(spec, s + 1, ('B', s + 1, m), after=prev))
        g = g * 2.0
        prev = [g]
        grads.append(g[0])
        if s > 0:
          tokens.append(peers.send(g, s - 1, ('B', s, m)))
    total = peers.all_reduce([tf.fill([2], float(s + 1))], range(k), ('sum',))
    peers.barrier(after=tokens + prev)
    return tf.stack(grads), total[0]

  for _ in range(2):
    grads, total = step()
    _say('RESULT', json.dumps({'grads': grads.numpy().tolist(),
                               'sum': total.numpy().tolist()}))


def _mismatch(peers) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function
  def step():
    if peers.task == 0:
      return peers.recv(tf.TensorSpec([2], tf.float32), 1, ('F', 0, 0))
    return peers.send(tf.ones([2]), 0, ('F', 0, 1))

  step()


def _exit_on_sigterm(task):
  def _handler(signum, frame):
    del signum, frame
    _say('SIGTERM', task)
    os._exit(0)  # pylint: disable=protected-access
  return _handler


def main(argv) -> None:
  del argv
  # mismatch: each op carries the TF timeout, so the error names its key.
  with processes.start_from_flags(
      op_timeouts=_SCENARIO.value == 'mismatch') as peers:
    _say('READY', peers.task)
    scenario = _SCENARIO.value
    if scenario == 'chain':
      _chain(peers)
    elif scenario == 'one_f_one_b':
      _one_f_one_b(peers)
    elif scenario == 'mismatch':
      _mismatch(peers)
    elif scenario == 'steps':
      signal.signal(signal.SIGTERM, _exit_on_sigterm(peers.task))
      while True:
        peers.barrier()
        time.sleep(0.1)
    elif scenario == 'hold':
      time.sleep(3600)
  _say('DONE', peers.task)


if __name__ == '__main__':
  sys.path.insert(0, '.')
  app.run(main)
