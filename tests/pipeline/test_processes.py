"""Tests of lingvo_pipe.pipeline.processes (and its watchdog).

The cluster comes from flags or TF_CONFIG (in this process). The faults use
real processes on 127.0.0.1 (tests/pipeline/runtime_worker.py): a peer
killed with SIGKILL ends the others with one line naming it, a peer that
never comes up is named after a timeout, and a second run on the same ports
gets a clear error. No timed assertions: waits are generous limits.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from lingvo_pipe.pipeline import collective
from lingvo_pipe.pipeline import processes
from lingvo_pipe.pipeline import watchdog
from lingvo_pipe.pipeline.processes import ClusterError
from runtime_procs import Tasks, WORKER, free_ports, spec  # pylint: disable=g-bad-import-order


def test_the_cluster_comes_from_flags_first_then_tf_config():
  tf_config = json.dumps({'cluster': {'worker': ['a:1', 'b:2', 'c:3']},
                          'task': {'type': 'worker', 'index': 2}})
  env = {'TF_CONFIG': tf_config}
  assert processes.cluster_from(environ=env) == processes.ClusterConfig(
      addresses=('a:1', 'b:2', 'c:3'), task=2, job='worker')
  flagged = processes.cluster_from('worker=h1:5,h2:6', task=0, environ=env)
  assert flagged.addresses == ('h1:5', 'h2:6') and flagged.task == 0
  assert processes.cluster_from(environ={}) is None  # One process.


@pytest.mark.parametrize('kwargs, match', [
    (dict(cluster_spec='worker=h1:5,h2'), r'cannot read .*worker=host:port'),
    (dict(cluster_spec='worker=h1:5'), r'needs --task'),
    (dict(cluster_spec='worker=h1:5', task=1), r'task 1 is out of range'),
    (dict(cluster_spec='ps=h0:1@worker=h1:5', task=0),
     r"jobs \['ps', 'worker'\] .*one job"),
    (dict(environ={'TF_CONFIG': '{"cluster": {}}'}), r'TF_CONFIG=.* cannot be'),
])
def test_a_bad_cluster_is_one_named_error(kwargs, match):
  kwargs.setdefault('environ', {})
  with pytest.raises(ClusterError, match=match):
    processes.cluster_from(**kwargs)


def test_stages_of_a_replica_are_adjacent_tasks():
  assert [processes.task_of(s, 1, num_stages=3) for s in range(3)] == [3, 4, 5]
  assert processes.stage_tasks(1, num_stages=3, num_replicas=2) == [1, 4]


def _lines(text):
  return [l for l in text.splitlines() if l.startswith('lingvo_pipe: error:')]


def test_a_sigkilled_peer_ends_the_others_naming_it(tmp_path):
  ports = free_ports(3)
  with Tasks(tmp_path) as tasks:
    for t in range(3):
      tasks.start([WORKER, '--scenario=steps', f'--cluster_spec={spec(ports)}',
                   f'--task={t}'], f'task{t}')
    for t in range(3):
      tasks.wait_for(t, f'READY {t}')
    tasks.procs[1].send_signal(signal.SIGKILL)
    for t in (0, 2):
      # Generous (the watchdog needs seconds); not a timing assertion.
      assert tasks.procs[t].wait(timeout=120) == watchdog.EXIT_PEER_GONE
      errors = _lines(tasks.output(t)[1])
      assert len(errors) == 1, tasks.output(t)[1][-3000:]
      assert f'peer task 1 at 127.0.0.1:{ports[1]} is gone' in errors[0]
    assert tasks.procs[1].wait(timeout=30) == -signal.SIGKILL
    assert all(p.poll() is not None for p in tasks.procs)  # None left.


def test_a_peer_that_never_comes_up_is_named_and_ports_in_use_are_refused(
    tmp_path):
  held, lonely = free_ports(2), free_ports(2)
  with Tasks(tmp_path) as tasks:
    holder = tasks.start([WORKER, '--scenario=hold', '--task=0',
                          f'--cluster_spec={spec(held)}'], 'holder')
    _wait_until_listening(held[0], holder)
    # A second run on the holder's ports, and a run whose task 1 never starts.
    tasks.start([WORKER, '--scenario=hold', '--task=0',
                 f'--cluster_spec={spec(held)}'], 'second')
    tasks.start([WORKER, '--scenario=hold', '--task=0', '--peer_timeout_secs=5',
                 f'--cluster_spec={spec(lonely)}'], 'lonely')
    assert tasks.procs[1].wait(timeout=120) == 1
    assert re.search(rf'ClusterError: task 0: cannot listen on 127.0.0.1:'
                     rf'{held[0]}: the port is in use', tasks.output(1)[1])
    assert tasks.procs[2].wait(timeout=120) == 1
    assert re.search(rf'PeerUnreachableError: task 0: task 1 at 127.0.0.1:'
                     rf'{lonely[1]} did not answer within 5 s',
                     tasks.output(2)[1])
    assert holder.poll() is None  # Still waiting for its own task 1.


def _wait_until_listening(port, proc, timeout_s=120):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and proc.poll() is None:
    try:
      socket.create_connection(('127.0.0.1', port), timeout=1).close()
      return
    except OSError:
      time.sleep(0.1)
  raise AssertionError(f'nothing listens on {port}')


def test_a_step_that_never_finishes_ends_the_task_with_one_line():
  """In-step collectives carry no TF timeout (a thread per op): the
  watchdog's step deadline ends a task whose step hangs while its peers
  answer, with one line, instead of a hang."""
  code = textwrap.dedent("""
      import time
      from lingvo_pipe.pipeline import collective, watchdog
      peers = collective.Peers(task=0, addresses=('localhost:1',),
                               timeout_s=0.5)
      watchdog.Watchdog(peers, interval_s=0.05).start()
      watchdog.expect_step()
      time.sleep(60)  # A step that never finishes.
      """)
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == watchdog.EXIT_PEER_GONE, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines() if 'lingvo_pipe: error' in l]
  assert len(lines) == 1, proc.stderr[-2000:]
  assert re.search(r'task 0: no step finished within 0\.5 s .*'
                   r'--collective_timeout_secs', lines[0]), lines[0]


def _slice_ns(tid):
  """The thread's scheduler slice (ns) as the kernel reports it, or None."""
  try:
    with open(f'/proc/self/task/{tid}/sched') as f:
      for line in f:
        if line.startswith('se.slice'):
          return int(line.split(':')[1])
  except OSError:
    pass
  return None


