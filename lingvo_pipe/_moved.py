"""Old import paths of modules that moved, kept working with a warning.

A user's code written against an earlier release imports modules where
they were then (`from lingvo_pipe.core import partitioner`). When a module
moves, its old path stays importable: it gives the module at the new path
and warns once, naming that path. A module that was retired outright
raises an ImportError saying what replaced it. `install()` (run by
`import lingvo_pipe`) adds the import hook; it imports nothing heavy.

>>> import importlib, warnings
>>> with warnings.catch_warnings(record=True) as caught:
...   warnings.simplefilter('always')
...   old = importlib.import_module('lingvo_pipe.core.partitioner')
>>> old.partition is importlib.import_module(
...     'lingvo_pipe.pipeline.partitioner').partition
True
>>> 'lingvo_pipe.pipeline.partitioner' in str(caught[0].message)
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

# Old path → new path.
MOVED = {
    'lingvo_pipe.core.devices': 'lingvo_pipe.pipeline.devices',
    'lingvo_pipe.core.microbatch': 'lingvo_pipe.pipeline.microbatch',
    'lingvo_pipe.core.partitioner': 'lingvo_pipe.pipeline.partitioner',
    'lingvo_pipe.core.pipeline': 'lingvo_pipe.pipeline.engine',
    'lingvo_pipe.core.schedule': 'lingvo_pipe.pipeline.schedule',
    'lingvo_pipe.core.simulator': 'lingvo_pipe.pipeline.simulator',
    'lingvo_pipe.core.timeline': 'lingvo_pipe.pipeline.timeline',
    'lingvo_pipe.core.transparency': 'lingvo_pipe.pipeline.transparency',
    'lingvo_pipe.pipeline.stage_ops': 'lingvo_pipe.pipeline.stage',
}
_STAGE_PROCESSES = (
    'one process per stage replaces it: `python -m lingvo_pipe.launch '
    '--num_stages=K -- --model=...` on one host, or `python -m '
    'lingvo_pipe.worker` with TF_CONFIG on several (README, "Running on '
    'several GPUs or hosts")')
# Old path → what replaced it.
RETIRED = {
    'lingvo_pipe.core.cluster': _STAGE_PROCESSES,
    'lingvo_pipe.pipeline.cluster': _STAGE_PROCESSES,
    'lingvo_pipe.pipeline.walker': 'the executor (lingvo_pipe.pipeline.'
                                   'executor) runs a schedule\'s actions',
}


class MovedModuleWarning(FutureWarning):
  """A module was imported by a path it has moved from."""


class _Moved(types.ModuleType):
  """Stands at an old path: every attribute comes from the new module."""

  def __init__(self, name: str, target: types.ModuleType) -> None:
    super().__init__(name, target.__doc__)
    self.__dict__['_target'] = target

  def __getattr__(self, attr: str) -> Any:
    return getattr(self.__dict__['_target'], attr)

  def __dir__(self) -> list[str]:
    return dir(self.__dict__['_target'])


class _Loader(importlib.abc.Loader):

  def create_module(self, spec: importlib.machinery.ModuleSpec
                   ) -> types.ModuleType:
    name = spec.name
    if name in RETIRED:
      raise ImportError(f'{name} was retired: {RETIRED[name]}.', name=name)
    warnings.warn(f'{name} moved to {MOVED[name]}; import it from there '
                  f'(the old path will be removed).', MovedModuleWarning,
                  stacklevel=2)
    return _Moved(name, importlib.import_module(MOVED[name]))

  def exec_module(self, module: types.ModuleType) -> None:
    del module  # Its attributes are the new module's.


class _Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname: str, path: Any = None, target: Any = None
               ) -> importlib.machinery.ModuleSpec | None:
    del path, target
    if fullname in MOVED or fullname in RETIRED:
      return importlib.machinery.ModuleSpec(fullname, _Loader())
    return None


def install() -> None:
  """Adds the import hook for the old paths (once)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
