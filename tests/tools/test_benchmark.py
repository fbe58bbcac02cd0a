"""tools/benchmark.py: every section renders, and its helpers (cheap).

Every section's Markdown and pictures are rendered from tiny results
recorded by the sections themselves (`benchmark_tool.RECORDED`); running
each section end to end at tiny sizes is test_benchmark_sections.py
(tagged rehearsal: each section starts stage processes, minutes in all).
"""

import json
import os
import re
import shutil
from typing import Any

import pytest

import benchmark_tool  # pylint: disable=g-bad-import-order

benchmark_tool.load()  # Puts tools/ on sys.path.
from bench import peer  # pylint: disable=C0413
from bench import report  # pylint: disable=C0413
from bench import sections  # pylint: disable=C0413
from bench import stage_procs  # pylint: disable=C0413
from bench import table1  # pylint: disable=C0413
from bench import training  # pylint: disable=C0413


def _recorded() -> dict:
  with open(benchmark_tool.RECORDED, encoding='utf-8') as f:
    return json.load(f)


def test_every_section_is_tested():
  assert set(benchmark_tool.EXPECTED) == set(sections.NAMES)


@pytest.mark.parametrize('name', sections.NAMES)
def test_section_renders_from_recorded_tiny_results(name, tmp_path):
  record = (f'record them: python tools/benchmark.py {name} --tiny '
            '--out_dir tests/tools/data/tiny')
  results = _recorded()
  assert name in results, f'No recorded tiny results for {name!r}; {record}'
  section = results[name]
  assert section['tiny'] and section['command'].startswith(
      'python tools/benchmark.py ' + name)
  shutil.copy(benchmark_tool.RECORDED, tmp_path / 'benchmarks.json')
  sections.finish(str(tmp_path), 'python tools/benchmark.py all --tiny', 1.0)
  text = (tmp_path / 'benchmarks.md').read_text()
  assert '# lingvo_pipe benchmarks' in text and 'Machine:' in text
  for title in sections.TITLES:
    assert f'## {title}' in text  # Every section, run or not.
  own = text.split(f'## {sections.TITLES[sections.NAMES.index(name)]}\n')[1]
  assert 'predate' not in own.split('\n## ')[0], (
      f'The recorded {name!r} results no longer render; {record}')
  for snippet in benchmark_tool.EXPECTED[name]:
    assert snippet in text, snippet
  if name not in benchmark_tool.DRAWN_WHILE_RUNNING:
    for filename in benchmark_tool.FILES.get(name, []):
      assert (tmp_path / filename).stat().st_size > 100, filename


def test_a_failed_launch_stops_every_task():
  """A stage process that fails takes the others down; nothing is left."""
  spec = {'configs': [{'name': 'bad', 'scope': 'run', 'K': 2, 'M': 2,
                       'net': [3, 8, 8], 'schedule': 'no such schedule'}]}
  with pytest.raises(stage_procs.LaunchError, match='no such schedule'):
    stage_procs.launch(spec, 2, timeout_s=300)
  run = stage_procs.launch(spec, 2, allow_failure=True, timeout_s=300)
  assert run.returncode and not run.oom and len(run.pids) == 2
  assert not any(benchmark_tool.alive(pid) for pid in run.pids)


def test_search_brackets_the_largest_fitting_size():
  calls = []

  def _fits(n):
    calls.append(n)
    return n <= 37

  lo, hi = table1.search(_fits, start=4, tolerance=1.125, limit=1000)
  assert lo <= 37 < hi and hi / lo <= 1.125
  assert calls[:5] == [4, 8, 16, 32, 64]  # Doubling first.
  assert table1.search(lambda n: n <= 3, 16, 1.0, 100) == (3, 4)  # Halving.
  assert table1.search(lambda n: True, 4, 1.5, 20) == (20, 0)  # Capped.
  assert table1.search(lambda n: False, 4, 1.5, 20) == (0, 1)


def test_busy_together_and_handoffs_from_records():
  # Device 0 runs [0, 2] and [3, 4]; device 1 [1, 1.5] and [2.5, 3.5].
  recs = [(0, 0, 'F', 0.0, 2.0), (1, 0, 'F', 2.5, 3.5),
          (0, 1, 'F', 3.0, 4.0), (1, 1, 'F', 1.0, 1.5)]
  assert stage_procs.busy_together(recs, 0, 1, 2) == pytest.approx(0.5 + 0.5)
  assert stage_procs.busy(recs, 0, 2) == pytest.approx(3.0)


def test_peer_without_torch_says_how_to_install_it():
  text = peer.render({'network': 'n', 'reps': 1, 'rounds': 1, 'torch': None,
                      'ours': {c: 1.0 for c in peer.CONFIGS},
                      'torch_missing': peer.TORCH_MISSING})
  assert "torch not installed: pip install '.[peers]'" in text


