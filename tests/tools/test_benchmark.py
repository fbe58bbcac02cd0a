"""tools/benchmark.py end to end on tiny sizes (numbers are not checked).

Most sections start real stage processes (tools/bench/stage_procs.py), so
these tests also check that every one of them is stopped.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_TOOL = os.path.join(_ROOT, 'tools', 'benchmark.py')


def _load():
  spec = importlib.util.spec_from_file_location('benchmark_tool', _TOOL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # Puts tools/ on sys.path for `bench`.
  return module


benchmark = _load()
from bench import peer  # pylint: disable=C0413
from bench import report  # pylint: disable=C0413
from bench import sections  # pylint: disable=C0413
from bench import stage_procs  # pylint: disable=C0413
from bench import table1  # pylint: disable=C0413

# What each section's Markdown must show: table headers, targets, papers.
_EXPECTED = {
    'efficiency': ['| round | K=1 step (s) | K=2 step (s)', 'C_stage',
                   'pipeline efficiency K=2, M=8, round 1',
                   'data parallel R=2 × K=1', 'GPipe AmoebaNet (TPU)',
                   '| 32 | 8 | 6.56 | 3.48 | 6.3 | 4.95 |'],
    'overlap': ['| K | schedule | stages | both busy, measured (ms)',
                'K=4 gpipe: stages 2-3 busy at once',
                'K=3 1f1b: stages 1-2 busy at once'],
    'table1': ['| config | max layers |', '| naive |', '| pipeline-4 |',
               '(18, 208)', '1663 layers', 'TF_CPU_BFC_MEM_LIMIT_IN_MB',
               'table1.png'],
    'peer': ['| config | lingvo_pipe', 'K=2, M=8'],
    'slices': ['| configuration | launch 1: off / on (s)', 'K=2 1f1b M=8',
               'Step time saved by the short slice'],
    'schedules': ['**Memory**', 'peak activation memory 1F1B ÷ GPipe, K=2, '
                  'M=32', '1F1B growth M=8 → M=32',
                  'step time 1F1B ÷ GPipe, K=2, M=8', 'interleaved',
                  'schedules_memory.png'],
    'fidelity': ['| K | M | schedule | measured step (s) | predicted (s) |',
                 'round 1: worst |predicted ÷ measured − 1|', 'fidelity.png'],
    'tracing': ['| round | schedule | ops M=2 | ops M=8',
                'gpipe: graph ops at M=8 ÷ M=2 − 1',
                '1f1b: tracing + first step at M=8 ÷ M=2'],
    'partition': ['| K | partition by | boundaries',
                  'profile partition, K=2'],
    'overheads': ['| step | time (s) |', 'hand-written',
                  '| form | M | graph ops | trace (s) |',
                  'tracing time M=64 ÷ M=8, FPropLoss 1f1b'],
    'timeline': ['timeline_k2_m8.png', 'timeline_k2_m8.trace.json',
                 'most micro-batches held per stage'],
    'keras': ['| network | first call (s) | step (s) |', '| wrapped Keras |',
              'wrapped Keras ÷ lingvo_pipe layers, step time'],
}
_FILES = {'table1': ['table1.png'], 'schedules': ['schedules_memory.png'],
          'fidelity': ['fidelity.png'],
          'timeline': ['timeline_k2_m8.png', 'timeline_k2_m8.trace.json']}


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_every_section_is_tested():
  assert set(_EXPECTED) == set(sections.NAMES)


@pytest.mark.parametrize('name', sections.NAMES)
def test_section_end_to_end_tiny(name, tmp_path):
  assert benchmark.main([name, '--tiny', '--out_dir', str(tmp_path)]) == 0
  results = json.loads((tmp_path / 'benchmarks.json').read_text())
  section = results[name]
  assert section['tiny'] and section['command'].startswith(
      'python tools/benchmark.py ' + name)
  assert len(section['load']) == 2
  for target in section.get('targets', []):
    assert isinstance(target['met'], bool)
  text = (tmp_path / 'benchmarks.md').read_text()
  assert '# lingvo_pipe benchmarks' in text and 'Machine:' in text
  for title in sections.TITLES:
    assert f'## {title}' in text  # Every section, run or not.
  for snippet in _EXPECTED[name]:
    assert snippet in text, snippet
  for filename in _FILES.get(name, []):
    data = (tmp_path / filename).read_bytes()
    assert len(data) > 100, filename


def test_stage_processes_none_left_behind(tmp_path):
  proc = subprocess.run(
      [sys.executable, _TOOL, 'timeline', '--tiny', '--out_dir',
       str(tmp_path)], capture_output=True, text=True, timeout=600,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = re.search(r'2 stage process\(es\), launcher pid (\d+), task pids '
                    r'\[(\d+), (\d+)\]: exit 0', proc.stderr)
  assert found, proc.stderr[-3000:]
  for pid in map(int, found.groups()):
    assert not _alive(pid)  # The launcher and both tasks, stopped, reaped.
  section = json.loads((tmp_path / 'benchmarks.json').read_text())['timeline']
  assert section['devices'].startswith('stage processes')
  gpipe_row = section['rows'][0]
  assert {r[0] for r in gpipe_row['records']} == {0, 1}  # Both processes.


def test_a_failed_launch_stops_every_task():
  """A stage process that fails takes the others down; nothing is left."""
  spec = {'configs': [{'name': 'bad', 'scope': 'run', 'K': 2, 'M': 2,
                       'net': [3, 8, 8], 'schedule': 'no such schedule'}]}
  with pytest.raises(stage_procs.LaunchError, match='no such schedule'):
    stage_procs.launch(spec, 2, timeout_s=300)
  run = stage_procs.launch(spec, 2, allow_failure=True, timeout_s=300)
  assert run.returncode and not run.oom and len(run.pids) == 2
  assert not any(_alive(pid) for pid in run.pids)


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
  # F(1, 0) starts 0.5 s after F(0, 0) ended and device 1 was free.
  assert stage_procs.handoff_gaps(recs[:2], 2) == [pytest.approx(0.5)]


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
