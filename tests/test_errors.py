"""One error root: every `*Error` class of the package derives from
`lingvo_pipe.LingvoPipeError`, and no two of them share a name.

Guards issue 11: 22 error classes had no common base, the CLI listed 10 of
them, and `PartitionError`, `MicroBatchError`, ... escaped as tracebacks;
`learning_rate.ScheduleError` and `schedule.ScheduleError` were two
unrelated classes with one name.
"""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil

import pytest

import lingvo_pipe
from lingvo_pipe import errors

# The binaries define absl flags with the same names (--model, --logdir), so
# one process cannot import both; their classes are found by reading them.
_BINARIES = ('lingvo_pipe.trainer', 'lingvo_pipe.evaler')


def _module_names():
  return sorted(info.name for info in pkgutil.walk_packages(
      lingvo_pipe.__path__, 'lingvo_pipe.'))


def _imported_error_classes():
  """{(module, qualname): class} of every *Error class in the package."""
  found = {}
  for name in _module_names():
    if name in _BINARIES:
      continue
    module = importlib.import_module(name)
    for _, obj in inspect.getmembers(module, inspect.isclass):
      if (obj.__module__ == name and obj.__name__.endswith('Error')):
        found[(name, obj.__qualname__)] = obj
  return found


def _error_classes_in_source():
  """{(module, class name)} of every `class *Error` statement, any depth."""
  out = set()
  for name in _module_names():
    path = pathlib.Path(importlib.util.find_spec(name).origin)
    tree = ast.parse(path.read_text(encoding='utf-8'))
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef) and node.name.endswith('Error'):
        out.add((name, node.name))
  return out


def test_the_walk_sees_every_module_family():
  names = _module_names()
  for family in ('lingvo_pipe.core.', 'lingvo_pipe.pipeline.',
                 'lingvo_pipe.layers.', 'lingvo_pipe.tasks.',
                 'lingvo_pipe.params.'):
    assert any(n.startswith(family) for n in names), family


def test_every_error_class_derives_from_the_root():
  classes = _imported_error_classes()
  assert len(classes) >= 20  # 21 module errors and the root, at the time.
  not_rooted = sorted(f'{m}.{q}' for (m, q), cls in classes.items()
                      if not issubclass(cls, errors.LingvoPipeError))
  assert not not_rooted, f'not under LingvoPipeError: {not_rooted}'


def test_no_error_class_hides_from_the_walk():
  # The binaries are not imported above: read every class statement.
  imported = {(m, q.rsplit('.', 1)[-1]) for m, q in _imported_error_classes()}
  unseen = _error_classes_in_source() - imported
  assert not unseen, f'*Error classes the import walk missed: {unseen}'


def test_no_two_error_classes_share_a_name():
  by_name = {}
  for (module, qualname), cls in _imported_error_classes().items():
    by_name.setdefault(cls.__name__, []).append(module)
  shared = {n: m for n, m in by_name.items() if len(m) > 1}
  assert not shared, shared


@pytest.mark.parametrize('module, name, builtin', [
    ('lingvo_pipe.core.params_text', 'ParamsError', AttributeError),
    ('lingvo_pipe.pipeline.devices', 'DeviceError', RuntimeError),
    ('lingvo_pipe.core.model_registry', 'ModelRegistryError', LookupError),
    ('lingvo_pipe.tasks.data_paths', 'MissingDataError', FileNotFoundError),
])
def test_rebased_errors_keep_their_old_builtin_kind(module, name, builtin):
  # `hasattr(params, 'typo')` is False because ParamsError is an
  # AttributeError; `except RuntimeError` still catches a DeviceError.
  cls = getattr(importlib.import_module(module), name)
  assert issubclass(cls, builtin) and issubclass(cls, ValueError)
  assert str(cls('one line')) == 'one line'


def test_the_root_is_exported_from_the_package():
  assert lingvo_pipe.LingvoPipeError is errors.LingvoPipeError
