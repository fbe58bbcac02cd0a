"""checkpoints: damaged state files and checkpoints are named, not ignored.

Guards issue 11: TensorFlow's reader returns None for a garbage `checkpoint`
state file (a warning in the log), and the trainer then restarted from step
0 beside the old checkpoints; damaged checkpoint files ended in tracebacks.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import checkpoints


@pytest.fixture
def logdir(tmp_path):
  """ckpt-1 and ckpt-2 of a module with one variable, via CheckpointManager."""
  module = tf.Module()
  module.w = tf.Variable(np.arange(1000, dtype=np.float32))
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(module=module), str(tmp_path), max_to_keep=5,
      checkpoint_name=checkpoints.CHECKPOINT_PREFIX)
  for step in (1, 2):
    module.w.assign_add(tf.ones([1000]))
    manager.save(checkpoint_number=step)
  return tmp_path


def _fresh():
  module = tf.Module()
  module.w = tf.Variable(tf.zeros([1000]))
  return module, tf.train.Checkpoint(module=module)


def test_lists_and_restores_a_healthy_logdir(logdir):
  listed = checkpoints.list_checkpoints(str(logdir))
  assert [checkpoints.step_of(c) for c in listed] == [1, 2]
  module, ckpt = _fresh()
  assert checkpoints.restore(ckpt, listed[-1])
  assert float(module.w[0]) == 2.0


def test_no_state_file_is_no_checkpoint(tmp_path):
  assert checkpoints.read_state(str(tmp_path)) is None
  assert checkpoints.list_checkpoints(str(tmp_path)) == []


@pytest.mark.parametrize('content, reason', [
    (b'garbage\n', 'ParseError'),
    (b'\x00' * 64, 'ParseError'),
    (b'model_checkpoint_path: "caf\xe9"', 'UnicodeDecodeError'),
    (b'', 'names no checkpoint'),
])
def test_a_damaged_state_file_is_refused_with_the_fix(logdir, content,
                                                      reason):
  (logdir / 'checkpoint').write_bytes(content)
  with pytest.raises(checkpoints.CheckpointError) as e:
    checkpoints.list_checkpoints(str(logdir))
  message = str(e.value)
  assert reason in message
  assert 'replace the file with the one line: model_checkpoint_path: ' \
         '"ckpt-2"' in message


@pytest.mark.parametrize('damage', ['truncate', 'zero', 'flip'])
def test_a_damaged_checkpoint_is_refused_naming_the_one_before(logdir, damage):
  data = logdir / 'ckpt-2.data-00000-of-00001'
  raw = bytearray(data.read_bytes())
  if damage == 'truncate':
    raw = raw[:len(raw) // 2]
  elif damage == 'zero':
    raw = bytearray(len(raw))
  else:
    raw[len(raw) // 2] ^= 1
  data.write_bytes(bytes(raw))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'ckpt-2 cannot be read .* fall back to ckpt-1'):
    checkpoints.restore(_fresh()[1], str(logdir / 'ckpt-2'))


def test_a_checkpoint_deleted_before_reading_is_reported_not_raised(logdir):
  for name in os.listdir(logdir):
    if name.startswith('ckpt-2.'):
      os.remove(logdir / name)
  assert not checkpoints.restore(_fresh()[1], str(logdir / 'ckpt-2'))


def test_temp_dirs_of_killed_saves_are_removed(logdir):
  (logdir / 'ckpt-3_temp').mkdir()
  (logdir / 'ckpt-3_temp' / 'part-00000-of-00001.index').write_bytes(b'x')
  (logdir / 'keep_temp').mkdir()  # Not a checkpoint's: left alone.
  removed = checkpoints.remove_temp_dirs(str(logdir))
  assert removed == [str(logdir / 'ckpt-3_temp')]
  assert (logdir / 'keep_temp').exists() and (logdir / 'ckpt-2.index').exists()


def test_finiteness_of_variables():
  good = tf.Variable([1.0, 2.0], name='good')
  bad = tf.Variable([1.0, np.inf], name='bad')
  steps = tf.Variable(3, dtype=tf.int64)  # Not a float: never checked.
  assert bool(checkpoints.all_finite([good, steps]))
  assert not bool(tf.function(checkpoints.all_finite)([good, bad]))
  assert checkpoints.non_finite([good, bad, steps]) == ['bad:0']
