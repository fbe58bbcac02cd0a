"""The trainer on a cluster after a change of shape or a crash.

R=2 × K=2 (4 processes) resumes a one-process checkpoint and then a one-
process run resumes its sharded one, each step equal to an uninterrupted
run; a SIGKILLed stage process ends the run naming it, and a restart
resumes from the last checkpoint to the weights of an uninterrupted run.
Tagged rehearsal in tests/BUILD (about 3 minutes of 4 processes on 2
cores, outside CI's budget): `bash tools/test.sh` and `bazel test
//tests/...` run it. The helpers are test_trainer_cluster's.
"""

import os
import re
import signal
import time

import binary_runner as br
from lingvo_pipe.core import checkpoints
from test_trainer_cluster import _finished, _launch, _pids, _train_alone


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:  # A zombie of a dead child counts as gone.
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(')')[-1].split()[0] != 'Z'
  except OSError:
    return False


def test_replicas_resume_a_one_process_checkpoint_and_equal_it(tmp_path):
  """R=2 × K=2 (4 processes) continues a 1-process run: the same steps."""
  _train_alone(tmp_path / 'alone', 10)
  os.rename(tmp_path / 'alone', tmp_path / 'replicas')
  _finished(_launch(tmp_path / 'replicas', 20, 2))
  _train_alone(tmp_path / 'reference', 20)
  diff = br.max_relative_diff(
      br.read_checkpoint_shards(tmp_path / 'reference' / 'ckpt-20'),
      br.read_checkpoint_shards(tmp_path / 'replicas' / 'ckpt-20'))
  assert diff <= 1e-5, diff
  # And a 1-process run resumes the 4-process run's sharded checkpoint.
  _train_alone(tmp_path / 'replicas', 30)
  _train_alone(tmp_path / 'reference', 30)
  diff = br.max_relative_diff(
      br.read_checkpoint_shards(tmp_path / 'reference' / 'ckpt-30'),
      br.read_checkpoint_shards(tmp_path / 'replicas' / 'ckpt-30'))
  assert diff <= 1e-5, diff



def test_a_sigkilled_worker_ends_the_run_naming_it_and_a_restart_resumes(
    tmp_path):
  steps = 400
  whole = _launch(tmp_path / 'whole', steps)
  victim = _launch(tmp_path / 'killed', steps)
  pids = _pids(victim, 2)
  deadline = time.monotonic() + 240
  while not checkpoints.list_checkpoints(str(tmp_path / 'killed')):
    assert time.monotonic() < deadline and victim.poll() is None
    time.sleep(0.05)
  time.sleep(0.3)  # Somewhere mid-run, possibly mid-save.
  os.kill(pids[1], signal.SIGKILL)
  killed_at = time.monotonic()
  rc, out, err = br.finish(victim, timeout=120)
  assert time.monotonic() - killed_at <= 60
  assert rc != 0
  text = out + err
  assert re.search(r'task 1 .*127\.0\.0\.1:\d+', text), text[-3000:]
  assert 'SIGKILL' in text or 'signal 9' in text or 'killed' in text.lower()
  assert not any(_alive(p) for p in pids), 'a task was left running'
  survived = checkpoints.list_checkpoints(str(tmp_path / 'killed'))
  assert survived and checkpoints.step_of(survived[-1]) < steps

  # The restart (same K) ends with the weights of the uninterrupted run.
  restart = _finished(_launch(tmp_path / 'killed', steps))
  assert f'Restored {survived[-1]}' in restart
  _finished(whole)
  final = f'ckpt-{steps}'
  diff = br.max_relative_diff(
      br.read_checkpoint_shards(tmp_path / 'whole' / final),
      br.read_checkpoint_shards(tmp_path / 'killed' / final))
  assert diff <= 1e-6, diff
