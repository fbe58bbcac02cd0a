"""Network partitions between the hosts of a run, and a restart after them.

Two hosts made of network namespaces (tools/hosts.py) run README's recipe;
the tests cut h2's link (its packets vanish silently: the process lives on,
unreachable) in the middle of a step, while a checkpoint is written, and
for a few seconds only. Tried by hand first: a cut ended both tasks 35 s
later with a line saying "no answer within 10 s", and nothing guarded it.

Each cut must end every task with exit 75 and one line naming the
unreachable peer and its address, stating how long it has been silent and
when the task exits; the test checks that the task did end by then
(`_check_verdicts`: a deadline with margin, not a tight wall time), that no
process, namespace or interface is left, and that no partial checkpoint is
listed. A restart after healing (the cut during a save) resumes and ends
with the weights of the uninterrupted run (one process). A blip that heals within a few seconds is
ridden out: packets dropped silently are resent by TCP, so the step goes
on (a collective that failed would abort every collective of its process).
"""

import os
import re
import time

import pytest

import binary_runner as br
import multi_host as mh
from lingvo_pipe.core import checkpoints

_UNREACHABLE_S = 4  # --peer_unreachable_secs: short, for the tests.
_SLOW = 1e6  # 1 Mbit/s: a step is mostly transfers (~70 ms here).
_VERDICT = re.compile(
    r'task (\d+): peer task (\d+) at (h\d+):2222 is unreachable: no answer '
    r'for ([\d.]+) s \(limit ([\d.]+) s\); exiting with status 75 in '
    r'([\d.]+) s')


@pytest.fixture(scope='module')
def alone(tmp_path_factory):
  mh.need_hosts()
  logdir = tmp_path_factory.mktemp('alone') / 'logdir'
  mh.train_alone(logdir)
  return logdir


def _run(hosts, tmp_path, name, logdir, **kwargs):
  return mh.Run(hosts, tmp_path, name, logdir, extra=[
      f'--peer_unreachable_secs={_UNREACHABLE_S}'], **kwargs)


def _until(run, ready, what, timeout=240):
  """Waits until `ready()` while every task runs."""
  deadline = time.monotonic() + timeout
  while not ready():
    if time.monotonic() > deadline or any(
        p.poll() is not None for p in run.procs):
      raise AssertionError(f'never {what}:\n{run.tails()}')
    time.sleep(0.005)


def _check_verdicts(run, cut_at):
  """Both tasks end 75, each with one line naming the other host, by the
  deadline the line states."""
  assert run.wait() == [75, 75], run.tails()
  for task, peer in ((0, 1), (1, 0)):
    errors = run.errors(task)
    assert len(errors) == 1, run.output(task)[-3000:]
    m = _VERDICT.search(errors[0])
    assert m, errors[0]
    assert (int(m[1]), int(m[2]), m[3]) == (task, peer, f'h{peer + 1}')
    silent, limit, grace = float(m[4]), float(m[5]), float(m[6])
    assert limit == _UNREACHABLE_S and limit <= silent <= limit + 5, m[0]
    # The peer was last heard before the cut, so the task must be gone
    # `silent + grace` after it (plus the exit itself and this poll).
    assert run.ended[task] - cut_at <= silent + grace + 3, (
        run.ended[task] - cut_at, m[0])


def _restart_and_compare(hosts, tmp_path, logdir, alone, overrides):
  """Heals h2, restarts the run; it resumes and ends with alone's weights."""
  listed = mh.listed_are_complete(logdir)
  hosts.heal('h2')
  again = _run(hosts, tmp_path, 'restart', logdir, overrides=overrides)
  again.finished()
  assert f'Restored {listed[-1]}' in again.output(0), again.output(0)[-3000:]
  final = f'ckpt-{mh.STEPS}'
  assert br.max_relative_diff(
      br.read_checkpoint_shards(alone / final),
      br.read_checkpoint_shards(logdir / final)) <= 1e-5
  return again


