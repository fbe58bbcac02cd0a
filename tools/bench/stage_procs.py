"""Runs benchmark configurations on real stage processes, one per stage.

    results = stage_procs.launch(spec, num_tasks=2)
    results.tasks[0]['configs'][0]['times_s']      # task 0's step times

`launch` writes the spec (see `stage_worker.py` for its fields), starts
`python -m lingvo_pipe.launch --worker=stage_worker.py` — K·R processes on
127.0.0.1, task i pinned to core i mod #cores, each task's output captured
in one log — waits, and reads every task's JSON. Hygiene: the launcher
stops its tasks by PID when one fails, and they die with it
(PR_SET_PDEATHSIG); here the launcher is stopped by PID on a timeout, an
error or SIGTERM (benchmark.py turns it into SystemExit), and any task
PID the launcher printed that is still alive afterwards is killed too.

Why processes: logical CPU devices of one process share one thread pool
and one allocator, so they say nothing about speed or per-stage memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Sequence

from bench import common

_HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(_HERE, 'stage_worker.py')
ROOT = os.path.dirname(os.path.dirname(_HERE))
TIMEOUT_S = 900.0
_PIDS = re.compile(r'lingvo_pipe\.launch: pids ([\d ]+)')


class LaunchError(common.BenchError):
  """A run of stage processes failed; the message has its log's tail."""


@dataclasses.dataclass
class Run:
  """What one launch left: each task's JSON, the exit status, the log."""
  tasks: list[dict[str, Any]]
  returncode: int
  log: str
  pids: list[int]
  seconds: float

  @property
  def oom(self) -> bool:
    """Whether a task ran out of memory (its JSON, or TF's error)."""
    return any(t.get('oom') for t in self.tasks) or any(
        text in self.log for text in ('ResourceExhaustedError',
                                      'OOM when allocating'))

  def config(self, name: str) -> list[dict[str, Any]]:
    """Every task's result of configuration `name` (tasks that ran it)."""
    return [c for t in self.tasks for c in t.get('configs', [])
            if c['name'] == name]


def launch(spec: dict[str, Any], num_stages: int, num_replicas: int = 1,
           env: dict[str, str] | None = None, allow_failure: bool = False,
           timeout_s: float = TIMEOUT_S) -> Run:
  """Runs `spec` on num_stages × num_replicas stage processes.

  Args:
    spec: the configurations and how to time them (stage_worker.py).
    num_stages, num_replicas: the run's tasks (task i = stage i mod K of
      replica i // K).
    env: extra environment of every task (e.g. a memory limit).
    allow_failure: return a failed run (e.g. out of memory: `Run.oom`)
      instead of raising.
    timeout_s: the launcher is stopped after this long.

  Raises:
    LaunchError: the run failed (and `allow_failure` is off) or timed out.
  """
  run_dir = tempfile.mkdtemp(prefix='lp_bench_')
  try:
    return _launch(spec, num_stages, num_replicas, env or {}, allow_failure,
                   timeout_s, run_dir)
  finally:
    shutil.rmtree(run_dir, ignore_errors=True)


