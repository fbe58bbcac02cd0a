"""tools/compare_commits.py: ABBA order, figures, the summary, bad input."""

import importlib.util
import json
import os

import pytest

from benchmark_tool import RECORDED

_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'tools', 'compare_commits.py')


def _load():
  spec = importlib.util.spec_from_file_location('compare_commits', _TOOL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_rounds_alternate_abba():
  tool = _load()
  assert tool.order(3) == [(0, 'old'), (0, 'new'), (1, 'new'), (1, 'old'),
                           (2, 'old'), (2, 'new')]


def test_figures_of_recorded_sections():
  tool = _load()
  with open(RECORDED) as f:
    recorded = json.load(f)
  eff = tool.FIGURES['efficiency'](recorded['efficiency'])
  assert eff['efficiency'] == recorded['efficiency']['rounds'][0][
      'efficiency']
  assert eff['K=2 step (s)'] > 0
  peer = dict(recorded['peer'], torch={'gpipe': 0.5})
  got = tool.FIGURES['peer'](peer)
  assert got['gpipe ÷ torch'] == pytest.approx(peer['ours']['gpipe'] / 0.5)
  assert '1f1b ÷ torch' not in got  # torch has no 1F1B figure here.


def test_summary_divides_the_medians():
  tool = _load()
  rows = tool.summary({'old': {'step': [1.0, 3.0, 2.0], 'only old': [1.0]},
                       'new': {'step': [2.2, 2.4, 9.0]}})
  assert rows == [['step', '1, 3, 2', '2.2, 2.4, 9', '1.200']]


def test_bad_sections_exit_2(capsys):
  tool = _load()
  assert tool.main(['HEAD', '--sections=nope']) == 2
  assert 'nope' in capsys.readouterr().err


def test_an_unknown_revision_is_one_line_exit_2(capsys):
  tool = _load()
  assert tool.main(['no_such_revision_xyz', '--rounds=1']) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1
  assert "'no_such_revision_xyz' is not a commit" in err