def test_compute_threads_get_a_short_slice_and_keep_their_share():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.constant(1.0) + 1.0  # The runtime, with its inter-op pool, exists.
  tids = processes.compute_threads()
  assert tids, 'no thread named tf_Compute: TensorFlow renamed its pool?'
  before = {t: (_slice_ns(t), os.getpriority(os.PRIO_PROCESS, t),
                os.sched_getscheduler(t)) for t in tids}
  try:
    done = processes.shorten_slices(100, tids)
    after = {t: _slice_ns(t) for t in tids}
    if done == 0 or None in after.values() or set(after.values()) == {
        before[t][0] for t in tids}:
      pytest.skip('this kernel has no per-thread slices (Linux < 6.12)')
    assert done == len(tids)
    assert set(after.values()) == {100_000}
    for t in tids:  # Same priority and policy: the same share of the CPU.
      assert os.getpriority(os.PRIO_PROCESS, t) == before[t][1]
      assert os.sched_getscheduler(t) == before[t][2] == os.SCHED_OTHER
  finally:
    processes.shorten_slices(0, tids)
  assert {_slice_ns(t) for t in tids} == {before[t][0] for t in tids}


@pytest.mark.parametrize('schedule, threads', [('1f1b', '1'),
                                               ('zb_h1', '2')])
