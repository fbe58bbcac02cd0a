"""What the package promises users: its names, its extras, quiet imports.

Guards issue 12's bugs: a wheel that installed top-level `tasks`/`params`
packages (a user's own tasks.py broke every model), tensorflow-cpu and the
optional libraries forced on everyone, `_cli` swapping file descriptors at
import time, and library code calling sys.exit.
"""

import ast
import collections
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import lingvo_pipe
from lingvo_pipe import params as lp_params
from lingvo_pipe import tasks as lp_tasks

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_PACKAGE = pathlib.Path(lingvo_pipe.__file__).parent


def _python(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  return subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        check=False, timeout=300)


def _pyproject() -> dict:
  with open(_ROOT / 'pyproject.toml', 'rb') as f:
    return tomllib.load(f)


def test_test_files_have_unique_basenames():
  # tests/ has no __init__.py: pytest imports each test file by its basename,
  # and two tests/**/test_cluster.py stopped `bash tools/test.sh` (README's
  # test command) at collection. Under Bazel each target sees only its own
  # files; tools/test.sh tests/package (CI's first step) checks the tree.
  counts = collections.Counter(p.name for p in (_ROOT / 'tests').rglob(
      'test_*.py'))
  twins = sorted(name for name, n in counts.items() if n > 1)
  assert not twins, (f'{twins}: test files share a basename; rename one '
                     '(pytest imports them by basename).')


def test_tasks_and_params_live_inside_the_package():
  assert lp_tasks.__path__[0].endswith(os.path.join('lingvo_pipe', 'tasks'))
  assert lp_params.__path__[0].endswith(os.path.join('lingvo_pipe', 'params'))


def test_no_top_level_tasks_or_params_package(tmp_path):
  result = _python("""
      import importlib.util
      import lingvo_pipe.tasks.data_paths, lingvo_pipe.params.synthetic
      print(importlib.util.find_spec('tasks'), importlib.util.find_spec('params'))
      """, tmp_path)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == ['None', 'None']


def test_version_is_the_distributions():
  assert lingvo_pipe.__version__ == importlib.metadata.version('lingvo_pipe')


def test_extras_and_core_dependencies():
  project = _pyproject()['project']
  core = ' '.join(project['dependencies'])
  for heavy in ('tensorflow-cpu', 'tensorflow>', 'matplotlib', 'sacrebleu',
                'sentencepiece', 'tensorboard'):
    assert heavy not in core, heavy
  extras = project['optional-dependencies']
  assert extras['cpu'][0].startswith('tensorflow-cpu')
  assert extras['gpu'][0].startswith('tensorflow>')
  assert set(extras['mt']) == {'sacrebleu', 'sentencepiece'}
  assert extras['plots'] == ['matplotlib']
  assert extras['tensorboard'] == ['tensorboard']
  assert project['license']['text'] == 'Apache-2.0'
  assert set(project['urls']) >= {'Homepage', 'Source'}
  assert set(project['scripts']) == {'lingvo_pipe_trainer',
                                     'lingvo_pipe_evaler',
                                     'lingvo_pipe_worker',
                                     'lingvo_pipe_launch',
                                     'lingvo_pipe_prepare_data'}
  assert all(target.startswith('lingvo_pipe._entry:')
             for target in project['scripts'].values())
  licence = (_ROOT / 'LICENSE').read_text()
  assert 'Apache License' in licence and 'Version 2.0' in licence


def test_importing_the_binaries_swaps_no_file_descriptor(tmp_path):
  for binary in ('trainer', 'evaler'):  # One process each: their flags clash.
    result = _python(f"""
        import os
        calls = []
        real = os.dup2
        os.dup2 = lambda *args, **kwargs: calls.append(args) or real(*args,
                                                                     **kwargs)
        import lingvo_pipe.{binary}
        print(len(calls))
        """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['0'], binary


def _exits_outside_entry_points(path: pathlib.Path) -> list[str]:
  """`sys.exit(...)` calls outside main/run functions and __main__ blocks."""
  allowed_functions = {'main', 'run', '_main'}
  if path.name == '_entry.py':
    return []
  allowed_functions |= {'_parse', 'exit_on_user_error'} if (
      path.name == '_cli.py') else set()
  # The launcher's absl flags parser, as _cli's for the binaries.
  allowed_functions |= {'_parse'} if path.name == 'launch.py' else set()
  found = []

  def visit(node: ast.AST, inside: str) -> None:
    for child in ast.iter_child_nodes(node):
      name = inside
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = child.name
      if isinstance(child, ast.If) and '__main__' in ast.unparse(child.test):
        continue
      if (isinstance(child, ast.Call) and
          ast.unparse(child.func) == 'sys.exit' and
          name not in allowed_functions):
        found.append(f'{path}:{child.lineno} (in {name or "module"})')
      visit(child, name)

  visit(ast.parse(path.read_text()), '')
  return found


def test_library_code_raises_instead_of_calling_sys_exit():
  found, paths = [], []
  for folder, _, files in os.walk(_PACKAGE, followlinks=True):  # tasks/ too.
    paths += [pathlib.Path(folder) / f for f in files if f.endswith('.py')]
  assert any(p.name == 'prepare_data.py' for p in paths)
  for path in sorted(paths):
    found += _exits_outside_entry_points(path)
  assert not found, found
