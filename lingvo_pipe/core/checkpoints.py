"""Which checkpoints of a logdir are complete, readable and finite.

The trainer writes a checkpoint's files first (`save`) and only then
rewrites the `checkpoint` state file (atomically) to list it (`commit`), as
`tf.train.CheckpointManager` does. A reader that takes its list from the
state file, never from the files it sees on disk, therefore never opens a
checkpoint that is still being written. The trainer names checkpoints
`ckpt-<step>`, so the step is known without opening one.

A run of K stage processes writes checkpoint `ckpt-<step>` as K shards,
`ckpt-<step>.stage<d>of<K>.{index,data-*}`, one per stage, each holding
that stage's variables (and slots) under the same object paths as a
whole checkpoint: a variable's key is its layer path, never its stage. The
chief lists `ckpt-<step>` in the state file once every shard is written.
`restore` reads either form into any model (one process or K′ stage
processes), so a run resumes on another K or R, and the evaler reads a
sharded checkpoint in one process.

What can go wrong on disk, and what the binaries do about it (one line,
exit status 2, and the fix, via `CheckpointError`):

- a state file that is not a state file (garbage, zeroed, not UTF-8):
  TensorFlow's own reader logs a warning and returns None, and a trainer
  would silently start again from step 0 beside the old checkpoints;
  `read_state` refuses it instead;
- checkpoint files that are truncated, zeroed or bit-flipped (the index is
  an sstable with block checksums, the data has a CRC32C per tensor):
  `restore` names the checkpoint and the previous one to fall back to;
- a listed checkpoint deleted while a reader opens it (the trainer keeps
  only the last few): `restore` returns False and the evaler skips it;
- a checkpoint that does not fit the model (another model's logdir, or
  params changed since): `restore` names the first variable whose shape
  differs, before restoring anything (`checkpoint_fit`);
- `_temp` directories left by a save that was killed (TensorFlow writes
  `ckpt-N_temp/part-*` and then renames): `remove_temp_dirs`.

And one thing that is not a disk fault: weights that became inf or NaN.
`all_finite` lets the train step check the updated variables, so the
trainer never saves them; `non_finite` lets the evaler refuse to score them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Iterable, Sequence

from google.protobuf import text_format
import tensorflow as tf
# The message tf.train.get_checkpoint_state returns; TF exports no name for it.
from tensorflow.python.training import checkpoint_state_pb2

from lingvo_pipe import errors
from lingvo_pipe.core import checkpoint_fit

CHECKPOINT_PREFIX = 'ckpt'
STATE_FILE = 'checkpoint'
_STEP = re.compile(r'-(\d+)$')
_TEMP_DIR = re.compile(rf'^{CHECKPOINT_PREFIX}-\d+(\.stage\d+of\d+)?_temp')
_SHARD = re.compile(rf'^(?P<base>{CHECKPOINT_PREFIX}-\d+)\.stage(?P<d>\d+)'
                    r'of(?P<k>\d+)\.index$')


class CheckpointError(errors.LingvoPipeError):
  """A state file or checkpoint that cannot be read; names the fix."""


def step_of(path: str) -> int:
  """The step in a checkpoint path such as '/logdir/ckpt-300'."""
  m = _STEP.search(os.path.basename(path))
  if not m:
    raise ValueError(f'Checkpoint path {path!r} does not end in -<step>.')
  return int(m.group(1))


def read_state(logdir: str) -> checkpoint_state_pb2.CheckpointState | None:
  """The parsed `logdir/checkpoint` state file; None if there is none yet.

  Raises:
    CheckpointError: the file exists but is not a readable state file.
  """
  path = os.path.join(logdir, STATE_FILE)
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except FileNotFoundError:
    return None
  except OSError as e:
    raise CheckpointError(f'{path} cannot be read ({e.strerror}); '
                          f'{state_fix(logdir)}') from None
  state = checkpoint_state_pb2.CheckpointState()
  try:
    text_format.Parse(raw.decode('utf-8'), state)
  except (UnicodeDecodeError, text_format.ParseError) as e:
    reason = f'{type(e).__name__}: {" ".join(str(e).split())[:100]}'
    raise CheckpointError(f'{path} is not a checkpoint state file ({reason}); '
                          f'{state_fix(logdir)}') from None
  if not state.model_checkpoint_path:
    raise CheckpointError(f'{path} names no checkpoint (model_checkpoint_path '
                          f'is empty); {state_fix(logdir)}')
  return state


def state_fix(logdir: str) -> str:
  """How to repair a damaged state file, given the checkpoints on disk."""
  on_disk = sorted((step_of(name[:-len('.index')]) for name in _names(logdir)
                    if name.endswith('.index') and _STEP.search(
                        name[:-len('.index')])), reverse=True)
  if on_disk:
    name = f'{CHECKPOINT_PREFIX}-{on_disk[0]}'
    return (f'to resume from {name} (the newest on disk), replace the file '
            f'with the one line: model_checkpoint_path: "{name}"; or use '
            'another --logdir.')
  return ('no checkpoint files are on disk: delete the file to start from '
          'step 0, or use another --logdir.')


def _names(logdir: str) -> list[str]:
  try:
    return os.listdir(logdir)
  except OSError:
    return []


def list_checkpoints(logdir: str) -> list[str]:
  """Complete checkpoints listed in `logdir/checkpoint`, oldest step first.

  Paths are rebased onto `logdir` (the state file may hold paths as the
  trainer spelled them). Returns [] when there is no state file yet.

  Raises:
    CheckpointError: the state file is damaged (see `read_state`).
  """
  state = read_state(logdir)
  if state is None:
    return []
  paths = {os.path.join(logdir, os.path.basename(p))
           for p in state.all_model_checkpoint_paths}
  paths.add(os.path.join(logdir,
                         os.path.basename(state.model_checkpoint_path)))
  return sorted((p for p in paths if _STEP.search(p)), key=step_of)


def path_of(logdir: str, step: int) -> str:
  """Checkpoint `step`'s path, e.g. '/logdir/ckpt-300' (whole or sharded)."""
  return os.path.join(logdir, f'{CHECKPOINT_PREFIX}-{step}')