def _launch(spec: dict[str, Any], num_stages: int, num_replicas: int,
            env: dict[str, str], allow_failure: bool, timeout_s: float,
            run_dir: str) -> Run:
  spec = dict(spec, num_stages=num_stages)
  spec_path = os.path.join(run_dir, 'spec.json')
  with open(spec_path, 'w') as f:
    json.dump(spec, f)
  log_path = os.path.join(run_dir, 'log.txt')
  cmd = [sys.executable, '-m', 'lingvo_pipe.launch',
         f'--num_stages={num_stages}', f'--num_replicas={num_replicas}',
         f'--worker={WORKER}', '--stop_grace_secs=5', '--',
         f'--spec={spec_path}', f'--out_dir={run_dir}',
         '--collective_timeout_secs=300', '--peer_timeout_secs=180']
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
                  TF_CPU_ALLOCATOR_USE_BFC='true', PYTHONUNBUFFERED='1',
                  **env)
  start = time.time()
  with open(log_path, 'w') as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=full_env, cwd=ROOT)
    try:
      rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      rc = None
    finally:
      _stop(proc)
  with open(log_path) as f:
    text = f.read()
  pids = [int(p) for m in _PIDS.findall(text) for p in m.split()]
  _kill_left(pids)
  tasks = []
  for i in range(num_stages * num_replicas):
    path = os.path.join(run_dir, f'task{i}.json')
    if os.path.exists(path):
      with open(path) as f:
        tasks.append(json.load(f))
  run = Run(tasks, -1 if rc is None else rc, text, pids, time.time() - start)
  common.log(f'{num_stages * num_replicas} stage process(es), launcher pid '
             f'{proc.pid}, task pids {pids}: exit {run.returncode} after '
             f'{run.seconds:.0f} s')
  if rc is None:
    raise LaunchError(f'stage processes timed out after {timeout_s:g} s:\n'
                      + text[-3000:])
  if rc and not allow_failure:
    raise LaunchError(f'stage processes failed (launcher exit {rc}):\n'
                      + text[-3000:])
  return run


def _stop(proc: subprocess.Popen[bytes]) -> None:
  """SIGTERM to the launcher (it stops its tasks), SIGKILL if it hangs."""
  if proc.poll() is not None:
    return
  proc.send_signal(signal.SIGTERM)
  try:
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


def _kill_left(pids: Iterable[int]) -> None:
  """Kills any task the launcher left (it never should), by PID."""
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass


# ---- Reading results ---------------------------------------------------------
def step_times(run: Run, name: str) -> list[float]:
  """Per timed step, the slowest task's wall time (a step ends for all)."""
  per_task = [c['times_s'] for c in run.config(name)]
  return [max(ts) for ts in zip(*per_task)]


def median_step(run: Run, name: str) -> float:
  return float(statistics.median(step_times(run, name)))


def records(run: Run, name: str) -> list[list[tuple[Any, ...]]]:
  """Each recorded step's records of every task, (stage, m, kind, start,
  end) in absolute seconds (one host: the tasks' clocks agree)."""
  per_task = [c['records'] for c in run.config(name)]
  steps = []
  for parts in zip(*per_task):
    steps.append([tuple(r) for part in parts for r in part])
  return steps


def normalized(recs: Sequence[tuple[Any, ...]]) -> list[Any]:
  from lingvo_pipe.pipeline import timeline  # pylint: disable=C0415
  return timeline.normalized(recs)


def span(recs: Sequence[Any]) -> float:
  return max(r[4] for r in recs) - min(r[3] for r in recs)


def median_by_span(steps: Sequence[Sequence[Any]]) -> list[Any]:
  """The recorded step of median span."""
  ordered = sorted(steps, key=span)
  return list(ordered[len(ordered) // 2])


def busy_together(recs: Sequence[Any], a: int, b: int,
                  num_devices: int) -> float:
  """Seconds during which devices a and b both run an op (stage s runs on
  device s mod num_devices)."""

  def _intervals(d: int) -> list[tuple[float, float]]:
    spans = sorted((r[3], r[4]) for r in recs if r[0] % num_devices == d)
    merged: list[list[float]] = []
    for s, e in spans:
      if merged and s <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], e)
      else:
        merged.append([s, e])
    return [(s, e) for s, e in merged]

  return sum(max(0.0, min(e1, e2) - max(s1, s2))
             for s1, e1 in _intervals(a) for s2, e2 in _intervals(b))


def busy(recs: Sequence[Any], device: int, num_devices: int) -> float:
  return sum(r[4] - r[3] for r in recs if r[0] % num_devices == device)


def free_port() -> int:
  """A port that was free on 127.0.0.1 just now."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]
