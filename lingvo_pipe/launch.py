"""Starts every stage process of a run on this host, and stops them all.

    python -m lingvo_pipe.launch --num_stages=2 --num_replicas=1 -- \\
        --model=image.fashion_mnist.AmoebaNetGPipe --logdir=/tmp/run

runs `python -m lingvo_pipe.worker <flags after --> --cluster_spec=worker=
127.0.0.1:p0,... --task=i` for i in 0..K·R−1, on free ports of 127.0.0.1
(or --base_port, base_port+1, ...). Task i is stage i mod K of replica
i div K (`processes.task_of`), and is pinned to core i mod #cores: on a CPU
host one core per stage is what makes stages run at the same time.

The launcher is the parent of every task, so it sees a task die before any
peer can: it then prints one line naming the task, its address and how it
ended, sends the others SIGTERM, then SIGKILL after --stop_grace_secs, and
exits with the first failure's status (128+N for signal N). Logs stream with
a `[task i]` prefix. SIGINT/SIGTERM are forwarded to every task (a second
one kills them); tasks run in their own process group, so Ctrl-C in a
terminal reaches them once, through here. Tasks get SIGKILL if the launcher
itself dies (PR_SET_PDEATHSIG), and are stopped by PID, never by name.
Processes on other hosts are started by hand or by a scheduler, each with
the same --cluster_spec (or TF_CONFIG) and its own --task.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence, cast

from absl import app
from absl import flags

_NUM_STAGES = flags.DEFINE_integer('num_stages', 1, 'Pipeline stages K: '
                                   'processes per replica.')
_NUM_REPLICAS = flags.DEFINE_integer('num_replicas', 1, 'Data-parallel '
                                     'replicas R of the pipeline.')
_WORKER = flags.DEFINE_string('worker', 'lingvo_pipe.worker', 'The module '
                              'each task runs (python -m), or a .py file.')
_HOST = flags.DEFINE_string('host', '127.0.0.1', 'Address the tasks '
                            'listen on.')
_BASE_PORT = flags.DEFINE_integer('base_port', 0, 'Task i listens on '
                                  'base_port + i; 0: free ports.')
_PIN_CORES = flags.DEFINE_bool('pin_cores', True, 'Pin task i to core i '
                               'mod #cores.')
_STOP_GRACE = flags.DEFINE_float('stop_grace_secs', 10.0, 'After SIGTERM, '
                                 'seconds before SIGKILL.')

_PR_SET_PDEATHSIG = 1
_OUTPUT = threading.Lock()  # One line at a time on stdout/stderr.


def _say(text: str) -> None:
  with _OUTPUT:
    sys.stderr.write(f'lingvo_pipe.launch: {text}\n')
    sys.stderr.flush()


def reserve_ports(count: int) -> list[socket.socket]:
  """`count` sockets, each holding a distinct free port on every address.

  A port that is found free and let go can be taken before the task meant
  to listen on it is up (importing TF takes seconds): under `bazel test`,
  a concurrent test's cluster got one, and a restart's tasks met it at
  start-up ("connects to a wrong cluster"). So the caller keeps these
  sockets open while its tasks run. TF's server listens on the wildcard
  address, so each socket holds the wildcard (IPv6 and IPv4 where it can):
  bound without SO_REUSEADDR, so no other socket shares the port, then
  with it set, so a gRPC server (which sets it too) can still listen
  there, while other binds and the kernel's choice of a port keep off it.
  """
  socks = []
  try:
    for _ in range(count):
      try:
        s = socket.socket(socket.AF_INET6)
        socks.append(s)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(('::', 0))
      except OSError:  # No IPv6 here.
        socks.pop().close()
        s = socket.socket()
        socks.append(s)
        s.bind(('', 0))
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  except OSError:
    for s in socks:
      s.close()
    raise
  return socks


class Launcher:
  """The tasks of one run on this host: start, stream, wait, stop by PID."""

  def __init__(self, commands: Sequence[Sequence[str]],
               addresses: Sequence[str], cores: Sequence[int | None],
               stop_grace_s: float = 10.0) -> None:
    self._commands = [list(c) for c in commands]
    self._addresses = list(addresses)
    self._cores = list(cores)
    self._grace = stop_grace_s
    self._procs: list[subprocess.Popen[bytes]] = []
    self._threads: list[threading.Thread] = []
    self._signals = 0

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self._procs]

  def start(self) -> None:
    """Starts every task (all of them before any thread: see _preexec)."""
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    atexit.register(self.kill)
    for cmd, core in zip(self._commands, self._cores):
      self._procs.append(subprocess.Popen(
          cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
          process_group=0, preexec_fn=_preexec(core)))
    for task, proc in enumerate(self._procs):
      # Popen(stdout=PIPE, stderr=PIPE) made both pipes.
      for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        thread = threading.Thread(
            target=self._stream, args=(task, cast(IO[bytes], pipe), out),
            daemon=True)
        thread.start()
        self._threads.append(thread)

  def _stream(self, task: int, pipe: IO[bytes], out: IO[str]) -> None:
    for raw in iter(pipe.readline, b''):
      line = raw.decode('utf-8', 'replace').rstrip('\n')
      with _OUTPUT:
        out.write(f'[task {task}] {line}\n')
        out.flush()

  def wait(self) -> int:
    """Waits for every task; on the first failure stops the rest.

    Returns:
      0, or the first failed task's exit status (128+N for signal N).
    """
    status = 0
    while any(p.returncode is None for p in self._procs):
      for task, proc in enumerate(self._procs):
        if proc.returncode is None and proc.poll() is not None:
          if proc.returncode != 0 and status == 0:
            status = _shell_status(proc.returncode)
            _say(f'error: task {task} ({self._addresses[task]}, pid '
                      f'{proc.pid}) {_how(proc.returncode)}; stopping the '
                      'other tasks.')
            self.stop()
      time.sleep(0.05)
    for thread in self._threads:
      thread.join(timeout=5)
    return status

  def stop(self) -> None:
    """SIGTERM to every live task, SIGKILL to those left after the grace."""
    self.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + self._grace
    while time.monotonic() < deadline and any(
        p.poll() is None for p in self._procs):
      time.sleep(0.05)
    self.kill()

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)
    for proc in self._procs:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass

  def send_signal(self, signum: int) -> None:
    for proc in self._procs:
      if proc.poll() is None:
        try:
          proc.send_signal(signum)
        except ProcessLookupError:
          pass

  def forward(self, signum: int, unused_frame: object = None) -> None:
    """Signal handler: forwards SIGINT/SIGTERM; a second one kills."""
    self._signals += 1
    if self._signals == 1:
      _say(f'{signal.Signals(signum).name}: forwarding it to every '
                'task (again to kill them).')
      self.send_signal(signum)
    else:
      self.send_signal(signal.SIGKILL)


def _preexec(core: int | None) -> Callable[[], None]:
  """Runs in each task between fork and exec: pin, die with the launcher.

  Only safe while the launcher has no other threads, hence start()'s order;
  libc is loaded here, before the fork, not in the child.
  """
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    prctl = None  # Not Linux: stop() by PID still runs.

  def _setup() -> None:
    if core is not None:
      os.sched_setaffinity(0, {core})
    if prctl is not None:
      prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

  return _setup


def _how(returncode: int) -> str:
  if returncode < 0:
    return f'was killed by {signal.Signals(-returncode).name}'
  return f'exited with status {returncode}'


def _shell_status(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def task_commands(worker: str, worker_flags: Sequence[str],
                  addresses: Sequence[str]) -> list[list[str]]:
  """One command per task: the worker with its flags and the cluster."""
  spec = 'worker=' + ','.join(addresses)
  head = ([sys.executable, worker] if worker.endswith('.py') else
          [sys.executable, '-m', worker])
  return [head + list(worker_flags) + [f'--cluster_spec={spec}',
                                       f'--task={i}']
          for i in range(len(addresses))]


def _refusal(message: str) -> int:
  """Says why a flag or argument is refused (one line, as the binaries do);
  returns the exit status, 2."""
  _say(f'error: {" ".join(message.split())}')
  return 2


def _parse(argv: list[str]) -> list[str]:
  """absl's parse, with a bad flag as one line (not absl's FATAL and exit 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(_refusal(f'{e}; see --helpfull.'))


