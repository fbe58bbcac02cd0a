"""Start-up of the binaries: TensorFlow's banner and log levels.

A user who runs `lingvo_pipe_trainer` should see our lines, not TensorFlow's
start-up banner (oneDNN notices, CPU feature lines, "All log messages before
absl::InitializeLog()"), which TF 2.21 prints on stderr while it is imported,
whatever TF_CPP_MIN_LOG_LEVEL says; nor, at every checkpoint, its
"Sharding callback duration" line. Both come back with `--verbosity=1` (absl's
own flag, also `-v 1`).

Nothing here runs at import time: the entry points call
`import_tensorflow(argv)` first thing (before anything imports TensorFlow),
and `_cli`'s flags parser calls `configure_python_logging()` once the flags
are parsed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import types
from typing import Iterator, Sequence

from lingvo_pipe import extras

_BANNER = re.compile(
    r'^([IW]\d{4} |WARNING: All log messages before absl::InitializeLog|'
    r'To enable the following instructions|E\d{4} .*(Unable to register|'
    r'already been registered))')
_VERBOSITY = re.compile(r'^(?:--verbosity|-v)(?:=(-?\d+))?$')


def requested_verbosity(argv: Sequence[str]) -> int:
  """The absl verbosity that `argv` asks for (`--verbosity=N`, `-v N`); 0."""
  level = 0
  args = list(argv[1:])
  for i, arg in enumerate(args):
    m = _VERBOSITY.match(arg)
    if not m:
      continue
    value = m.group(1) if m.group(1) is not None else (
        args[i + 1] if i + 1 < len(args) else '')
    try:
      level = int(value)
    except ValueError:
      pass  # absl reports the malformed flag later.
  return level


def import_tensorflow(argv: Sequence[str]) -> None:
  """Imports TensorFlow, without its start-up banner unless `argv` asks for
  `--verbosity` ≥ 1. A no-op if TensorFlow is imported already.

  Raises:
    MissingExtraError: TensorFlow is not installed.
  """
  if 'tensorflow' in sys.modules:
    return
  if importlib.util.find_spec('tensorflow') is None:
    raise extras.MissingExtraError(
        "lingvo_pipe needs TensorFlow, which is not installed: pip install "
        "'lingvo_pipe[cpu]' (CPU) or 'lingvo_pipe[gpu]' (GPU).")
  if requested_verbosity(argv) >= 1:
    with _keras_without_pyplot():
      importlib.import_module('tensorflow')
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      with _keras_without_pyplot():
        importlib.import_module('tensorflow')
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      text = captured.read().decode('utf-8', 'replace')
      kept = [line for line in text.splitlines() if not _BANNER.match(line)]
      if kept:
        sys.stderr.write('\n'.join(kept) + '\n')


@contextlib.contextmanager
def _keras_without_pyplot() -> Iterator[None]:
  """While TensorFlow loads, `import matplotlib.pyplot` fails.

  `import tensorflow` imports Keras, and Keras 3 imports matplotlib.pyplot
  at import time when matplotlib is installed (the `[plots]` extra), for its
  image-gallery helpers (0.3 s of CPU per process alone, 1.8 s on a busy
  machine by `python -X importtime`) in every process (binaries,
  stage processes, tests), for a module none of them uses. Keras catches
  the ImportError and leaves those helpers without pyplot; once TensorFlow
  is in, pyplot imports as usual (tools/bench/plots.py draws with it). A
  lazy module does not work here: Python 3.11's import statement reads
  `__spec__` of a module already in sys.modules, which loads it.
  """
  name = 'matplotlib.pyplot'
  if name in sys.modules:
    yield
    return
  sys.modules[name] = None  # type: ignore[assignment]
  try:
    yield
  finally:
    if name in sys.modules and sys.modules[name] is None:
      del sys.modules[name]


class _DropLibraryInfo(logging.Filter):
  """Drops INFO (and lower) records logged from inside `roots`."""

  def __init__(self, roots: tuple[str, ...]) -> None:
    super().__init__()
    self._roots = roots

  def filter(self, record: logging.LogRecord) -> bool:
    return (record.levelno >= logging.WARNING or
            not record.pathname.startswith(self._roots))


def _package_roots(names: Sequence[str]) -> tuple[str, ...]:
  roots = []
  for name in names:
    spec = importlib.util.find_spec(name)
    for path in (spec.submodule_search_locations or []) if spec else []:
      roots.append(os.path.join(os.path.realpath(path), ''))
      roots.append(os.path.join(path, ''))
  return tuple(roots)


def show_in_help(module: types.ModuleType) -> None:
  """Makes absl's --help describe `module` when it runs as a console script.

  absl's --help lists the flags of the module named by sys.argv[0] and
  prints the `__main__` module's docstring; a console script's `__main__` is
  pip's wrapper, which has neither, so both are taken from `module`. A
  no-op under `python -m` (then `module` is `__main__`).
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  main_module = sys.modules.get('__main__')
  if main_module is module:
    return
  for flag in flags.FLAGS.get_key_flags_for_module(module.__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  if main_module is not None and not main_module.__doc__:
    main_module.__doc__ = module.__doc__


def configure_python_logging(verbosity: int) -> None:
  """TensorFlow's (and TFDS's) INFO lines, such as the checkpoint saver's
  "Sharding callback duration", only at verbosity ≥ 1.

  TensorFlow logs some of them through absl's logger, which the binaries'
  own progress lines use too, so they are told apart by the file that
  logged them.
  """
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  handler = absl_logging.get_absl_handler()
  for old in [f for f in handler.filters if isinstance(f, _DropLibraryInfo)]:
    handler.removeFilter(old)
  if verbosity < 1:
    handler.addFilter(_DropLibraryInfo(_package_roots(
        ('tensorflow', 'tensorflow_datasets', 'keras'))))
  logging.getLogger('tensorflow').setLevel(
      logging.NOTSET if verbosity >= 1 else logging.WARNING)