def test_a_cut_in_the_middle_of_a_step_ends_both_tasks(tmp_path):
  """Restarts are checked after the cut during a save (below), which also
  leaves a partial checkpoint to clean up: two processes fewer here."""
  mh.need_hosts()
  before, logdir = mh.interfaces(), tmp_path / 'run'
  with mh.hosts_lib.Hosts(2) as hosts:
    hosts.limit('h2', _SLOW)  # Steps are transfers: the cut falls in one.
    run = _run(hosts, tmp_path, 'cut', logdir)
    _until(run, lambda: checkpoints.list_checkpoints(str(logdir)),
           'wrote a checkpoint')
    cut_at = time.monotonic()
    hosts.cut('h2')
    _check_verdicts(run, cut_at)
    assert hosts.processes() == []
    listed = mh.listed_are_complete(logdir)
    assert listed and checkpoints.step_of(listed[-1]) < mh.STEPS
  mh.check_removed(hosts, before)


def _unlisted_shards(logdir):
  """Steps with a shard on disk that the state file does not list."""
  listed = checkpoints.list_checkpoints(str(logdir))
  newest = checkpoints.step_of(listed[-1]) if listed else 0
  steps = {int(m[1]) for m in (re.match(r'ckpt-(\d+)\.stage\dof2\.index$', n)
                               for n in os.listdir(logdir)) if m}
  return sorted(s for s in steps if s > newest)


def _cut_during_a_save(hosts, run, logdir):
  """Cuts h2 once a shard of a save is on disk; returns when.

  A save can finish between the shard's appearance and the cut (they were
  5 to 45 ms apart); then the save was listed, and the cut, healed at once,
  was a blip that the run rides out: try the next save."""
  for _ in range(10):
    _until(run, lambda: _unlisted_shards(logdir), 'began a save')
    step = _unlisted_shards(logdir)[0]
    cut_at = time.monotonic()
    hosts.cut('h2')
    time.sleep(1.0)
    if step not in [checkpoints.step_of(c) for c in
                    checkpoints.list_checkpoints(str(logdir))]:
      return cut_at  # The shards' barrier waits: the cut fell in the save.
    hosts.heal('h2')
  raise AssertionError('10 cuts all came after the save they aimed at')


def test_a_cut_while_a_checkpoint_is_written_lists_no_partial_checkpoint(
    alone, tmp_path):
  """A checkpoint every step: the cut falls between the first shard on
  disk and the chief's listing (the shards' barrier never completes)."""
  before, logdir = mh.interfaces(), tmp_path / 'run'
  each_step = (f'{mh.OVERRIDES}; task.train.save_interval_steps: 1; '
               'task.train.max_checkpoints_to_keep: 100')
  with mh.hosts_lib.Hosts(2) as hosts:
    run = _run(hosts, tmp_path, 'cut', logdir, overrides=each_step)
    _until(run, lambda: len(checkpoints.list_checkpoints(str(logdir))) >= 3,
           'wrote 3 checkpoints')
    cut_at = _cut_during_a_save(hosts, run, logdir)
    _check_verdicts(run, cut_at)
    assert hosts.processes() == []
    partial = _unlisted_shards(logdir)
    assert partial, 'the cut missed the save: its checkpoint was listed'
    mh.listed_are_complete(logdir)
    again = _restart_and_compare(hosts, tmp_path, logdir, alone, each_step)
    assert re.search(rf'Removed \S*ckpt-{partial[0]}, written by a save that '
                     'was killed', again.output(0)), again.output(0)[-3000:]
  mh.check_removed(hosts, before)


def test_a_blip_of_a_few_seconds_is_ridden_out(alone, tmp_path):
  """h2's link cut for 2.5 s, under --peer_unreachable_secs=8: TCP resends
  what was dropped, and the run ends with the uninterrupted weights."""
  before, logdir = mh.interfaces(), tmp_path / 'run'
  with mh.hosts_lib.Hosts(2) as hosts:
    hosts.limit('h2', _SLOW)  # Long enough a run to cut in its middle.
    run = mh.Run(hosts, tmp_path, 'blip', logdir,
                 extra=['--peer_unreachable_secs=8'])
    _until(run, lambda: checkpoints.list_checkpoints(str(logdir)),
           'wrote a checkpoint')
    hosts.cut('h2')
    time.sleep(2.5)
    hosts.heal('h2')
    healed_at = checkpoints.list_checkpoints(str(logdir))[-1]
    assert checkpoints.step_of(healed_at) < mh.STEPS
    run.finished()
    assert not run.errors(0) and not run.errors(1)
  mh.check_removed(hosts, before)
  final = f'ckpt-{mh.STEPS}'
  assert br.max_relative_diff(
      br.read_checkpoint_shards(alone / final),
      br.read_checkpoint_shards(logdir / final)) <= 1e-5
