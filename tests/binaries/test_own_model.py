"""The console scripts as a new user meets them (issue 12).

README's own-model example, copied into an empty directory, trains for 5
steps through `lingvo_pipe_trainer --model=mymodel.WideMlp` (the user's
module is found in the working directory, as in Lingvo's pip workflow) and
is scored by `lingvo_pipe_evaler` from the same directory; `--help` lists
each binary's flags; TensorFlow's banner and checkpoint chatter stay off
the console unless --verbosity=1.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_BIN = pathlib.Path(sys.executable).parent
_ENV = {k: v for k, v in os.environ.items()
        if k not in ('PYTHONPATH', 'TF_CPP_MIN_LOG_LEVEL')}
_CHATTER = ('oneDNN', 'absl::InitializeLog', 'Sharding callback')


def _script(name: str) -> str:
  path = _BIN / name
  if not path.exists():
    pytest.skip(f'{path} is not installed (run tools/setup.sh).')
  return str(path)


def _run(args, cwd, timeout=300):
  result = subprocess.run(args, cwd=cwd, env=_ENV, capture_output=True,
                          text=True, check=False, timeout=timeout)
  return result.returncode, result.stdout, result.stderr


def readme_example() -> str:
  """The Python block after README's own-model marker."""
  text = (_ROOT / 'README.md').read_text(encoding='utf-8')
  m = re.search(r'<!-- own-model example[^>]*-->\s*```python\n(.*?)```', text,
                re.S)
  assert m, 'README lost its own-model example'
  return m.group(1)


def test_readme_example_is_about_thirty_lines():
  assert len(readme_example().splitlines()) <= 40


def test_own_model_in_an_empty_directory_trains_and_evaluates(tmp_path):
  work = tmp_path / 'work'
  work.mkdir()
  (work / 'mymodel.py').write_text(readme_example())
  logdir = tmp_path / 'log'
  rc, _, err = _run([_script('lingvo_pipe_trainer'), '--model=mymodel.WideMlp',
                     f'--logdir={logdir}', '--max_steps=5'], work)
  assert rc == 0, err
  assert 'step 5/5' in err and 'Tracing the train step' in err
  assert not [c for c in _CHATTER if c in err], err
  assert (logdir / 'ckpt-5.index').exists()
  assert "model : 'mymodel.WideMlp'" in (logdir / 'params.txt').read_text()
  rc, _, err = _run([_script('lingvo_pipe_evaler'), f'--logdir={logdir}',
                     '--eval_dataset=Test'], work)
  assert rc == 0, err
  assert 'Scored' in err and 'loss=' in err


def test_verbosity_brings_tensorflow_logs_back(tmp_path):
  (tmp_path / 'mymodel.py').write_text(readme_example())
  rc, _, err = _run([_script('lingvo_pipe_trainer'), '--model=mymodel.WideMlp',
                     f'--logdir={tmp_path / "log"}', '--max_steps=1',
                     '--verbosity=1'], tmp_path)
  assert rc == 0, err
  assert 'Sharding callback' in err
  # What a plain `import tensorflow` prints here (the oneDNN notice only
  # where oneDNN is on) comes back too.
  _, _, banner = _run([sys.executable, '-c', 'import tensorflow'], tmp_path)
  for marker in ('absl::InitializeLog', 'oneDNN'):
    assert (marker in err) == (marker in banner), (marker, err)


def test_an_unregistered_class_is_one_line_naming_the_decorator(tmp_path):
  (tmp_path / 'mymodel.py').write_text(
      readme_example().replace('@model_registry.RegisterSingleTaskModel\n',
                               ''))
  rc, _, err = _run([_script('lingvo_pipe_trainer'), '--model=mymodel.WideMlp',
                     f'--logdir={tmp_path / "log"}'], tmp_path)
  assert rc == 2, err
  assert len(err.strip().splitlines()) == 1, err
  assert 'RegisterSingleTaskModel' in err


@pytest.mark.parametrize('script, flags', [
    ('lingvo_pipe_trainer', ['--model', '--logdir', '--timeline_steps',
                             '--model_params_override', '--max_steps']),
    ('lingvo_pipe_evaler', ['--logdir', '--eval_dataset', '--mode']),
    ('lingvo_pipe_launch', ['--num_stages', '--num_replicas']),
    ('lingvo_pipe_prepare_data', ['--datasets', '--data_dir']),
])
def test_help_lists_the_flags(tmp_path, script, flags):
  rc, out, err = _run([_script(script), '--help'], tmp_path)
  assert rc in (0, 1), err  # absl's --help exits 1, argparse's 0.
  assert [f for f in flags if f not in out] == [], out
  assert 'oneDNN' not in err
