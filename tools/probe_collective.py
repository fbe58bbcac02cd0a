"""Probe of the multi-process runtime: stage overlap, transfers, all-reduce.

    .venv/bin/python tools/probe_collective.py --repeats=3

Launches (through `python -m lingvo_pipe.launch`, this file as the worker):
- K = 2, 3, 4 stage processes running GPipe on M micro-batches, forward
  then backward, ~45 ms of matmuls per stage and micro-batch, boundary
  tensors (1 MiB) over `Peers.send/recv`, each recv posted behind the
  previous op of its stage (as the engine will). Every compute op is
  stamped with `tf.timestamp`; the overlap of stages s and s+1 is the time
  both are busy ÷ the mean of their busy times, per phase (at most
  (M−1)/M = 0.875 for M = 8). With K > 2 processes share the 2 cores:
  compare overlap, not speed.
- In the K = 2 run also: a 1 MiB transfer (ping-pong, one way = half a
  round trip), the ceiling C (the same matmul work in two single-core
  processes at once vs in one alone, in this run) and the pipeline's
  efficiency: speed-up over one process doing both stages' work ÷
  (C × M/(M+K−1)).
- R = 2 replicas (K = 1): all-reduce of 4 MiB float32, its time and bytes/s.
Figures of each repetition go to --out (JSON); the summary prints the median
and the range over --repeats.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from lingvo_pipe.pipeline import processes

processes.define_flags()
_PHASES = flags.DEFINE_list('phases', [], 'Worker: what to run (pipeline, '
                            'pingpong, ceiling, allreduce); empty: driver.')
_M = flags.DEFINE_integer('num_micro_batches', 8, 'M.')
_WORK_MS = flags.DEFINE_float('work_ms', 45.0, 'Matmul time per stage and '
                              'micro-batch, alone on a core.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Measured steps (after one '
                              'traced step).')
_LOOKAHEAD = flags.DEFINE_integer(
    'recv_lookahead', 0, 'A recv is posted behind the end of the op that '
    'many ops before the previous one (0: behind the previous op, the '
    'engine\'s back-pressure; 1: one op early, so the transfer overlaps '
    'compute; -1: every recv at the step\'s start).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Driver: runs per figure.')
_OUT = flags.DEFINE_string('out', '/tmp/probe_collective.json', 'Driver: '
                           'JSON of every repetition.')

_ROWS, _DIM = 256, 1024  # A [256, 1024] float32 activation is 1 MiB.


# ---- Worker ------------------------------------------------------------------
def _work(tf, w, reps):
  def fn(x):
    for _ in range(reps):
      x = tf.tanh(tf.matmul(x, w) * 0.03)
    return x
  return fn


def _timed(tf, fn, x, after):
  """fn(x) with [start, end] stamps; starts after `after` and x's arrival."""
  with tf.control_dependencies(list(after) + [x]):
    t0 = tf.timestamp()
  with tf.control_dependencies([t0]):
    y = fn(tf.identity(x))
  with tf.control_dependencies([y]):
    t1 = tf.timestamp()
  return y, t0, t1


def _calibrate(tf, peers, w):
  """Task 0 measures matmuls/op for --work_ms; every task gets its count."""
  reps = 0.0
  if peers.task == 0:
    fn = tf.function(_work(tf, w, 10))
    x = tf.ones([_ROWS, _DIM])
    fn(x)
    t0 = time.perf_counter()
    fn(x).numpy()
    reps = float(max(1, round(_WORK_MS.value / 1000 / (
        (time.perf_counter() - t0) / 10))))
  total = peers.all_reduce(tf.constant([reps]), range(peers.num_tasks),
                           ('calibrate',))
  return int(total.numpy()[0])


