"""Registers our TFDS builders with TFDS, lazily, on `import lingvo_pipe`.

TFDS knows a builder once the module defining its class has been imported,
so `tfds.builder('lingvo_pipe_fashion_mnist')` fails unless something
imported `lingvo_pipe.tasks.image.fashion_mnist` first. Importing the
builders from `lingvo_pipe/__init__.py` would make every `import lingvo_pipe`
pay for TFDS (seconds) even in processes that never touch a data set. So
`install()` does the cheapest thing that keeps `tfds.builder(...)` working:

* if TFDS is already imported, it imports the builder modules now;
* otherwise it puts a finder at the front of `sys.meta_path` that waits for
  `import tensorflow_datasets`, lets the normal import run, then imports the
  builder modules and removes itself. Nothing else is imported or changed.

A builder module that fails to import is logged, never raised: it must not
break the user's `import tensorflow_datasets`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from typing import Any, Sequence

_TFDS = 'tensorflow_datasets'
BUILDER_MODULES = ('lingvo_pipe.tasks.image.fashion_mnist',
                   'lingvo_pipe.tasks.mt.bible_en_es')


def register_builders() -> None:
  """Imports the modules that define our builders (TFDS registers them)."""
  for name in BUILDER_MODULES:
    try:
      importlib.import_module(name)
    except Exception:  # pylint: disable=broad-except
      logging.getLogger(__name__).warning(
          'lingvo_pipe: could not register the TFDS builder in %s; '
          'tfds.builder() will not know it.', name, exc_info=True)


class _RegisteringLoader(importlib.abc.Loader):
  """Wraps TFDS's own loader: runs it, then registers our builders."""

  def __init__(self, loader: Any) -> None:
    self._loader = loader

  def create_module(self, spec: importlib.machinery.ModuleSpec
                   ) -> types.ModuleType | None:
    return self._loader.create_module(spec)

  def exec_module(self, module: types.ModuleType) -> None:
    self._loader.exec_module(module)
    register_builders()

  def __getattr__(self, name: str) -> Any:  # get_resource_reader, ...
    return getattr(self._loader, name)


class _TfdsFinder(importlib.abc.MetaPathFinder):
  """Finds `tensorflow_datasets` with the other finders, wraps its loader."""

  def find_spec(self, fullname: str, path: Sequence[str] | None,
                target: types.ModuleType | None = None
               ) -> importlib.machinery.ModuleSpec | None:
    if fullname != _TFDS:
      return None
    uninstall()  # One shot: whatever happens next, we are done.
    for finder in sys.meta_path:
      find = getattr(finder, 'find_spec', None)
      spec = find(fullname, path, target) if find else None
      if spec is not None:
        if spec.loader is not None:
          spec.loader = _RegisteringLoader(spec.loader)
        return spec
    return None


def install() -> None:
  """Makes `tfds.builder('lingvo_pipe_*')` work (see the module docstring)."""
  if _TFDS in sys.modules:
    register_builders()
  elif not any(isinstance(f, _TfdsFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _TfdsFinder())


def uninstall() -> None:
  """Removes the finder, if it is still waiting."""
  sys.meta_path[:] = [f for f in sys.meta_path
                      if not isinstance(f, _TfdsFinder)]