def test_stale_section_renders_a_rerun_hint():
  """Regression: a section stored by an older tool (missing keys) made every
  later sub-command crash while re-rendering the report."""
  text = report.render({'overheads': {'command': 'x', 'seconds': 1.0}},
                       [('overheads', 'Overheads', lambda s: s['op_s'])])
  assert 'python tools/benchmark.py overheads' in text
  assert 'predate' in text



def test_training_runs_readmes_commands_and_all_leaves_it_out():
  """The training section trains with the commands README prints (any
  logdir); `all` (about 35 minutes) does not start its four hours."""
  with open(os.path.join(benchmark_tool.ROOT, 'README.md'),
            encoding='utf-8') as f:
    readme = f.read()
  for run in training.RUNS:
    cmd = training._shown(training._train_command(  # pylint: disable=protected-access
        run, 'LOGDIR', tiny=False))
    before, after = cmd.split('LOGDIR')
    assert re.search(re.escape(before) + r'\S+' + re.escape(after), readme), cmd
  assert sections.NOT_IN_ALL == ('training',)


def _training_row(metric: str, value: float) -> dict[str, Any]:
  return {'model': 'm', 'num_stages': 2, 'metric': metric, 'steps': 10,
          'train_minutes': 60.0,
          'metrics': {'log_pplx': 1.0, 'perplexity': 2.0, metric: value},
          'evaluate': 'python -m lingvo_pipe.evaler',
          'trained': {'command': 'c', 'started': 's', 'commit': 'abc'}}


def test_training_runs_one_pair_and_keeps_the_others_rows(monkeypatch):
  """`--runs=mt_k2,mt_one` retrains one pair: its rows are new (with the
  CPU its record names), the other pair's stored rows and same-step scores
  stay (with the section's CPU), the retrained pair's old same-step scores
  go (it kept no common checkpoint this time), and both targets are
  computed."""
  stored = {'machine': {'cpu': 'Old CPU'},
            'rows': {'mt_k2': _training_row('bleu', 15.0),
                     'mt_one': _training_row('bleu', 16.0),
                     'lm_tied': _training_row('perplexity', 52.0),
                     'lm_untied': _training_row('perplexity', 53.0)},
            'same_step': [
                {'step': 5, 'metrics': {n: {'perplexity': 2.0, 'log_pplx': 1.0}
                                        for n in ('lm_tied', 'lm_untied')}},
                {'step': 4, 'metrics': {n: {'bleu': 9.0, 'log_pplx': 1.0}
                                        for n in ('mt_k2', 'mt_one')}}]}
  bleu = {'mt_k2': 17.0, 'mt_one': 17.2}
  monkeypatch.setattr(training, '_train', lambda run, logdir, tiny: {
      'command': run.name, 'started': 's', 'commit': 'new', 'cpu': 'New CPU'})
  monkeypatch.setattr(training, '_score', lambda run, logdir, text: {
      'step': 1000, 'metrics': {'bleu': bleu[run.name], 'log_pplx': 3.0,
                                'perplexity': 20.0}})
  monkeypatch.setattr(training, '_train_minutes', lambda logdir: 60.0)
  monkeypatch.setattr(training, '_at_same_step', lambda *args: None)
  out = training._run('/nonexistent', '', tiny=False,  # pylint: disable=protected-access
                      runs=training.selected('mt_k2,mt_one'), kept=stored)
  assert {n: r['cpu'] for n, r in out['rows'].items()} == {
      'mt_k2': 'New CPU', 'mt_one': 'New CPU', 'lm_tied': 'Old CPU',
      'lm_untied': 'Old CPU'}
  assert out['rows']['mt_k2']['metrics']['bleu'] == 17.0
  assert out['rows']['lm_tied']['metrics']['perplexity'] == 52.0
  assert [s['step'] for s in out['same_step']] == [5]
  assert [(t['value'], t['met']) for t in out['targets']] == [
      (pytest.approx(-0.2), True), (pytest.approx(-1.0), True)]
  out['machine'] = {'cpu': 'New CPU'}
  text = training.render(out)
  assert '| Old CPU |' in text and '| New CPU |' in text


def test_training_refuses_a_half_pair_an_unknown_run_or_none():
  assert [r.name for r in training.selected('mt_one,mt_k2')] == [
      'mt_k2', 'mt_one']
  assert len(training.selected('')) == len(training.RUNS)
  for bad in ('mt_k2', 'lm_tied,mt', 'lm_untied', ','):
    with pytest.raises(ValueError, match='--runs'):
      training.selected(bad)