def _pipeline(tf, peers, w, reps):
  """GPipe steps; returns [step][(phase, m, t0, t1)] of this stage."""
  s, k, m_count = peers.task, peers.num_tasks, _M.value
  spec = tf.TensorSpec([_ROWS, _DIM], tf.float32)
  fwd = _work(tf, w, reps)
  bwd = _work(tf, tf.transpose(w), reps)

  def posted_after(ends):
    """What a recv waits for: the end of op −1−lookahead, if any."""
    back = _LOOKAHEAD.value + 1
    return [] if back == 0 or len(ends) < back else [ends[-back]]

  @tf.function
  def step(x0):
    stamps, prev, tokens, used, ends = [], [], [], [], []
    for m in range(m_count):
      x = x0 if s == 0 else peers.recv(spec, s - 1, ('F', s - 1, m),
                                       after=posted_after(ends))
      y, t0, t1 = _timed(tf, fwd, x, prev)
      used.append(y[0, 0])  # Else grappler prunes an unused op, stamps kept.
      stamps.append((t0, t1))
      prev = [t1]
      ends.append(t1)
      if s < k - 1:
        tokens.append(peers.send(y, s + 1, ('F', s, m)))
    for m in reversed(range(m_count)):
      g = x0 if s == k - 1 else peers.recv(spec, s + 1, ('B', s + 1, m),
                                           after=posted_after(ends))
      g, t0, t1 = _timed(tf, bwd, g, prev)
      used.append(g[0, 0])
      stamps.append((t0, t1))
      prev = [t1]
      ends.append(t1)
      if s > 0:
        tokens.append(peers.send(g, s - 1, ('B', s, m)))
    peers.barrier(after=tokens + prev)
    return tf.stack([tf.stack(p) for p in stamps]), tf.add_n(used)

  x0 = tf.ones([_ROWS, _DIM])
  step(x0)
  out = []
  for _ in range(_STEPS.value):
    t0 = time.time()
    stamps = step(x0)[0].numpy().tolist()
    out.append({'wall': time.time() - t0, 'stamps': stamps})
  return out


def _pingpong(tf, peers, n=20):
  """Seconds of one 1 MiB transfer: round trips between tasks 0 and 1."""
  spec = tf.TensorSpec([_ROWS, _DIM], tf.float32)

  @tf.function
  def trips(x):
    token = None
    for i in range(n):
      if peers.task == 0:
        token = peers.send(x, 1, ('ping', i))
        x = peers.recv(spec, 1, ('pong', i), after=[token])
      else:
        y = peers.recv(spec, 0, ('ping', i), after=[token])
        token = peers.send(y + 1.0, 0, ('pong', i))
    return peers.barrier(after=[token, x])

  x = tf.ones([_ROWS, _DIM])
  trips(x)
  best = []
  for _ in range(3):
    t0 = time.perf_counter()
    trips(x).numpy()
    best.append((time.perf_counter() - t0) / (2 * n))
  return min(best), statistics.median(best)


def _ceiling(tf, peers, w, reps, ops=16):
  """Seconds for `ops` ops: task 0 alone, then tasks 0 and 1 together."""
  fn = tf.function(_work(tf, w, reps * ops))
  x = tf.ones([_ROWS, _DIM])
  fn(x)
  times = {}
  for label, workers in (('alone', [0]), ('together', [0, 1])):
    peers.barrier()
    if peers.task in workers:
      t0 = time.perf_counter()
      fn(x).numpy()
      times[label] = time.perf_counter() - t0
    peers.barrier()
  return times


def _allreduce(tf, peers, n=10, mib=4):
  x = tf.ones([mib * 256 * 1024])

  @tf.function
  def reduce(x):
    for i in range(n):
      x = peers.all_reduce(x, range(peers.num_tasks), ('ar', i)) * 0.5
    return x

  reduce(x)
  runs = []
  for _ in range(3):
    t0 = time.perf_counter()
    reduce(x).numpy()
    runs.append((time.perf_counter() - t0) / n)
  return {'seconds': min(runs), 'mib': mib}


def worker(unused_argv) -> None:
  with processes.start_from_flags() as peers:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    with tf.device(peers.device):
      w = tf.random.stateless_normal([_DIM, _DIM], seed=[1, 2])
      reps = _calibrate(tf, peers, w)
      result = {'task': peers.task, 'reps': reps}
      if 'pipeline' in _PHASES.value:
        result['pipeline'] = _pipeline(tf, peers, w, reps)
      if 'pingpong' in _PHASES.value:
        result['transfer_s'] = _pingpong(tf, peers)
      if 'ceiling' in _PHASES.value:
        result['ceiling'] = _ceiling(tf, peers, w, reps)
      if 'allreduce' in _PHASES.value:
        result['allreduce'] = _allreduce(tf, peers)
    print('RESULT', json.dumps(result), flush=True)


# ---- Driver ------------------------------------------------------------------
def _launch(num_stages, num_replicas, phases):
  cmd = [sys.executable, '-m', 'lingvo_pipe.launch',
         f'--num_stages={num_stages}', f'--num_replicas={num_replicas}',
         f'--worker={os.path.abspath(__file__)}', '--',
         f'--phases={",".join(phases)}', f'--num_micro_batches={_M.value}',
         f'--work_ms={_WORK_MS.value}', f'--steps={_STEPS.value}',
         f'--recv_lookahead={_LOOKAHEAD.value}']
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  results = [json.loads(m) for m in re.findall(r'RESULT (.*)', proc.stdout)]
  if proc.returncode or len(results) != num_stages * num_replicas:
    raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}):\n'
                       + proc.stderr[-3000:])
  return sorted(results, key=lambda r: r['task'])


def _busy(intervals):
  return sum(b - a for a, b in intervals)


