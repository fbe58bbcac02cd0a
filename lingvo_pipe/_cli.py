"""What the trainer and evaler binaries share: params, logdirs, user errors.

A user who mistypes a model name or an override should get one line that
names the problem and the fix, exit status 2, and an untouched logdir, not a
TensorFlow traceback. So the binaries validate everything (params, data,
logdir, the model itself) before they create anything, and user errors are
the named exceptions under `lingvo_pipe.errors.LingvoPipeError`, turned into
that one line by `exit_on_user_error`. Anything else is a bug and keeps its
traceback.

TensorFlow's start-up banner is kept off the console by the entry points
(`_startup.import_tensorflow`, before this module imports TensorFlow); this
module has no side effect at import.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from typing import Callable, Iterator

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from lingvo_pipe import _startup
from lingvo_pipe import errors
from lingvo_pipe.core import checkpoints
from lingvo_pipe.core import learning_rate
from lingvo_pipe.core import optimizer
from lingvo_pipe.core.hyperparams import Params, ParamsError

PARAMS_FILE = 'params.txt'


class UserError(errors.LingvoPipeError):
  """A bad flag or logdir; the message names the problem and the fix."""


class RunStopped(Exception):
  """Library code stops the run: the entry point exits with `exit_code`
  (after printing the message, if any) instead of library code calling
  sys.exit."""

  def __init__(self, message: str = '', exit_code: int = 1) -> None:
    super().__init__(message)
    self.exit_code = exit_code


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
  """An absl `app.run` flags parser: a malformed flag value, an unknown flag
  or a positional argument (the binaries take none) is one stderr line and
  exit status 2, like every other bad input, not absl's usage text of every
  flag. Once parsed, --verbosity sets how much TensorFlow logs."""

  def _parse(argv: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      line = ' '.join(str(e).split())
      sys.stderr.write(f'{program}: error: {line}; see --helpfull for every '
                       'flag and its values.\n')
      sys.exit(2)
    if len(rest) > 1:
      sys.stderr.write(f'{program}: error: {positional_error(rest[1:])}\n')
      sys.exit(2)
    _startup.configure_python_logging(flags.FLAGS.verbosity)
    return rest

  return _parse


def positional_error(extra: list[str]) -> str:
  """The one line for arguments that are no flag (the binaries take none)."""
  shown = ' '.join(repr(a) for a in extra[:3]) + (' ...' if len(extra) > 3
                                                  else '')
  return (f'unexpected argument{"s" if len(extra) > 1 else ""} {shown}: every '
          'setting is a --flag=value, and a value with spaces is quoted '
          '(--model_params_override=\'task.train.learning_rate: 0.1\'); '
          'see --helpfull.')


def run_binary(main: Callable[[list[str]], None], program: str,
               module: types.ModuleType) -> None:
  """`app.run(main)` for the binary `module`, also as a console script
  (whose --help then lists `module`'s flags: `_startup.show_in_help`)."""
  _startup.show_in_help(module)
  app.run(main, flags_parser=flags_parser(program))


@contextlib.contextmanager
def exit_on_user_error(program: str) -> Iterator[None]:
  """Turns a user error into one stderr line and exit status 2 (or the
  error's own `exit_status`: 75 for a peer that did not answer), and
  `RunStopped` into its exit status."""
  try:
    yield
  except errors.LingvoPipeError as e:
    line = ' '.join(str(e).split()) or type(e).__name__
    sys.stderr.flush()
    sys.stderr.write(f'{program}: error: {line}\n')
    sys.stderr.flush()
    sys.exit(getattr(e, 'exit_status', 2))
  except RunStopped as e:
    if str(e):
      sys.stderr.write(f'{program}: {" ".join(str(e).split())}\n')
    sys.exit(e.exit_code)


# ---- Params -----------------------------------------------------------------
def read_text_file(path: str, fix: str, name: str = '') -> str:
  """The UTF-8 text of `path`; UserError naming it and the fix if unreadable.

  Args:
    path: The file.
    fix: What the user should do, the end of the message.
    name: How to call the file in the message (default: its path).
  """
  name = name or path
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise UserError(f'Cannot read {name}: {e.strerror}; {fix}.') from None
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError as e:
    line = raw.count(b'\n', 0, e.start) + 1
    raise UserError(f'{name} is not UTF-8 text (byte {e.start}, line {line}: '
                    f'{raw[e.start:e.start + 4]!r}); {fix}.') from None


def read_override_file(path: str) -> str:
  """The text of --model_params_file_override (`path : value` lines)."""
  return read_text_file(path, 'pass a readable UTF-8 file of "path : value" '
                        'lines', name=f'--model_params_file_override={path!r}')


def apply_overrides(params: Params, *texts: str) -> Params:
  """Applies override texts in order; errors name the offending line."""
  for text in texts:
    if text:
      params.FromText(text)
  return params


_INT64_MAX = 2**63 - 1  # The global step is an int64 variable.


def validate_train_params(params: Params) -> None:
  """Checks `task.train` for values the trainer cannot run with."""
  train = params.task.train
  optimizer.validate(train)
  learning_rate.validate(train)
  for key in ('max_steps', 'save_interval_steps', 'max_checkpoints_to_keep',
              'summary_interval_steps'):
    value = getattr(train, key)
    if not 1 <= value <= _INT64_MAX:
      raise UserError(f'task.train.{key} must be in [1, 2**63 - 1] (the step '
                      f'is an int64), got {value}; set it in an override '
                      '(or --max_steps).')
  for key in ('clip_gradient_norm', 'weight_decay'):
    value = getattr(train, key)
    if not 0 <= value < math.inf:
      raise UserError(f'task.train.{key} must be finite and ≥ 0 (0 turns it '
                      f'off), got {value}.')
  if learning_rate.short_run_warning(train):  # A smoke run: no error.
    logging.warning(learning_rate.short_run_warning(train))


def set_devices(params: Params, devices_flag: str) -> None:
  """--devices=a,b: one device per pipeline stage (task.pipeline.devices)."""
  if not devices_flag:
    return
  if 'pipeline' not in params.task or not isinstance(params.task.pipeline,
                                                     Params):
    raise UserError(f'--devices={devices_flag} needs a task with a pipeline '
                    f'(task.pipeline), and {params.model} has none; drop '
                    '--devices.')
  params.task.pipeline.devices = [d.strip() for d in devices_flag.split(',')
                                  if d.strip()]


# ---- Logdir -----------------------------------------------------------------
def check_writable_dir(path: str, flag: str = '--logdir') -> None:
  """Raises UserError unless `path` is, or can be created as, a writable dir.

  Creates nothing.
  """
  if not path:
    raise UserError(f'{flag} is empty; pass a directory to write into.')
  target = os.path.abspath(path)
  probe = target
  while not os.path.exists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      break
    probe = parent
  if not os.path.isdir(probe):
    raise UserError(f'{flag}={path!r} is not writable: {probe!r} is a file, '
                    'not a directory; choose another path.')
  try:
    name_max = os.pathconf(probe, 'PC_NAME_MAX')
  except (OSError, ValueError):
    name_max = 255  # Linux's, for file systems that do not say.
  too_long = [p for p in target[len(probe):].split(os.sep) if len(
      p.encode('utf-8', 'surrogateescape')) > name_max]
  if too_long:
    raise UserError(f'{flag}: the name {too_long[0][:40]!r}... has '
                    f'{len(too_long[0])} characters, more than the {name_max} '
                    'this file system allows; choose a shorter path.')
  if not os.access(probe, os.W_OK | os.X_OK):
    raise UserError(f'{flag}={path!r} is not writable (no write permission '
                    f'on {probe!r}); choose a directory you can write to.')


def create_logdir(logdir: str, params_text: str) -> None:
  """Creates `logdir` (if needed) and writes its params.txt.

  Raises:
    UserError: the directory or file cannot be created (a read-only or
      special file system, a name too long); nothing is left behind.
  """
  created = not os.path.isdir(logdir)
  try:
    os.makedirs(logdir, exist_ok=True)
    checkpoints.write_file_atomically(os.path.join(logdir, PARAMS_FILE),
                                      params_text)
  except OSError as e:
    if created and os.path.isdir(logdir) and not os.listdir(logdir):
      os.rmdir(logdir)
    raise UserError(f'Cannot write to --logdir={logdir!r}: {e.strerror}; '
                    'choose a directory you can write to.') from None


def _with_old_run_length(params: Params, old_text: str) -> str | None:
  """params' text with max_steps as in `old_text` (None if unreadable).

  max_steps only says how long to train, so continuing a finished run with a
  larger --max_steps is the same run, not a conflicting one.
  """
  try:
    old_steps = params.Copy().FromText(old_text).task.train.max_steps
  except Exception:  # pylint: disable=broad-except
    return None
  same = params.Copy()
  same.task.train.max_steps = old_steps
  return same.ToText()


def check_params_file(logdir: str, params: Params, force: bool) -> None:
  """Refuses (exit 2) a logdir whose params.txt differs, unless `force`
  (--force)."""
  path = os.path.join(logdir, PARAMS_FILE)
  if not os.path.exists(path):
    return
  old = read_text_file(path, 'restore the file the trainer wrote, or '
                       'use another --logdir')
  if old == params.ToText() or old == _with_old_run_length(params, old):
    return  # Same run, or the same run extended/shortened (max_steps).
  trained = next((l.split(':', 1)[1].strip(' \'"') for l in old.splitlines()
                  if l.startswith('model :')), params.model)
  if trained != params.model and not force:  # Not a 170-line diff.
    raise UserError(
        f'{path} is a run of {trained}, not {params.model}; give '
        f'--model={trained} to continue it, another --logdir, or --force.')
  diff = params_diff(old, params)
  if force:
    logging.warning('--force: replacing %s; differences:\n%s', path, diff)
    return
  sys.stderr.write(f'{diff}\n')
  raise UserError(
      f'{path} differs from this run\'s params (diff above: - logdir, + '
      'now); use the same model and overrides, another --logdir, or --force.')


def params_diff(old_text: str, new: Params) -> str:
  """`Params.TextDiff` of the logdir's params.txt against `new`."""
  try:
    old = new.Copy().FromText(old_text)
    return old.TextDiff(new)
  except (ParamsError, ValueError, ImportError, AttributeError):
    old_lines = set(old_text.splitlines())
    new_lines = set(new.ToText().splitlines())
    return '\n'.join([f'- {l}' for l in old_text.splitlines()
                      if l not in new_lines] +
                     [f'+ {l}' for l in new.ToText().splitlines()
                      if l not in old_lines])


def summary_writer(logdir: str, name: str) -> tf.summary.SummaryWriter:
  return tf.summary.create_file_writer(os.path.join(logdir, name))
