"""tools/benchmark.py end to end on tiny sizes (numbers are not checked)."""

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
from bench import memory  # pylint: disable=C0413
from bench import sections  # pylint: disable=C0413

# What each section's Markdown must show: table headers and paper figures.
_EXPECTED = {
    'throughput': ['| M | K=1 step (s) | K=2 step (s)', 'ideal C·M/(M+1)',
                   'efficiency', 'GPipe AmoebaNet (TPU)', '| 32 | 8 | 6.56 '
                   '| 3.48 | 6.3 | 4.95 |', 'Ceiling C ='],
    'memory': ['| config | max layers |', '| naive |', '| pipeline-4 |',
               '(18, 208)', '1663 layers', 'recompute ÷ none'],
    'overheads': ['| step | time (s) |', 'hand-written', '| M | graph ops |',
                  'tracing time M=64 ÷ M=8'],
    'fidelity': ['| K | M | measured span (s) | predicted (s) | error |',
                 'worst |predicted ÷ measured − 1|'],
    'timeline': ['timeline_k2_m4.png', 'timeline_k2_m4.trace.json',
                 'Both stages busy at once', 'Stage 0 backward (R, B) of m+1'],
}
_FILES = {'throughput': ['throughput.png'], 'memory': ['memory.png'],
          'overheads': [], 'fidelity': ['fidelity.png'],
          'timeline': ['timeline_k2_m4.png', 'timeline_k2_m4.trace.json']}


@pytest.mark.parametrize('name', sections.NAMES)
def test_section_end_to_end_tiny(name, tmp_path):
  assert benchmark.main([name, '--tiny', '--out_dir', str(tmp_path)]) == 0
  results = json.loads((tmp_path / 'benchmarks.json').read_text())
  section = results[name]
  assert section['tiny'] and section['command'].startswith(
      'python tools/benchmark.py ' + name)
  for target in section.get('targets', []):
    assert isinstance(target['met'], bool)
  text = (tmp_path / 'benchmarks.md').read_text()
  assert '# lingvo_pipe benchmarks' in text and 'Machine:' in text
  for title in ('Throughput (GPipe Table 2)', 'Memory (GPipe Table 1)',
                'Overheads', 'Simulator fidelity'):
    assert f'## {title}' in text  # Every section, run or not.
  for snippet in _EXPECTED[name]:
    assert snippet in text, snippet
  for filename in _FILES[name]:
    data = (tmp_path / filename).read_bytes()
    assert len(data) > 100, filename


def test_worker_processes_tiny_and_none_left_behind(tmp_path):
  proc = subprocess.run(
      [sys.executable, _TOOL, 'timeline', '--tiny', '--devices=workers',
       '--out_dir', str(tmp_path)], capture_output=True, text=True,
      timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = re.search(r'on this process \(pid (\d+), core 0\); 1 worker '
                    r'process\(es\), pids \[(\d+)\]', proc.stderr)
  assert found, proc.stderr[-3000:]
  for pid in map(int, found.groups()):
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)  # Stopped and reaped: the section child and its worker.
  section = json.loads((tmp_path / 'benchmarks.json').read_text())['timeline']
  assert section['devices'].startswith('stage 0 on the benchmark process')
  assert len(section['records']) == 2 * 4 * 3


def test_search_brackets_the_largest_fitting_size():
  calls = []

  def _fits(n):
    calls.append(n)
    return n <= 37

  lo, hi = memory.search(_fits, start=4, tolerance=1.125, limit=1000)
  assert lo <= 37 < hi and hi / lo <= 1.125
  assert calls[:5] == [4, 8, 16, 32, 64]  # Doubling first.
  assert memory.search(lambda n: n <= 3, 16, 1.0, 100) == (3, 4)  # Halving.
  assert memory.search(lambda n: True, 4, 1.5, 20) == (20, 0)  # Capped.
  assert memory.search(lambda n: False, 4, 1.5, 20) == (0, 1)


def test_stale_section_renders_a_rerun_hint():
  """Regression: a section stored by an older tool (missing keys) made every
  later sub-command crash while re-rendering the report."""
  from bench import report  # pylint: disable=g-import-not-at-top
  text = report.render({'overheads': {'command': 'x', 'seconds': 1.0}},
                       [('overheads', 'Overheads', lambda s: s['op_s'])])
  assert 'python tools/benchmark.py overheads' in text
  assert 'predate' in text