def _both(xs, ys):
  return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)


def overlaps(results, m_count):
  """Per phase and adjacent pair: time both busy ÷ mean busy time (median
  over the measured steps)."""
  k = len(results)
  out = {}
  for phase, part in (('fwd', slice(0, m_count)),
                      ('bwd', slice(m_count, 2 * m_count))):
    for s in range(k - 1):
      ratios = []
      for step_a, step_b in zip(results[s]['pipeline'],
                                results[s + 1]['pipeline']):
        a, b = step_a['stamps'][part], step_b['stamps'][part]
        ratios.append(_both(a, b) / ((_busy(a) + _busy(b)) / 2))
      out[f'{phase} {s}-{s + 1}'] = statistics.median(ratios)
  return out


def handoffs_ms(results, m_count):
  """Median ms from the moment a boundary tensor is ready (its producer op
  ended) and the consumer is free (its previous op ended) to the start of
  the consumer's op: what a transfer costs the pipeline, whatever the load.
  """
  gaps = []
  for s in range(1, len(results)):
    for up, down in zip(results[s - 1]['pipeline'], results[s]['pipeline']):
      a, b = up['stamps'], down['stamps']
      for m in range(m_count):  # Forward: stage s−1 → s.
        free = b[m - 1][1] if m else b[m][0]
        gaps.append(b[m][0] - max(a[m][1], free))
      for i in range(m_count, 2 * m_count):  # Backward: stage s → s−1.
        free = a[i - 1][1] if i > m_count else a[i][0]
        gaps.append(a[i][0] - max(b[i][1], free))
  return 1000 * statistics.median(gaps)


def _k2_figures(results, m_count):
  t0 = results[0]
  c = t0['ceiling']
  together = max(r['ceiling']['together'] for r in results)
  ceiling = 2 * c['alone'] / together
  op_alone = c['alone'] / 16
  step = statistics.median(s['wall'] for s in t0['pipeline'])
  speedup = 2 * 2 * m_count * op_alone / step
  ideal = m_count / (m_count + 1)
  return {'C': ceiling, 'op_ms': 1000 * op_alone, 'step_s': step,
          'speedup': speedup, 'efficiency': speedup / (ceiling * ideal),
          'transfer_ms': 1000 * t0['transfer_s'][1]}


def _summary(name, values, fmt='{:.3f}'):
  values = sorted(values)
  return (f'{name:28s} median ' + fmt.format(statistics.median(values)) +
          '  range ' + fmt.format(values[0]) + ' .. ' + fmt.format(values[-1]))


def driver(unused_argv) -> None:
  m_count, runs = _M.value, []
  for rep in range(_REPEATS.value):
    run = {'K2': _launch(2, 1, ['pipeline', 'pingpong', 'ceiling']),
           'K3': _launch(3, 1, ['pipeline']),
           'K4': _launch(4, 1, ['pipeline']),
           'R2': _launch(1, 2, ['allreduce'])}
    runs.append(run)
    print(f'repetition {rep + 1}/{_REPEATS.value} done', flush=True)
  with open(_OUT.value, 'w') as f:
    json.dump(runs, f)
  lines = [f'M={m_count}, ~{_WORK_MS.value:g} ms per op, {_STEPS.value} '
           f'steps per run, {_REPEATS.value} runs; max overlap '
           f'{(m_count - 1) / m_count:.3f}']
  for k in ('K2', 'K3', 'K4'):
    per_run = [overlaps(run[k], m_count) for run in runs]
    for pair in per_run[0]:
      lines.append(_summary(f'overlap {k} {pair}', [o[pair] for o in per_run]))
    lines.append(_summary(f'handoff {k} ms', [handoffs_ms(run[k], m_count)
                                              for run in runs], '{:.2f}'))
  k2 = [_k2_figures(run['K2'], m_count) for run in runs]
  for key, fmt in (('C', '{:.3f}'), ('op_ms', '{:.1f}'), ('step_s', '{:.3f}'),
                   ('speedup', '{:.3f}'), ('efficiency', '{:.3f}'),
                   ('transfer_ms', '{:.2f}')):
    lines.append(_summary(f'K2 {key}', [f[key] for f in k2], fmt))
  ar = [run['R2'][0]['allreduce'] for run in runs]
  lines.append(_summary('R2 all-reduce 4 MiB ms', [1000 * a['seconds']
                                                   for a in ar], '{:.2f}'))
  lines.append(_summary('R2 all-reduce MiB/s', [a['mib'] / a['seconds']
                                                for a in ar], '{:.0f}'))
  print('\n'.join(lines))


def main(argv) -> None:
  (worker if _PHASES.value else driver)(argv)


if __name__ == '__main__':
  app.run(main)
