"""The trainer's `--profile_steps`: TensorFlow's profiler over real steps.

Where `--timeline_steps` shows the pipeline's forward/backward spans, the
profiler shows every kernel of every thread: which ops a stage runs, how
long each took, when a collective send or receive began and ended, and
which threads ran at once. Steps FIRST..LAST (counted from 1) run under
`tf.profiler.experimental.start`/`stop`, and each task writes its own
trace (tasks of one host would otherwise write the same file name):

    <logdir>/profile/task<i>/plugins/profile/<time>/<host>.xplane.pb

TensorBoard's Profile tab reads it (`tensorboard --logdir=<logdir>/profile`
with the `tensorboard-plugin-profile` package); `tools/profile_report.py`
prints per task, without TensorBoard, the step times, the ops' time by
type and how much of a step the task's kernels were busy.

The first traced step pays the profiler's start-up; a range of two or more
steps shows the steady state. The profiler slows a traced step (each
kernel is stamped), so read its times beside each other, not as the
untraced step's.
"""

from __future__ import annotations

import glob
import os

import tensorflow as tf

from lingvo_pipe import errors

PROFILE_DIR = 'profile'


class ProfileStepsError(errors.LingvoPipeError):
  """--profile_steps cannot be honoured; the message says why and the fix."""


def parse(values: list[str]) -> tuple[int, int] | None:
  """(first, last) from the flag's `FIRST[,LAST]`; None if not given."""
  if not values:
    return None
  text = ','.join(values)
  try:
    steps = [int(v) for v in values]
  except ValueError:
    steps = []
  if len(steps) not in (1, 2) or steps[0] < 1 or steps[-1] < steps[0]:
    raise ProfileStepsError(
        f'--profile_steps={text}: give the first and last step to trace, '
        'counted from 1, e.g. --profile_steps=10 or 10,12.')
  return steps[0], steps[-1]


def task_dir(logdir: str, task: int | str) -> str:
  """Where task `task` writes its trace (TensorBoard's run directory)."""
  return os.path.join(logdir, PROFILE_DIR, f'task{task}')


def latest_traces(logdir: str) -> dict[str, str]:
  """Per task directory (`task<i>`), its latest trace file (TF names it
  plugins/profile/<time>/<host>.xplane.pb under the directory given)."""
  found = {}
  for path in sorted(glob.glob(task_dir(logdir, '*'))):
    files = sorted(glob.glob(os.path.join(path, 'plugins', 'profile', '*',
                                          '*.xplane.pb')))
    if files:
      found[os.path.basename(path)] = files[-1]
  return found


class StepProfiler:
  """Starts the profiler before step `first` and stops it after `last`
  (or when training ends first, from `close`); does nothing if `steps` is
  None (no --profile_steps)."""

  def __init__(self, logdir: str, steps: tuple[int, int] | None,
               task: int) -> None:
    self._first, self._last = steps or (0, 0)  # Step 0 never runs.
    self._dir = task_dir(logdir, task)
    self._on = False

  def before(self, step: int) -> None:
    if step == self._first:
      os.makedirs(self._dir, exist_ok=True)
      tf.profiler.experimental.start(self._dir)
      self._on = True

  def after(self, step: int) -> None:
    if self._on and step >= self._last:
      self.close()

  def close(self) -> None:
    """Stops the profiler, writing the trace, if it runs."""
    if self._on:
      self._on = False
      tf.profiler.experimental.stop()
