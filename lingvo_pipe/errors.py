"""The one exception root of lingvo_pipe: catch `LingvoPipeError`.

Every error that lingvo_pipe raises on purpose (a bad param, a partition
that cannot be cut, a batch that cannot be split into micro-batches, data
that is not there, an unreadable checkpoint) is a subclass of
`LingvoPipeError`, and its message names the path, the param, the value and
a fix. Each module keeps its own named class (`hyperparams.ParamsError`,
`partitioner.PartitionError`, ...), so a caller can be as precise as it
likes, and a caller that only wants "my config is wrong, tell the user"
catches the root:

    try:
      task = params.task.Instantiate()
    except lingvo_pipe.LingvoPipeError as e:
      print(f'error: {e}')

The binaries do exactly that: any `LingvoPipeError` becomes one stderr line
and exit status 2; anything else is a bug and keeps its traceback.

The root subclasses `ValueError` because most of these errors were
ValueErrors before the root existed, and code that catches ValueError keeps
working. Module errors that were another built-in kind keep it as a second
base (`class DeviceError(LingvoPipeError, RuntimeError)`), so
`except RuntimeError` still catches a DeviceError.

This module imports nothing, so any module (TensorFlow-free ones included)
can derive from the root without an import cycle.
"""

from __future__ import annotations


class LingvoPipeError(ValueError):
  """Base of every error lingvo_pipe raises about its input.

  >>> from lingvo_pipe.core.hyperparams import Params
  >>> try:
  ...   Params().learning_rat
  ... except LingvoPipeError as e:
  ...   print(type(e).__name__)
  ParamsError
  """
