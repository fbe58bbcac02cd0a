"""README's multi-host recipe on hosts made of network namespaces.

`recipe()` reads the two-host recipe from README.md (its TF_CONFIG and its
`python -m lingvo_pipe.worker` command), so the tests run what README says,
with only the model, logdir and test flags changed. `Run` starts one task
per host (tools/hosts.py) and tells how each ended.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

import binary_runner as br
from lingvo_pipe.core import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, 'tools'))
import hosts as hosts_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

STEPS = 60
# Every checkpoint kept; the constant schedule as in test_trainer_cluster.py.
OVERRIDES = (f'{br.FAST}; task.train.save_interval_steps: 10; '
             'task.train.lr_schedule: constant')
_RECIPE = re.compile(r"# host (h\d+):\nTF_CONFIG='([^']+)' \\\n\s+"
                     r'(python -m lingvo_pipe\.worker [^\n]+)')


def need_hosts():
  """Skips the test, with one line saying why, where hosts cannot be made."""
  why = hosts_lib.unavailable()
  if why:
    pytest.skip(f'needs network namespaces: {why}')


def recipe(num_hosts):
  """README's recipe for `num_hosts` hosts: (TF_CONFIG per host, argv).

  README shows two hosts; more hosts list more addresses the same way."""
  with open(os.path.join(ROOT, 'README.md')) as f:
    found = _RECIPE.findall(f.read())
  assert [h for h, _, _ in found] == ['h1', 'h2'], found
  configs = [json.loads(c) for _, c, _ in found]
  assert [c['task']['index'] for c in configs] == [0, 1], configs
  assert found[0][2] == found[1][2], 'both hosts run the same command'
  workers = configs[0]['cluster']['worker']
  port = workers[0].split(':')[1]
  assert workers == [f'h{i + 1}:{port}' for i in range(2)], workers
  cluster = [f'h{i + 1}:{port}' for i in range(num_hosts)]
  tf_configs = [json.dumps(dict(configs[0], cluster={'worker': cluster},
                                task=dict(configs[0]['task'], index=i)))
                for i in range(num_hosts)]
  argv = shlex.split(found[0][2])
  assert argv[:3] == ['python', '-m', 'lingvo_pipe.worker'], argv
  return tf_configs, [sys.executable] + argv[1:]


def worker_argv(argv, logdir, steps=STEPS, overrides=OVERRIDES, extra=()):
  """README's command with the test model, logdir and flags."""
  out = []
  for arg in argv:
    if arg.startswith('--model='):
      arg = f'--model={br.MODEL}'
    elif arg.startswith('--logdir='):
      arg = f'--logdir={logdir}'
    out.append(arg)
  return out + [f'--max_steps={steps}',
                f'--model_params_override={overrides}', *extra]


class Run:
  """One task per host, each with README's TF_CONFIG; output in files."""

  def __init__(self, hosts, tmp_path, name, logdir, steps=STEPS,
               overrides=OVERRIDES, extra=()):
    tf_configs, argv = recipe(len(hosts.names))
    cmd = worker_argv(argv, logdir, steps, overrides, extra)
    self.logs, self.procs, self.ended = [], [], {}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1',
               CUDA_VISIBLE_DEVICES='')
    for host, tf_config in zip(hosts.names, tf_configs):
      log = open(tmp_path / f'{name}_{host}.log', 'w+')
      self.logs.append(log)
      self.procs.append(hosts.popen(host, cmd, cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    env=dict(env, TF_CONFIG=tf_config)))

  def wait(self, timeout=300):
    """Waits for every task; records when each ended; returns exit codes."""
    deadline = time.monotonic() + timeout
    while len(self.ended) < len(self.procs):
      for i, proc in enumerate(self.procs):
        if i not in self.ended and proc.poll() is not None:
          self.ended[i] = time.monotonic()
      if time.monotonic() > deadline:
        raise AssertionError(f'tasks still running after {timeout} s:\n'
                             + self.tails())
      time.sleep(0.02)
    return [p.returncode for p in self.procs]

  def output(self, task):
    self.logs[task].seek(0)
    return self.logs[task].read()

  def errors(self, task):
    """The lines that say why task `task` stopped."""
    return [l for l in self.output(task).splitlines()
            if re.search(r'(lingvo_pipe|worker|trainer): error:', l)]

  def tails(self):
    return '\n'.join(f'--- task {i}:\n{self.output(i)[-2500:]}'
                     for i in range(len(self.procs)))

  def finished(self, timeout=300):
    """Waits; every task must end with status 0."""
    codes = self.wait(timeout)
    assert codes == [0] * len(codes), f'{codes}\n{self.tails()}'


def interfaces():
  """This machine's own network interfaces (names)."""
  out = subprocess.run(['ip', '-o', 'link', 'show'], capture_output=True,
                       text=True, check=True).stdout
  return sorted(line.split(':')[1].strip() for line in out.splitlines())


def check_removed(hosts, before):
  """After `hosts.close()`: no process in their namespaces (so the kernel
  freed them, with their interfaces), and this machine's own interfaces
  as `before`."""
  assert hosts_lib.pids_in(hosts.namespaces) == []
  assert interfaces() == before


def train_alone(logdir, steps=STEPS, overrides=OVERRIDES):
  """The one-process run every multi-host run must equal."""
  rc, _, err = br.run('trainer', f'--model={br.MODEL}', f'--logdir={logdir}',
                      f'--max_steps={steps}',
                      f'--model_params_override={overrides}')
  assert rc == 0, err[-3000:]


def listed_are_complete(logdir):
  """Every listed checkpoint has every shard on disk; returns the list."""
  listed = checkpoints.list_checkpoints(str(logdir))
  for path in listed:
    assert checkpoints.files_of(path), f'{path} is listed but incomplete'
  return listed