def test_a_pinned_process_runs_one_kernel_per_core(schedule, threads):
  """A task pinned to one core gets one inter-op thread, not two that
  time-slice two kernels on the core (processes._configure_threads); a
  schedule that splits its backward gets a second one, to send while W
  runs (processes.inter_op_threads_for)."""
  code = textwrap.dedent(f"""
      import os
      os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
      import tensorflow as tf
      from lingvo_pipe.pipeline import processes
      # What processes.start() calls, with what the trainer asks for.
      processes._configure_threads(processes.inter_op_threads_for(
          {schedule!r}))
      print(tf.config.threading.get_inter_op_parallelism_threads(),
            tf.config.threading.get_intra_op_parallelism_threads())
      """)
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip('one core: a pinned task keeps TensorFlow\'s defaults')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == [threads, '1']


@pytest.mark.parametrize('schedule, splits', [
    ('gpipe', False), ('1f1b', False), ('interleaved', False),
    ('zb_h1', True), ('zb_v', True),
    ('device 0: F0 I0 W0\ndevice 1: F0 I0 W0', True),
    ('device 0: F0 B0\ndevice 1: F0 B0', False),
    ('device 0: F0 X0', False),  # Not a schedule: make_schedule says so.
])
def test_only_a_split_schedule_asks_for_another_thread(schedule, splits):
  cores = len(os.sched_getaffinity(0))
  assert processes.inter_op_threads_for(schedule) == (cores + 1 if splits
                                                      else 0)


def _judged(monkeypatch, failures, num_tasks=4):
  """The line a watchdog of task 0 writes when probes fail as `failures`
  ({task: (reason, seconds silent, probes failed)}); None if it waits."""
  peers = collective.Peers(task=0, addresses=tuple(
      f'10.0.0.{t}:2222' for t in range(num_tasks)))
  watch = watchdog.Watchdog(peers, unreachable_s=10.0, grace_s=0.0)
  now = time.monotonic()
  for task, (reason, silent, count) in failures.items():
    monkeypatch.setattr(watch, 'probe', lambda *_, r=reason: r)
    watch._seen[task].heard = now - silent
    for _ in range(count):
      watch._check(task, timeout_s=0.1)
  lines = []
  monkeypatch.setattr(watch, '_give_up', lines.append)
  watch._judge()
  return lines[0] if lines else None


def test_a_silent_peer_is_gone_at_the_limit_and_the_line_says_how_long(
    monkeypatch):
  assert _judged(monkeypatch, {2: ('no answer', 9.0, 4)}) is None
  line = _judged(monkeypatch, {2: ('no answer', 10.5, 4)})
  assert re.search(r'^lingvo_pipe: error: task 0: peer task 2 at '
                   r'10\.0\.0\.2:2222 is unreachable: no answer for 10\.5 s '
                   r'\(limit 10 s\); exiting with status 75 in 0 s\.', line)


def test_the_peer_silent_longest_is_named_first(monkeypatch):
  """Another peer that left since (refused) does not hide the partition."""
  line = _judged(monkeypatch, {1: ('no answer', 8.0, 4),
                               3: ('connection refused', 1.0, 3)})
  assert re.search(r'task 0: peer task 1 at \S+ is unreachable: no answer '
                   r'for 8\.0 s \(limit 10 s\) \(also gone: task 3 at '
                   r'\S+: connection refused\)', line), line


def test_a_host_that_reaches_no_peer_says_its_link_may_be_down(monkeypatch):
  line = _judged(monkeypatch, {t: ('no answer', 10.0 + t, 4)
                               for t in (1, 2, 3)})
  assert re.search(r'task 0: every peer is unreachable: task 3 at \S+ \(no '
                   r'answer for 13\.0 s .*task 1 at .*this host\'s own '
                   r'network link may be down', line), line
