"""Runs stand-in stage processes (runtime_worker.py) for the runtime tests.

Every process started here is killed by PID when the call returns, whatever
happened; `Tasks` does the same for a test that drives processes itself.

A test script (`Tasks.start([script.py, ...])`) runs in a child forked from
a server that has imported TensorFlow and the pipeline's modules once
(multiprocessing's forkserver; no TensorFlow context yet, so no thread pool
is forked), as `python script.py ...` would run it: its own argv, cwd,
environment and stdout/stderr files. Importing TensorFlow is ~5 s of CPU
per process, and the stage-process tests start ~60 of them. What this does
not cover is a process's own start-up: the launcher (`-m lingvo_pipe.launch`)
and the binaries' tests start real interpreters.
"""

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time

from lingvo_pipe import launch

import forked_preload  # pylint: disable=g-bad-import-order

# Imported once by the fork server (forked_preload.py: TF, quietly, and the
# modules every stand-in stage process imports).
_PRELOAD = ['forked_preload']
_context = None

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'runtime_worker.py')
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(WORKER)))
TIMEOUT_S = 240  # Generous: 2 shared cores, TF imports in every process.


def env() -> dict:
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1',
              CUDA_VISIBLE_DEVICES='')


_HELD = []  # Reserved ports stay held while this test process lives.


def free_ports(count: int) -> list:
  socks = launch.reserve_ports(count)
  _HELD.extend(socks)
  return [s.getsockname()[1] for s in socks]


def spec(ports) -> str:
  return 'worker=' + ','.join(f'127.0.0.1:{p}' for p in ports)


def _fork_server():
  """multiprocessing's forkserver context, its server started with
  `_PRELOAD` imported. The server imports those on the sys.path of a new
  interpreter (Python 3.11 drops the sys_path it is given), so it starts
  with this directory on PYTHONPATH; otherwise the import fails silently
  and every child imports TensorFlow itself."""
  global _context
  if _context is None:
    context = multiprocessing.get_context('forkserver')
    context.set_forkserver_preload(_PRELOAD)
    saved = os.environ.get('PYTHONPATH')
    os.environ['PYTHONPATH'] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__))] + ([saved] if saved
                                                        else []))
    try:
      multiprocessing.forkserver.ensure_running()
    finally:
      if saved is None:
        del os.environ['PYTHONPATH']
      else:
        os.environ['PYTHONPATH'] = saved
    _context = context
  return _context


class Forked:
  """`python script.py args…` as a child of the preloaded fork server, with
  the Popen methods the tests use (pid, args, poll, wait, send_signal,
  returncode: negative for a signal)."""

  def __init__(self, args, out_path: str, err_path: str) -> None:
    self.args = [sys.executable] + list(args)
    self._proc = _fork_server().Process(
        target=forked_preload.run_script, args=(list(args), env(), ROOT, out_path,
                                  err_path), daemon=False)
    self._proc.start()
    self.pid = self._proc.pid

  @property
  def returncode(self):
    return self._proc.exitcode

  def poll(self):
    return self._proc.exitcode

  def wait(self, timeout=None):
    self._proc.join(timeout)
    if self._proc.exitcode is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self._proc.exitcode

  def send_signal(self, sig) -> None:
    if self._proc.exitcode is None:
      os.kill(self.pid, sig)


class Tasks:
  """Processes of one test; `kill_all()` (also on exit) stops them by PID."""

  def __init__(self, tmp_path) -> None:
    self.procs = []
    self.logs = []
    self._tmp = tmp_path

  def start(self, args, name: str):
    """Runs `python *args`: a script forked from the preloaded server, a
    module (`-m ...`) in a process of its own. Returns a Popen-like."""
    out = open(self._tmp / f'{name}.out', 'w+')
    err = open(self._tmp / f'{name}.err', 'w+')
    self.logs.append((out, err))
    if str(args[0]).endswith('.py'):
      proc = Forked(list(args), out.name, err.name)
    else:
      proc = subprocess.Popen([sys.executable] + list(args), stdout=out,
                              stderr=err, env=env(), cwd=ROOT)
    self.procs.append(proc)
    return proc

  def wait_for(self, index: int, text: str, timeout_s: float = TIMEOUT_S):
    """Waits until `text` is in process `index`'s stdout or stderr."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if any(text in o for o in self.output(index)):
        return
      if self.procs[index].poll() is not None:
        break
      time.sleep(0.1)
    raise AssertionError(f'{text!r} never appeared: {self.output(index)}')

  def output(self, index: int) -> tuple:
    out, err = self.logs[index]
    out.seek(0)
    err.seek(0)
    return out.read(), err.read()

  def kill_all(self) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    for proc in self.procs:
      proc.wait(timeout=30)
    for out, err in self.logs:
      out.close()
      err.close()

  def __enter__(self) -> 'Tasks':
    return self

  def __exit__(self, *exc) -> None:
    self.kill_all()


def spawn_tasks(num_tasks: int, flags, tmp_path, task_flags=None):
  """Runs tasks 0..num_tasks−1 to the end; returns CompletedProcess-likes.

  `task_flags` maps a task to flags only it gets (after `flags`)."""
  cluster = spec(free_ports(num_tasks))
  with Tasks(tmp_path) as tasks:
    for t in range(num_tasks):
      tasks.start([WORKER, f'--cluster_spec={cluster}', f'--task={t}'] +
                  list(flags) + list((task_flags or {}).get(t, [])),
                  f'task{t}')
    runs = []
    for t, proc in enumerate(tasks.procs):
      proc.wait(timeout=TIMEOUT_S)
      out, err = tasks.output(t)
      runs.append(subprocess.CompletedProcess(proc.args, proc.returncode,
                                              out, err))
    return runs


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True