def shard_prefix(logdir: str, step: int, stage: int, num_stages: int) -> str:
  """Where stage `stage` of K writes its shard of checkpoint `step`."""
  return f'{path_of(logdir, step)}.stage{stage}of{num_stages}'


def files_of(path: str) -> list[str]:
  """The prefixes that hold checkpoint `path` (e.g. '/logdir/ckpt-300'):
  [path] if it was written whole, else its K stage shards; [] if it is not
  (or not completely) on disk."""
  if tf.io.gfile.exists(path + '.index'):
    return [path]
  logdir, base = os.path.split(path)
  stages: dict[int, set[int]] = {}
  for name in _names(logdir):
    m = _SHARD.match(name)
    if m and m['base'] == base:
      stages.setdefault(int(m['k']), set()).add(int(m['d']))
  for k, found in sorted(stages.items(), reverse=True):
    if found == set(range(k)):
      return [shard_prefix(logdir, step_of(path), d, k) for d in range(k)]
  return []


def exists(path: str) -> bool:
  """Whether the files of checkpoint `path` are still on disk."""
  return bool(files_of(path))


def save(checkpoint: tf.train.Checkpoint, logdir: str, step: int,
         stage: int = 0, num_stages: int = 1) -> str:
  """Writes this process's part of checkpoint `step` (not yet listed: see
  `commit`): the whole checkpoint, or stage `stage`'s shard of K.

  Returns:
    The checkpoint's path, '<logdir>/ckpt-<step>'.
  """
  path = path_of(logdir, step)
  # `restore` creates the checkpoint's save counter in the reader, so the
  # file must hold one too (`save` would write it; `write` only if it
  # exists), else a strict restore finds it unmatched.
  checkpoint.save_counter  # pylint: disable=pointless-statement
  checkpoint.write(path if num_stages == 1 else
                   shard_prefix(logdir, step, stage, num_stages))
  return path


def commit(logdir: str, path: str, keep: int) -> list[str]:
  """Lists `path` as the latest checkpoint in the state file (atomically)
  and deletes all but the newest `keep`; returns the deleted ones."""
  listed = sorted({*list_checkpoints(logdir), path}, key=step_of)
  kept, dropped = listed[-keep:], listed[:-keep] if keep > 0 else []
  state = checkpoint_state_pb2.CheckpointState(
      model_checkpoint_path=os.path.basename(path),
      all_model_checkpoint_paths=[os.path.basename(p) for p in kept])
  write_file_atomically(os.path.join(logdir, STATE_FILE),
                        text_format.MessageToString(state))
  for old in dropped:
    delete(old)
  return dropped


