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


def test_training_runs_one_pair_and_keeps_the_others_rows():
  """`--runs=mt_k2,mt_one` retrains one pair: the stored rows of the other
  pair stay, with the CPU they trained on, and both targets are still
  computed; a half pair or an unknown run is refused."""
  row = lambda metric, value, steps: {  # pylint: disable=unnecessary-lambda-assignment
      'model': 'm', 'num_stages': 2, 'metric': metric, 'steps': steps,
      'train_minutes': 60.0, 'metrics': {metric: value, 'log_pplx': 1.0,
                                         'perplexity': 2.0},
      'evaluate': 'python -m lingvo_pipe.evaler',
      'trained': {'command': 'c', 'started': 's', 'commit': 'abc'}}
  stored = {'machine': {'cpu': 'Old CPU'},
            'rows': {'mt_k2': row('bleu', 15.0, 10),
                     'mt_one': row('bleu', 16.0, 11),
                     'lm_tied': row('perplexity', 52.0, 12),
                     'lm_untied': row('perplexity', 53.0, 13)},
            'same_step': [
                {'step': 5, 'metrics': {n: {'perplexity': 2.0, 'log_pplx': 1.0}
                                        for n in ('lm_tied', 'lm_untied')}},
                {'step': 4, 'metrics': {n: {'bleu': 9.0, 'log_pplx': 1.0}
                                        for n in ('mt_k2', 'mt_one')}}]}
  out = training._run('/nonexistent', '', tiny=False, runs=(),  # pylint: disable=protected-access
                      kept=stored)
  assert set(out['rows']) == {'mt_k2', 'mt_one', 'lm_tied', 'lm_untied'}
  assert {r['cpu'] for r in out['rows'].values()} == {'Old CPU'}
  assert [s['step'] for s in out['same_step']] == [4, 5]  # RUNS' order.
  assert [t['met'] for t in out['targets']] == [False, True]
  out['machine'] = {'cpu': 'New CPU'}
  assert '| Old CPU |' in training.render(out)
  assert [r.name for r in training.selected('mt_one,mt_k2')] == [
      'mt_k2', 'mt_one']
  for bad in ('mt_k2', 'lm_tied,mt', 'lm_untied'):
    with pytest.raises(ValueError, match='--runs'):
      training.selected(bad)
