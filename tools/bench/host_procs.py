"""Runs benchmark configurations on stage processes on separate hosts.

    with hosts.Hosts(2) as made:
      run = host_procs.launch(spec, made)     # a stage_procs.Run

Like `stage_procs.launch`, but task i runs on host h<i+1> of a hosts
harness (tools/hosts.py: network namespaces joined by a switch), with
TF_CONFIG-style addresses h1:2222 …, pinned to core i mod #cores; the
stage-to-stage link is h2's. A configuration's `rate_bits` is applied to
that link between configurations: task 0 writes the request into the
spec's `rate_dir` (stage_worker.py), a thread here limits or frees the
link (`Hosts.limit`: htb in the switch) and acknowledges. Every task is stopped by PID when one
fails or on a timeout, and dies with this process anyway (the harness).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench import common
from bench import stage_procs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))  # tools/: the hosts harness.
import hosts as hosts_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

PORT = 2222
LINK_HOST = 'h2'  # Its link carries every stage-0 ↔ stage-1 transfer.


class _RateService(threading.Thread):
  """Applies the rates task 0 asks for (files in `rate_dir`)."""

  def __init__(self, made: hosts_lib.Hosts, rate_dir: str) -> None:
    super().__init__(daemon=True)
    self._hosts, self._dir = made, rate_dir
    self._halt = threading.Event()
    self._limited = False
    self.error: Exception | None = None

  def run(self) -> None:
    seen = 0
    request = os.path.join(self._dir, 'request')
    while not self._halt.wait(0.002):
      try:
        with open(request) as f:
          asked = json.load(f)
      except (OSError, ValueError):
        continue
      if asked['seq'] == seen:
        continue
      try:
        self._apply(asked['rate_bits'])
      except hosts_lib.HostsError as e:
        self.error = e
        return
      seen = asked['seq']
      tmp = os.path.join(self._dir, 'applied.tmp')
      with open(tmp, 'w') as f:
        json.dump({'seq': seen}, f)
      os.replace(tmp, os.path.join(self._dir, 'applied'))

  def _apply(self, rate: float | None) -> None:
    if rate is None:
      if self._limited:
        self._hosts.unlimit(LINK_HOST)
    else:
      self._hosts.limit(LINK_HOST, rate)
    self._limited = rate is not None

  def stop(self) -> None:
    self._halt.set()
    self.join(timeout=5)


def launch(spec: dict[str, Any], made: hosts_lib.Hosts, num_stages: int = 2,
           timeout_s: float = stage_procs.TIMEOUT_S) -> stage_procs.Run:
  """Runs `spec` (stage_worker.py) on one task per host of `made`.

  Raises:
    stage_procs.LaunchError: a task failed, or the run timed out.
  """
  run_dir = tempfile.mkdtemp(prefix='lp_bench_hosts_')
  procs: list[subprocess.Popen[bytes]] = []
  rates = _RateService(made, os.path.join(run_dir, 'rates'))
  os.makedirs(os.path.join(run_dir, 'rates'))
  start = time.time()
  try:
    spec_path = os.path.join(run_dir, 'spec.json')
    with open(spec_path, 'w') as f:
      json.dump(dict(spec, num_stages=num_stages,
                     rate_dir=os.path.join(run_dir, 'rates')), f)
    rates.start()
    cluster = 'worker=' + ','.join(f'{n}:{PORT}' for n in made.names)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1',
               TF_CPU_ALLOCATOR_USE_BFC='true')
    for i, name in enumerate(made.names):
      with open(os.path.join(run_dir, f'log{i}.txt'), 'w') as log:
        procs.append(made.popen(name, [
            'taskset', '-c', str(i % (os.cpu_count() or 1)), sys.executable,
            stage_procs.WORKER, f'--spec={spec_path}', f'--out_dir={run_dir}',
            f'--cluster_spec={cluster}', f'--task={i}',
            '--collective_timeout_secs=300', '--peer_timeout_secs=180'],
            cwd=stage_procs.ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=env))
    rc = _wait(procs, rates, timeout_s)
  finally:
    rates.stop()
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
  log = ''.join(f'[task {i}] {_read(os.path.join(run_dir, f"log{i}.txt"))}'
                for i in range(len(procs)))
  tasks = [json.loads(_read(os.path.join(run_dir, f'task{i}.json')))
           for i in range(len(procs))
           if os.path.exists(os.path.join(run_dir, f'task{i}.json'))]
  shutil.rmtree(run_dir, ignore_errors=True)
  run = stage_procs.Run(tasks, rc, log, [p.pid for p in procs],
                        time.time() - start)
  common.log(f'{len(procs)} stage process(es) on hosts '
             f'{", ".join(made.names)}, pids {run.pids}: exit {rc} after '
             f'{run.seconds:.0f} s')
  if rc:
    raise stage_procs.LaunchError(f'stage processes on hosts failed (exit '
                                  f'{rc}):\n{log[-3000:]}')
  return run


_SINK = """
import socket
s = socket.socket()
s.bind(('0.0.0.0', 5001))
s.listen()
print('listening', flush=True)
while True:
  c, _ = s.accept()
  while c.recv(1 << 20):
    pass
  c.sendall(b'k')
  c.close()
"""
_SOURCE = """
import socket, sys, time
host, mib, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = b'x' * (1 << 20)
for _ in range(reps):
  c = socket.create_connection((host, 5001))
  start = time.perf_counter()
  for _ in range(mib):
    c.sendall(chunk)
  c.shutdown(socket.SHUT_WR)
  c.recv(1)
  print(mib * 8 * (1 << 20) / (time.perf_counter() - start), flush=True)
"""


def tcp_throughput(made: hosts_lib.Hosts, mib: int = 64,
                   reps: int = 3) -> float:
  """Median payload bits/s of a TCP stream from h1 (core 0) to h2 (core
  1): what the link carries when nothing limits it but the hosts."""
  sink = made.popen('h2', ['taskset', '-c', str(1 % (os.cpu_count() or 1)),
                           sys.executable, '-c', _SINK],
                    stdout=subprocess.PIPE, text=True)
  try:
    if sink.stdout is None or sink.stdout.readline() != 'listening\n':
      raise stage_procs.LaunchError('the throughput probe did not start')
    out = made.run('h1', ['taskset', '-c', '0', sys.executable, '-c',
                          _SOURCE, 'h2', str(mib), str(reps)], timeout=300)
    rates = sorted(float(x) for x in out.stdout.split())
    if len(rates) != reps:
      raise stage_procs.LaunchError(f'throughput probe: {out.stderr[-500:]}')
    return rates[reps // 2]
  finally:
    sink.kill()
    sink.wait()


def _wait(procs: list[subprocess.Popen[bytes]], rates: _RateService,
          timeout_s: float) -> int:
  """The first failure's exit status (−1: timed out or no rate), else 0."""
  deadline = time.monotonic() + timeout_s
  while any(p.poll() is None for p in procs):
    failed = [p.returncode for p in procs if p.returncode]
    if failed or rates.error or time.monotonic() > deadline:
      return failed[0] if failed else -1
    time.sleep(0.05)
  return next((p.returncode for p in procs if p.returncode), 0)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()