def write_file_atomically(path: str, text: str) -> None:
  """Writes `text` to `path` via a temp file and os.replace."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-',
                             suffix=os.path.basename(path))
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; match open()'s mode.
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def delete(path: str) -> None:
  """Deletes every file of checkpoint `path` (whole or sharded).

  Index files go first: a reader whose restore fails on a vanished data
  file then finds the checkpoint gone (`exists`), not damaged. In listing
  order, a continuous evaler once found ckpt-71's data file gone and its
  index still there, and stopped on "cannot be read".
  """
  logdir, base = os.path.split(path)
  names = sorted(_names(logdir), key=lambda n: not n.endswith('.index'))
  for name in names:
    if name.startswith(base + '.') and (
        name[len(base) + 1:].startswith(('index', 'data-', 'stage'))):
      try:
        os.remove(os.path.join(logdir, name))
      except FileNotFoundError:
        pass  # Another process deleted it first.


def remove_unlisted(logdir: str) -> list[str]:
  """Deletes checkpoint files newer than the latest listed one (a save that
  was killed before its commit); returns the checkpoints deleted."""
  listed = list_checkpoints(logdir)
  if not listed:  # No state file: leave the files for the user to judge.
    return []
  newest = step_of(listed[-1])
  unlisted = set()
  for name in _names(logdir):
    base = name.split('.', 1)[0]
    if (_STEP.search(base) and base.startswith(f'{CHECKPOINT_PREFIX}-') and
        step_of(base) > newest and '.' in name):
      unlisted.add(os.path.join(logdir, base))
  for path in sorted(unlisted):
    delete(path)
  return sorted(unlisted)


def restore(checkpoint: tf.train.Checkpoint, path: str,
            partial: bool = False) -> bool:
  """Restores `path` into `checkpoint`'s objects.

  Use a fresh `tf.train.Checkpoint` per call: after a failed restore, an
  object keeps the failed checkpoint as its pending restore.

  Args:
    checkpoint: What to restore into.
    path: A checkpoint prefix such as '/logdir/ckpt-300'.
    partial: Only `checkpoint`'s objects need to be in the file (the evaler
      skips the optimizer's slots; a stage process holds one stage); else
      the file must match them exactly. A sharded checkpoint is always read
      partially, shard by shard.

  Returns:
    False if the checkpoint was deleted before it could be read.

  Raises:
    CheckpointError: the files are there but cannot be read or do not
      match the model; the message names the file and the fix.
  """
  files = files_of(path)
  if not files:
    return False
  status = None
  try:
    misfit = checkpoint_fit.misfit(checkpoint, files)
    if misfit:
      pass  # Restore nothing: TensorFlow would fail half-way (see above).
    elif files == [path]:
      status = checkpoint.restore(path)
      if partial:
        status.expect_partial()
      status.assert_existing_objects_matched()
    else:  # Stage shards: each holds a part of the model's objects.
      for shard in files:
        status = checkpoint.restore(shard)
        status.expect_partial()
        status.assert_nontrivial_match()
  except Exception as e:  # pylint: disable=broad-except
    if status is not None:  # No page of "unrestored value" warnings later.
      status.expect_partial()
    if not exists(path):
      return False  # Deleted while being read.
    reason = f'{type(e).__name__}: {_first_line(e)}'
    raise CheckpointError(f'{path} cannot be read ({reason}); '
                          f'{_damage_fix(path)}') from None
  if misfit:
    logdir = os.path.dirname(path)
    raise CheckpointError(
        f'{path} does not fit the model: {misfit}. It was written by another '
        'model (is --logdir another run\'s?) or with other params (a layer '
        'size, the layers or task.train.optimizer changed since); run with '
        f'the params it was trained with ({os.path.join(logdir, "params.txt")}'
        ') or use another --logdir.')
  return True


def _first_line(e: Exception) -> str:
  text = ' '.join(str(e).split())
  text = re.sub(r'\{\{function_node [^}]*\}\}\s*', '', text)
  return text[:160]


def _damage_fix(path: str) -> str:
  logdir = os.path.dirname(path)
  try:
    older = [c for c in list_checkpoints(logdir) if step_of(c) < step_of(path)]
  except CheckpointError:
    older = []
  name = os.path.basename(path)
  if older:
    return (f'the file is damaged (truncated or overwritten) or from another '
            f'model. Fix: delete {name}.* and its lines in '
            f'{os.path.join(logdir, STATE_FILE)} (model_checkpoint_path: '
            f'"{os.path.basename(older[-1])}") to fall back to '
            f'{os.path.basename(older[-1])}, or use another --logdir.')
  return (f'the file is damaged (truncated or overwritten) or from another '
          f'model, and no older checkpoint is listed. Fix: delete {name}.* '
          f'and {os.path.join(logdir, STATE_FILE)} to start from step 0, or '
          'use another --logdir.')


def remove_temp_dirs(logdir: str) -> list[str]:
  """Removes `ckpt-N_temp` directories of killed saves; returns them."""
  removed = []
  for name in _names(logdir):
    path = os.path.join(logdir, name)
    if _TEMP_DIR.match(name) and os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


def _float_variables(variables: Iterable[tf.Variable]) -> list[tf.Variable]:
  return [v for v in variables if v.dtype.is_floating]


def all_finite(variables: Sequence[tf.Variable]) -> tf.Tensor:
  """Bool scalar: every float variable holds only finite values.

  Each variable is checked on its own device; only the booleans move.
  """
  checks = []
  for v in _float_variables(variables):
    with tf.device(v.device):
      checks.append(tf.reduce_all(tf.math.is_finite(v)))
  return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def non_finite(variables: Iterable[tf.Variable]) -> list[str]:
  """Names of the float variables holding inf or NaN (eager)."""
  return [v.name for v in _float_variables(variables)
          if not bool(tf.reduce_all(tf.math.is_finite(v)))]
