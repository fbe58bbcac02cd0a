"""Runs the trainer and evaler binaries as a user does: as subprocesses (or,
many quick runs, as children forked after the imports: `run_many_forked`)."""

import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

MODEL = 'synthetic.regression.MlpRegression'
PYTHON = sys.executable
_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
# Small, fast runs: every checkpoint kept so tests can compare them all.
FAST = ('task.train.summary_interval_steps: 5; '
        'task.train.max_checkpoints_to_keep: 50')


def command(binary, *args):
  return [PYTHON, '-m', f'lingvo_pipe.{binary}', *args]


def start(binary, *args):
  return subprocess.Popen(command(binary, *args), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=_ENV)


def finish(proc, timeout=300):
  """(returncode, stdout, stderr) of a started process."""
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f'{proc.args} timed out; stderr:\n{err}') from None
  return proc.returncode, out, err


def run(binary, *args, timeout=300):
  return finish(start(binary, *args), timeout)


def run_many(commands, parallel=4, timeout=300):
  """Runs (binary, args) pairs, `parallel` at a time; results in order."""
  results, running, todo = {}, {}, list(enumerate(commands))
  deadline = time.monotonic() + timeout
  while todo or running:
    while todo and len(running) < parallel:
      i, (binary, args) = todo.pop(0)
      running[i] = start(binary, *args)
    for i, proc in list(running.items()):
      if proc.poll() is not None:
        results[i] = finish(proc)
        del running[i]
    if time.monotonic() > deadline:
      for proc in running.values():
        proc.kill()
      raise AssertionError('run_many timed out')
    time.sleep(0.05)
  return [results[i] for i in range(len(commands))]


def run_many_forked(commands, timeout=300):
  """`run_many`, but each (binary, args) runs in a child forked from one
  process per binary that imported it once (fork_runner.py): the same entry
  point and argv, without the ~5 CPU-seconds of start-up each. Results in
  order."""
  by_binary = {}
  for i, (binary, args) in enumerate(commands):
    by_binary.setdefault(binary, []).append((i, args))
  runner = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'fork_runner.py')
  servers = {}
  for binary, runs in by_binary.items():
    servers[binary] = subprocess.Popen(
        [PYTHON, runner, binary, json.dumps([args for _, args in runs])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV)
  results = {}
  for binary, server in servers.items():
    rc, out, err = finish(server, timeout)
    assert rc == 0, f'fork_runner.py {binary} failed:\n{err}'
    for (i, _), result in zip(by_binary[binary], json.loads(out)):
      results[i] = tuple(result)
  return [results[i] for i in range(len(commands))]


def tree(path):
  """{relative path: (sha256, mtime_ns)} of every file and dir under `path`."""
  out = {}
  for root, dirs, files in os.walk(path):
    for name in dirs:
      out[os.path.relpath(os.path.join(root, name), path) + '/'] = 'dir'
    for name in files:
      full = os.path.join(root, name)
      with open(full, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(full, path)] = (digest, os.stat(full).st_mtime_ns)
  return out


def read_checkpoint(path):
  """{variable name: value} of a checkpoint, read without building a model."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()
          if name != '_CHECKPOINTABLE_OBJECT_GRAPH'}


def read_checkpoint_shards(path):
  """{key: value} of checkpoint `path`, whole or from all its shards."""
  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core import checkpoints
  values = {}
  for part in checkpoints.files_of(str(path)):
    values.update(read_checkpoint(part))
  assert values, f'no files for {path}'
  return values


def max_relative_diff(a, b):
  """max over variables of max|a−b| / max(max|a|, tiny)."""
  assert sorted(a) == sorted(b)
  worst = 0.0
  for name in a:
    x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
    scale = max(float(np.max(np.abs(x))) if x.size else 0.0, 1e-30)
    worst = max(worst, float(np.max(np.abs(x - y))) / scale if x.size else 0)
  return worst


def numpy_metrics(values, dataset):
  """The evaler's metrics of params/synthetic/regression.py on `dataset`,
  in float64 numpy, from checkpoint `values` ({key: value}, whole or every
  shard's)."""
  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core import model_registry
  from lingvo_pipe.tasks.synthetic import input_generator
  p = model_registry.get_params(MODEL, dataset).input
  data = input_generator.make_split(p.data_seed, p.split, p.num_examples,
                                    p.input_dim, p.output_dim, p.noise_stddev)
  v = {k.split('/.ATTRIBUTES')[0].replace('task/pipeline/', ''):
       np.asarray(x, np.float64) for k, x in values.items()}
  h = data['x'].astype(np.float64)
  for fc, bn in (('fc0', 'bn0'), ('fc1', 'bn1')):
    h = np.maximum(h @ v[f'{fc}/w'] + v[f'{fc}/b'], 0.0)
    h = ((h - v[f'{bn}/moving_mean']) /
         np.sqrt(v[f'{bn}/moving_variance'] + 1e-3) * v[f'{bn}/gamma'] +
         v[f'{bn}/beta'])
  err = h @ v['out/w'] + v['out/b'] - data['y']
  return {'loss': np.mean(err**2), 'mean_abs_error': np.mean(np.abs(err))}
