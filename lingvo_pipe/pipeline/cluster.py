"""Stages in separate TF worker processes on this host (or on others).

Logical CPU devices of one process share one thread pool, so on a CPU host
they isolate placement but not compute: to measure (or get) real stage
parallelism, each stage must run in its own process. `LocalCluster` starts K
`tf.distribute.Server` workers on 127.0.0.1, each pinned to its own cores
with single-threaded pools, connects this process to them as a client, and
hands back the device strings for `PipeliningLayer.Params().devices`:

    with cluster.LocalCluster(num_workers=2) as c:
      p.devices = c.devices          # ['/job:worker/replica:0/task:0/...']
      net = p.Instantiate()          # variables live on the workers

The client itself can run stage 0, which saves a core and one hop:
`pin_client([0])` before TensorFlow starts, K−1 workers on the other
cores, and `p.devices = [c.client_device] + c.devices`. On TF 2.21 this
is also what makes stages overlap: the eager remote runtime launches the
remote parts of one multi-device function one after another, so a
pipeline whose stages all live on workers runs them in turn (measured 0%
overlap), while a client stage runs concurrently with a worker stage
(K=2 vs K=1 1.5× faster at M=8; docs/benchmarks.md).

Workers on other hosts work the same way: connect with
`tf.config.experimental_connect_to_cluster` to their ClusterSpec and list the
'/job:worker/task:k/device:...' strings in `p.devices`.

Every process started here is stopped by PID in `stop()` (also on exit).

The other runtime, where every stage process runs its own schedule and
stages exchange tensors over collectives, is `processes.py` and
`collective.py`, started by `lingvo_pipe.launch`.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import time
from typing import Sequence

_JOB = 'worker'
CLIENT_DEVICE = '/job:localhost/replica:0/task:0/device:CPU:0'


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class ClusterError(RuntimeError):
  """A worker failed to start; the message includes its log."""


def pin_client(cores: Sequence[int], intra_op_threads: int = 1,
               inter_op_threads: int = 4) -> None:
  """Pins this (client) process to `cores` so it can host a stage itself.

  Call it before TensorFlow's runtime starts (before any op, variable or
  device query). A few inter-op threads let the client run its own
  stage while it dispatches to and waits on the workers.
  """
  import tensorflow as tf  # Late: the workers' entry point needs none.
  try:
    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
  except RuntimeError as e:
    raise ClusterError(
        f'pin_client({list(cores)}) came after TensorFlow\'s runtime '
        f'started ({e}); call it first thing, before any TF op, variable or '
        'device query.') from None
  os.sched_setaffinity(0, set(cores))


class LocalCluster:
  """K single-core TF worker processes on 127.0.0.1, one per stage."""

  def __init__(self, num_workers: int,
               cores: Sequence[Sequence[int]] | None = None,
               threads_per_worker: int = 1,
               connect: bool = True, first_core: int = 0) -> None:
    """Args:
      num_workers: one per pipeline stage the workers run.
      cores: CPU ids each worker is pinned to; default worker k → core
        (first_core + k) mod (#cores).
      threads_per_worker: intra-op threads of each worker.
      connect: connect this process to the cluster as its client.
      first_core: the first worker's core when `cores` is not given, e.g. 1
        when the client runs stage 0 on core 0 (`pin_client([0])`).
    """
    if num_workers < 1:
      raise ClusterError(f'LocalCluster(num_workers={num_workers}): needs at '
                         'least one worker; with none, run on this process '
                         'alone.')
    ncpu = os.cpu_count() or 1
    self._cores = [list(c) for c in cores] if cores else [
        [(first_core + k) % ncpu] for k in range(num_workers)]
    self._threads = threads_per_worker
    self._connect = connect
    self._addrs = [f'127.0.0.1:{_free_port()}' for _ in range(num_workers)]
    self._procs: list[subprocess.Popen[bytes]] = []
    self._logs: list[str] = []

  @property
  def devices(self) -> list[str]:
    return [f'/job:{_JOB}/replica:0/task:{k}/device:CPU:0'
            for k in range(len(self._addrs))]

  @property
  def client_device(self) -> str:
    """This process's CPU, for a stage the client runs (`pin_client`)."""
    return CLIENT_DEVICE

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self._procs]

  def start(self) -> 'LocalCluster':
    spec = json.dumps({_JOB: self._addrs})
    for k, cores in enumerate(self._cores):
      log = f'/tmp/lingvo_pipe_worker_{os.getpid()}_{k}.log'
      self._logs.append(log)
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
                 CUDA_VISIBLE_DEVICES='')
      cmd = [sys.executable, '-m', 'lingvo_pipe.pipeline.cluster', spec, str(k),
             str(self._threads), ','.join(map(str, cores))]
      with open(log, 'wb') as f:
        self._procs.append(subprocess.Popen(cmd, stdout=f,
                                            stderr=subprocess.STDOUT,
                                            env=env))
    atexit.register(self.stop)
    self._wait_ready()
    if self._connect:
      import tensorflow as tf  # Late: workers must not pay for it twice.
      tf.config.experimental_connect_to_cluster(
          tf.train.ClusterSpec({_JOB: self._addrs}),
          make_master_device_default=False)
    return self

  def _wait_ready(self, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    for k, addr in enumerate(self._addrs):
      host, port = addr.split(':')
      while True:
        if self._procs[k].poll() is not None:
          self.stop()
          raise ClusterError(f'Worker {k} exited: ' +
                             open(self._logs[k]).read()[-2000:])
        try:
          with socket.create_connection((host, int(port)), timeout=1):
            break
        except OSError:
          if time.time() > deadline:
            self.stop()
            raise ClusterError(f'Worker {k} at {addr} did not start in '
                               f'{timeout_s:.0f} s.') from None
          time.sleep(0.2)

  def stop(self) -> None:
    """Stops every worker process by PID (idempotent)."""
    for proc in self._procs:
      if proc.poll() is None:
        proc.kill()
    for proc in self._procs:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    self._procs = []
    for log in self._logs:
      if os.path.exists(log):
        os.remove(log)
    self._logs = []

  def __enter__(self) -> 'LocalCluster':
    return self.start()

  def __exit__(self, *exc: object) -> None:
    self.stop()


def _die_with_parent() -> None:
  """Linux: SIGKILL this worker when its client dies (atexit never runs on
  SIGKILL/SIGTERM, and orphaned workers held GBs of memory)."""
  try:
    import ctypes
    import signal
    libc = ctypes.CDLL('libc.so.6', use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass  # Not Linux: stop() and atexit remain.


def _serve(spec: str, task: int, threads: int, cores: str) -> None:
  """Worker process body: pin, start a server, serve forever."""
  _die_with_parent()
  if cores:
    os.sched_setaffinity(0, {int(c) for c in cores.split(',')})
  import tensorflow as tf
  config = tf.compat.v1.ConfigProto(
      intra_op_parallelism_threads=threads,
      inter_op_parallelism_threads=threads + 2)
  server = tf.distribute.Server(
      tf.train.ClusterSpec(json.loads(spec)), job_name=_JOB,
      task_index=task, config=config, start=True)
  server.join()


if __name__ == '__main__':
  _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
