"""Tests of lingvo_pipe.launch: start, log prefixes, stop by PID, signals.

The launched tasks are the stand-in tests/pipeline/runtime_worker.py; the
run to the end is a 1F1B exchange (sends never ordered before later ops),
which would deadlock if the runtime's sends were ordered like ops. Each
test kills every process it started (launcher and tasks, by PID) even when
it fails.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from lingvo_pipe import launch
from runtime_procs import ROOT, TIMEOUT_S, WORKER, Tasks, alive, env  # pylint: disable=g-bad-import-order


def _launch_args(*flags):
  return ['-m', 'lingvo_pipe.launch', f'--worker={WORKER}', *flags]


def _task_pids(tasks):
  tasks.wait_for(0, 'pids')
  err = tasks.output(0)[1]
  return [int(p) for p in re.search(r'pids ([\d ]+)', err)[1].split()]


@pytest.fixture
def tasks(tmp_path):
  """The launcher's Tasks; the tasks it started are killed by PID too."""
  with Tasks(tmp_path) as t:
    try:
      yield t
    finally:
      found = re.search(r'pids ([\d ]+)', t.output(0)[1]) if t.procs else None
      for pid in map(int, found[1].split() if found else []):
        if alive(pid):
          os.kill(pid, signal.SIGKILL)


def test_two_tasks_run_1f1b_to_the_end_with_prefixed_logs():
  run = subprocess.run(
      [sys.executable] + _launch_args('--num_stages=2', '--',
                                      '--scenario=one_f_one_b'),
      capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=ROOT)
  assert run.returncode == 0, run.stderr[-3000:]
  # Micro-batch m: x = m + 1 (task 0), + 1 (task 1); ×2 per backward hop.
  expected = {1: [2.0 * (m + 2) for m in range(4)],
              0: [4.0 * (m + 2) for m in range(4)]}
  for task in (0, 1):
    results = re.findall(rf'^\[task {task}\] RESULT (.*)$', run.stdout, re.M)
    results = [json.loads(r) for r in results]
    assert [r['grads'] for r in results] == [expected[task]] * 2
    assert [r['sum'] for r in results] == [[3.0, 3.0]] * 2  # 1 + 2.
    assert f'[task {task}] DONE {task}' in run.stdout
  assert re.search(r'2 stage\(s\) × 1 replica\(s\): tasks 0..1 on '
                   r'127.0.0.1:\d+, 127.0.0.1:\d+', run.stderr)


def test_a_killed_task_stops_the_others_and_sets_the_status(tasks):
  launcher = tasks.start(_launch_args('--num_stages=3', '--',
                                      '--scenario=steps'), 'launcher')
  pids = _task_pids(tasks)
  tasks.wait_for(0, 'READY 2')
  os.kill(pids[1], signal.SIGKILL)
  assert launcher.wait(timeout=120) == 128 + signal.SIGKILL
  err = tasks.output(0)[1]
  assert re.search(r'error: task 1 \(127.0.0.1:\d+, pid \d+\) was killed by '
                   'SIGKILL; stopping the other tasks', err), err[-3000:]
  assert not any(alive(pid) for pid in pids)


def test_sigterm_is_forwarded_to_every_task(tasks):
  launcher = tasks.start(_launch_args('--num_replicas=2', '--',
                                      '--scenario=steps'), 'launcher')
  pids = _task_pids(tasks)
  for t in (0, 1):
    tasks.wait_for(0, f'READY {t}')
  launcher.send_signal(signal.SIGTERM)
  assert launcher.wait(timeout=120) == 0  # Each task stopped cleanly.
  out = tasks.output(0)[0]
  assert '[task 0] SIGTERM 0' in out and '[task 1] SIGTERM 1' in out
  assert not any(alive(pid) for pid in pids)


def test_task_commands_name_the_cluster_and_the_task():
  commands = launch.task_commands('lingvo_pipe.worker', ['--model=m'],
                                  ['127.0.0.1:5', '127.0.0.1:6'])
  assert commands[1][1:] == ['-m', 'lingvo_pipe.worker', '--model=m',
                             '--cluster_spec=worker=127.0.0.1:5,127.0.0.1:6',
                             '--task=1']
  assert launch.task_commands('w.py', [], ['h:1'])[0][1] == 'w.py'


def test_reserved_ports_are_distinct_and_kept_off_until_let_go():
  held = launch.reserve_ports(4)
  ports = [s.getsockname()[1] for s in held]
  assert len(set(ports)) == 4
  others = launch.reserve_ports(64)
  assert not set(ports) & {s.getsockname()[1] for s in others}
  for s in others:
    s.close()
  for family, address in [(socket.AF_INET, '127.0.0.1'), (socket.AF_INET, ''),
                          (socket.AF_INET6, '::1')]:
    with socket.socket(family) as plain, pytest.raises(OSError):
      plain.bind((address, ports[0]))
  plain = socket.socket()
  listener = socket.socket()  # What a gRPC server does: SO_REUSEADDR, listen.
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  listener.bind(('127.0.0.1', ports[0]))
  listener.listen()
  for s in held + [listener]:
    s.close()
  plain.bind(('127.0.0.1', ports[1]))
  plain.close()


@pytest.mark.parametrize('flags, message', [
    (['--num_stages=abc'], "flag --num_stages=abc: invalid literal"),
    (['--num_stages=0'], '--num_stages=0 and --num_replicas=1 must both'),
    (['--num_stages=2', 'extra', '--', '--scenario=one_f_one_b'],
     "unexpected argument 'extra'"),
])
def test_bad_flags_and_stray_arguments_are_one_line_exit_2(flags, message):
  # Issue 29: absl's FATAL line and exit 1; a stray argument went to every
  # task, which each exited 2 in turn.
  run = subprocess.run([sys.executable] + _launch_args(*flags),
                       capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=env(), cwd=ROOT)
  lines = run.stderr.strip().splitlines()
  assert run.returncode == 2 and len(lines) == 1, run.stderr
  assert lines[0].startswith('lingvo_pipe.launch: error: ')
  assert message in lines[0]


def test_a_flag_value_after_its_flag_is_no_stray_argument():
  assert launch.stray_argument(['--model', 'm', '--logdir=/x']) is None
  assert launch.stray_argument(['--logdir=/x', 'm']) == 'm'
  assert launch.stray_argument(['extra', '--model=m']) == 'extra'
