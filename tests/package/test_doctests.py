"""Every `>>>` example in the package runs (as Sonnet's doctest_test does).

Modules are found by walking lingvo_pipe (tasks/ and params/ included) and
imported only if their source holds a `>>>`; each runs as one test, with the
module's own globals, so a docstring example cannot rot unseen.
"""

import doctest
import importlib
import os
import pathlib

import pytest

import lingvo_pipe

_PACKAGE = pathlib.Path(lingvo_pipe.__file__).parent


def _modules_with_examples() -> list[str]:
  names = []
  for folder, _, files in os.walk(_PACKAGE, followlinks=True):
    for f in sorted(files):
      path = pathlib.Path(folder) / f
      if f.endswith('.py') and '>>>' in path.read_text(encoding='utf-8'):
        rel = path.relative_to(_PACKAGE.parent).with_suffix('')
        names.append('.'.join(p for p in rel.parts if p != '__init__'))
  return sorted(names)


_MODULES = _modules_with_examples()


def test_examples_are_found():
  assert 'lingvo_pipe.core.hyperparams' in _MODULES
  assert 'lingvo_pipe.tasks.datasets' in _MODULES  # Through the symlink.


@pytest.mark.parametrize('name', _MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS |
                           doctest.NORMALIZE_WHITESPACE, verbose=False)
  assert result.attempted > 0, f'{name}: no example ran'
  assert result.failed == 0, f'{name}: {result.failed} example(s) failed'
