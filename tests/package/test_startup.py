"""The binaries' start-up: --verbosity read before TensorFlow loads, extras
named when missing, TensorFlow's INFO chatter filtered by where it comes
from."""

import logging
import subprocess
import sys

from absl import logging as absl_logging
import pytest

from lingvo_pipe import _startup
from lingvo_pipe import extras


@pytest.mark.parametrize('argv, level', [
    (['trainer'], 0),
    (['trainer', '--verbosity=1'], 1),
    (['trainer', '-v', '2'], 2),
    (['trainer', '-v=1', '--model=x'], 1),
    (['trainer', '--verbosity', '-1'], -1),
    (['trainer', '--verbosity=oops'], 0),
    (['trainer', '--model=verbosity'], 0),
])
def test_requested_verbosity(argv, level):
  assert _startup.requested_verbosity(argv) == level


def test_a_missing_extra_names_it(monkeypatch):
  monkeypatch.setitem(sys.modules, 'sacrebleu', None)  # Import fails.
  with pytest.raises(extras.MissingExtraError,
                     match=r"BLEU needs .*'sacrebleu'.*lingvo_pipe\[mt\]"):
    extras.require('sacrebleu', 'mt', 'BLEU')


def test_missing_tensorflow_names_both_extras(monkeypatch):
  monkeypatch.delitem(sys.modules, 'tensorflow')
  monkeypatch.setattr(_startup.importlib.util, 'find_spec', lambda name: None)
  with pytest.raises(extras.MissingExtraError,
                     match=r"lingvo_pipe\[cpu\].*lingvo_pipe\[gpu\]"):
    _startup.import_tensorflow(['trainer'])


def _record(pathname: str, level: int) -> logging.LogRecord:
  return logging.LogRecord('absl', level, pathname, 1, 'msg', None, None)


def test_library_info_lines_are_dropped_below_verbosity_one():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf_file = tf.__file__.replace('__init__.py', 'python/checkpoint/saver.py')
  handler = absl_logging.get_absl_handler()
  try:
    _startup.configure_python_logging(0)
    assert not handler.filter(_record(tf_file, logging.INFO))
    assert handler.filter(_record(tf_file, logging.WARNING))
    assert handler.filter(_record(__file__, logging.INFO))
    _startup.configure_python_logging(1)
    assert handler.filter(_record(tf_file, logging.INFO))
  finally:
    _startup.configure_python_logging(1)  # Leaves no filter behind.
    logging.getLogger('tensorflow').setLevel(logging.NOTSET)


def test_tensorflow_starts_without_pyplot_and_pyplot_still_imports():
  """Keras imports matplotlib.pyplot when TensorFlow loads (0.3 s or more
  of every process's start); the binaries load TensorFlow without it, and
  pyplot imports as usual afterwards."""
  pytest.importorskip('matplotlib')
  code = '\n'.join([
      'import sys',
      'from lingvo_pipe import _startup',
      "_startup.import_tensorflow(['trainer'])",
      "assert 'keras' in sys.modules, 'Keras no longer loads with TF'",
      "assert 'matplotlib.pyplot' not in sys.modules",
      "import matplotlib; matplotlib.use('Agg')",
      'import matplotlib.pyplot as plt',
      'assert plt.figure() is not None',
  ])
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