def stray_argument(worker_flags: Sequence[str]) -> str | None:
  """The first argument that is neither a flag nor the value of the flag
  before it (`--model m`): it would only make every task exit."""
  for i, arg in enumerate(worker_flags):
    before = worker_flags[i - 1] if i else ''
    if not arg.startswith('-') and not (before.startswith('-') and
                                        '=' not in before):
      return arg
  return None


def main(argv: list[str]) -> None:
  worker_flags = argv[1:]
  k, r = _NUM_STAGES.value, _NUM_REPLICAS.value
  if k < 1 or r < 1:
    sys.exit(_refusal(f'--num_stages={k} and --num_replicas={r} must both be '
                      '≥ 1.'))
  stray = stray_argument(worker_flags)
  if stray is not None:
    sys.exit(_refusal(f'unexpected argument {stray!r}: the tasks take '
                      '--flag=value arguments after "--" (quote a value with '
                      'spaces); see python -m lingvo_pipe.worker --helpfull.'))
  n = k * r
  host = _HOST.value
  held = [] if _BASE_PORT.value else reserve_ports(n)
  ports = ([_BASE_PORT.value + i for i in range(n)] if _BASE_PORT.value else
           [s.getsockname()[1] for s in held])
  if ':' in host and not host.startswith('['):
    host = f'[{host}]'  # An IPv6 literal, as a cluster spec writes it.
  addresses = [f'{host}:{p}' for p in ports]
  ncpu = os.cpu_count() or 1
  cores = [i % ncpu if _PIN_CORES.value else None for i in range(n)]
  launcher = Launcher(task_commands(_WORKER.value, worker_flags, addresses),
                      addresses, cores, _STOP_GRACE.value)
  _say(f'{k} stage(s) × {r} replica(s): tasks 0..{n - 1} on '
                f'{", ".join(addresses)}' +
                (f', task i on core i mod {ncpu}' if _PIN_CORES.value else ''))
  signal.signal(signal.SIGINT, launcher.forward)
  signal.signal(signal.SIGTERM, launcher.forward)
  launcher.start()
  _say('pids ' + ' '.join(map(str, launcher.pids)) + ' (task 0 first)')
  status = launcher.wait()
  for s in held:
    s.close()
  sys.exit(status)


def run() -> None:
  """Console script `lingvo_pipe_launch`."""
  app.run(main, flags_parser=_parse)


if __name__ == '__main__':
  run()
