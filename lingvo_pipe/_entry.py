"""The console scripts: `lingvo_pipe_trainer`, `_evaler`, `_worker`, `_launch`,
`_prepare_data`.

Each imports TensorFlow first, quietly (`_startup.import_tensorflow`), then
its binary, and runs it; a missing TensorFlow is one line naming the extra
that installs it, not a traceback. `python -m lingvo_pipe.trainer` (and
evaler, tasks.prepare_data) do the same from their `__main__` blocks.
"""

from __future__ import annotations

import importlib
import sys

from lingvo_pipe import _signals
from lingvo_pipe import _startup
from lingvo_pipe import extras


def _start(program: str, stopped: str) -> None:
  # A signal during start-up (importing TensorFlow is the slow part) is one
  # line, not a KeyboardInterrupt traceback or a silent death.
  _signals.exit_on_signals(program, stopped)
  try:
    _startup.import_tensorflow(sys.argv)
  except extras.MissingExtraError as e:
    sys.stderr.write(f'{program}: error: {e}\n')
    sys.exit(2)


def trainer() -> None:
  """`lingvo_pipe_trainer`: see lingvo_pipe/trainer.py."""
  _start('trainer', _signals.STARTUP)
  importlib.import_module('lingvo_pipe.trainer').run()


def evaler() -> None:
  """`lingvo_pipe_evaler`: see lingvo_pipe/evaler.py."""
  _start('evaler', _signals.EVALER)
  importlib.import_module('lingvo_pipe.evaler').run()


def worker() -> None:
  """`lingvo_pipe_worker`: see lingvo_pipe/worker.py."""
  _start('worker', _signals.STARTUP)
  importlib.import_module('lingvo_pipe.worker').run()


def launch() -> None:
  """`lingvo_pipe_launch`: see lingvo_pipe/launch.py (imports no TF)."""
  module = importlib.import_module('lingvo_pipe.launch')
  _startup.show_in_help(module)
  module.run()


def prepare_data() -> None:
  """`lingvo_pipe_prepare_data`: see lingvo_pipe/tasks/prepare_data.py."""
  _start('prepare_data', _signals.STARTUP)
  sys.exit(importlib.import_module('lingvo_pipe.tasks.prepare_data').main())
