"""tools/benchmark.py end to end on tiny sizes (numbers are not checked).

Most sections start real stage processes (tools/bench/stage_procs.py), so
these tests also check that every one of them is stopped. Tagged rehearsal in
tests/BUILD (every section starts processes: over 15 minutes on 2 loaded
cores): `bazel test //tests/...` runs it, CI's quick tier does not;
test_benchmark.py renders every section from recorded tiny results.
"""

import json
import os
import re
import subprocess
import sys

import pytest

import benchmark_tool  # pylint: disable=g-bad-import-order

benchmark = benchmark_tool.load()
from bench import sections  # pylint: disable=C0413
import hosts  # pylint: disable=C0413,wrong-import-order

_EXPECTED = dict(benchmark_tool.EXPECTED)
_EXPECTED['links'] = _EXPECTED['links'] + (
    benchmark_tool.LINKS_MEASURED if hosts.unavailable() is None
    else benchmark_tool.LINKS_NOT_MEASURED)


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
  for filename in benchmark_tool.FILES.get(name, []):
    data = (tmp_path / filename).read_bytes()
    assert len(data) > 100, filename


def test_stage_processes_none_left_behind(tmp_path):
  proc = subprocess.run(
      [sys.executable, benchmark_tool.TOOL, 'timeline', '--tiny', '--out_dir',
       str(tmp_path)], capture_output=True, text=True, timeout=600,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = re.search(r'2 stage process\(es\), launcher pid (\d+), task pids '
                    r'\[(\d+), (\d+)\]: exit 0', proc.stderr)
  assert found, proc.stderr[-3000:]
  for pid in map(int, found.groups()):
    assert not benchmark_tool.alive(pid)  # The launcher and both tasks, stopped, reaped.
  section = json.loads((tmp_path / 'benchmarks.json').read_text())['timeline']
  assert section['devices'].startswith('stage processes')
  gpipe_row = section['rows'][0]
  assert {r[0] for r in gpipe_row['records']} == {0, 1}  # Both processes.
