"""TransformerSmall on stage processes: length buckets, a tied softmax.

Tiny TransformerSmall (tiny_mt.py: the config's own layers, tie and
optimizer) trains 20 steps that cross each of its 3 length buckets, as a
user runs it: `python -m lingvo_pipe.launch --num_stages=2 [--num_replicas=2]
-- --model=...`. Each task traces once per bucket and receives tensors of
that bucket's shape. Its checkpoints must hold what one process's hold (the
tied table once, under the embedding's path) to 1e-5, and a run resumes on
K=4 stage processes (the last stage's copy of the table read from the
embedding's entry) as one process resumes on K=4.
"""

import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import checkpoints
from lingvo_pipe.tasks.mt import vocab as vocab_lib

from mt_testdata import PAIRS  # pylint: disable=g-bad-import-order

_HERE = os.path.dirname(os.path.abspath(__file__))
_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
            PYTHONPATH=os.pathsep.join([_HERE] + [
                p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
                if p]))


def _buckets(mt_data):
  """Three buckets of at least 4 training pairs each, the last at 32."""
  vocab = vocab_lib.Vocab(mt_data['vocab'])
  lengths = sorted(max(len(vocab.encode(en)), len(vocab.encode(es)))
                   for en, es in PAIRS)
  return [lengths[len(lengths) // 3], lengths[2 * len(lengths) // 3], 32]


def _args(mt_data, logdir, steps, num_stages=2):
  bounds = _buckets(mt_data)
  return ['--model=tiny_mt.TinyTransformerSmall', f'--logdir={logdir}',
          f'--max_steps={steps}', '--model_params_override='
          f'input.tsv_path: "{mt_data["train"]}"; '
          f'input.vocab_path: "{mt_data["vocab"]}"; '
          f'task.vocab_path: "{mt_data["vocab"]}"; '
          f'input.bucket_upper_bounds: {bounds}; '
          'input.bucket_batch_sizes: [4, 4, 4]; '
          f'task.pipeline.num_stages: {num_stages}; '
          'task.train.save_interval_steps: 10; '
          'task.train.max_checkpoints_to_keep: 10']


def _run(*command):
  result = subprocess.run([sys.executable, '-m', *command], env=_ENV,
                          capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  return result.stderr


def _alone(mt_data, logdir, steps, num_stages=2, *extra):
  return _run('lingvo_pipe.trainer', *_args(mt_data, logdir, steps,
                                            num_stages), *extra)


def _launched(mt_data, logdir, steps, num_stages=2, num_replicas=1, *extra):
  return _run('lingvo_pipe.launch', f'--num_stages={num_stages}',
              f'--num_replicas={num_replicas}', '--',
              *_args(mt_data, logdir, steps, num_stages), *extra)


def _read(path):
  """{key: value} of a checkpoint, whole or from its shards; a weight or
  slot in two shards fails (the step and save counter are in each)."""
  values = {}
  for part in checkpoints.files_of(str(path)):
    reader = tf.train.load_checkpoint(part)
    for name in reader.get_variable_to_shape_map():
      if name != '_CHECKPOINTABLE_OBJECT_GRAPH':
        assert not (name in values and name.startswith(
            ('task/', 'optimizer/'))), f'{name} is in two shards'
        values[name] = reader.get_tensor(name)
  return values


def _max_diff(a, b):
  """max over weights and slots of max|a − b| / max|a|, leaving out the
  attention key biases: softmax cancels a per-query constant, so their
  gradient is rounding noise, which Adam scales up to full-size steps
  (they differed by 50-100% while every other weight agreed to 4e-7)."""
  assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
  return max(float(np.max(np.abs(np.float64(a[k]) - b[k]))) /
             max(float(np.max(np.abs(a[k]))), 1e-30) for k in a
             if a[k].size and 'key_b' not in k)


def test_transformer_small_on_stage_processes_equals_one_process(
    mt_data, tmp_path):
  _alone(mt_data, tmp_path / 'alone', 20)
  err = _launched(mt_data, tmp_path / 'staged', 20)
  assert err.count('Tracing the train step') == 2  # Once per task…
  alone = _read(tmp_path / 'alone' / 'ckpt-20')
  tables = [k for k in alone if 'emb' in k and 'VARIABLE' in k and
            'optimizer' not in k]
  assert tables == ['task/pipeline/emb/src_emb/emb/.ATTRIBUTES/'
                    'VARIABLE_VALUE'], tables  # Tied: one table.
  assert not any('softmax/softmax/w' in k for k in alone)
  assert _max_diff(alone, _read(tmp_path / 'staged' / 'ckpt-20')) <= 1e-5

  # R=2 replicas × K=2 stages: the same 20 steps.
  _launched(mt_data, tmp_path / 'replicas', 20, 2, 2)
  assert _max_diff(alone, _read(tmp_path / 'replicas' / 'ckpt-20')) <= 1e-5

  # Resumed on K=4 stage processes, as one process resumes on K=4.
  _alone(mt_data, tmp_path / 'alone', 30, 4, '--force',
         '--num_logical_cpu_devices=4')
  _launched(mt_data, tmp_path / 'staged', 30, 4, 1, '--force')
  assert _max_diff(_read(tmp_path / 'alone' / 'ckpt-30'),
                   _read(tmp_path / 'staged' / 'ckpt-30')) <= 1e-5
