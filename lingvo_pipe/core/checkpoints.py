"""Which checkpoints of a logdir are complete, and their steps.

The trainer saves through `tf.train.CheckpointManager`, which writes a
checkpoint's files first and only then rewrites the `checkpoint` state file
(atomically) to list it. A reader that takes its list from the state file,
never from the files it sees on disk, therefore never opens a checkpoint that
is still being written. The trainer names checkpoints `ckpt-<step>`, so the
step is known without opening one.
"""

from __future__ import annotations

import os
import re

import tensorflow as tf

CHECKPOINT_PREFIX = 'ckpt'
_STEP = re.compile(r'-(\d+)$')


def step_of(path: str) -> int:
  """The step in a checkpoint path such as '/logdir/ckpt-300'."""
  m = _STEP.search(os.path.basename(path))
  if not m:
    raise ValueError(f'Checkpoint path {path!r} does not end in -<step>.')
  return int(m.group(1))


def list_checkpoints(logdir: str) -> list[str]:
  """Complete checkpoints listed in `logdir/checkpoint`, oldest step first.

  Paths are rebased onto `logdir` (the state file may hold paths as the
  trainer spelled them). Returns [] when there is no state file yet.
  """
  try:
    state = tf.train.get_checkpoint_state(logdir)
  except (tf.errors.OpError, ValueError):
    return []  # Unreadable: not written yet, or being replaced right now.
  if state is None:
    return []
  paths = {os.path.join(logdir, os.path.basename(p))
           for p in state.all_model_checkpoint_paths}
  if state.model_checkpoint_path:
    paths.add(os.path.join(logdir,
                           os.path.basename(state.model_checkpoint_path)))
  return sorted((p for p in paths if _STEP.search(p)), key=step_of)


def exists(path: str) -> bool:
  """Whether the files of checkpoint `path` are still on disk."""
  return tf.io.gfile.exists(path + '.index')
