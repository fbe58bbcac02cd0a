"""README's multi-host recipe, verbatim, on hosts that are network namespaces.

Each task runs in a host of its own (tools/hosts.py: its own network stack,
reached through a switch, h1 … hN resolving inside), started with the
TF_CONFIG line README gives, on a shared logdir. Until these tests, the
recipe had only run as processes on 127.0.0.1. The model is the binaries'
2-stage MLP; the reference is one process. Skipped, with one line, where
namespaces cannot be made (not root, no `ip`).
"""

import json
import os
import re
import time

import pytest

import binary_runner as br
import multi_host as mh


@pytest.fixture(scope='module')
def alone(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('alone') / 'logdir'
  mh.need_hosts()
  mh.train_alone(logdir)
  return logdir


def _score(logdir):
  """The evaler's loss of the run's last checkpoint, from its score file."""
  rc, _, err = br.run('evaler', f'--model={br.MODEL}', f'--logdir={logdir}',
                      '--eval_dataset=Dev', '--mode=latest')
  assert rc == 0, err[-3000:]
  with open(logdir / 'eval_dev' / f'ckpt-{mh.STEPS}.json') as f:
    return json.load(f)['metrics']['loss']


def test_two_hosts_equal_one_process_after_a_start_up_cut(alone, tmp_path):
  """K=2: first with h2's link cut before any peer answered (it used to
  fail after 120 s with a line naming no peer), then healed."""
  before = mh.interfaces()
  logdir = tmp_path / 'run'
  with mh.hosts_lib.Hosts(2) as hosts:
    hosts.cut('h2')
    cut = mh.Run(hosts, tmp_path, 'cut', logdir,
                 extra=['--peer_timeout_secs=6'])
    started = time.monotonic()
    assert cut.wait() == [75, 75], cut.tails()
    for task, peer in ((0, 1), (1, 0)):
      errors = cut.errors(task)
      assert len(errors) == 1, cut.output(task)[-3000:]
      assert re.search(rf'task {task}: task {peer} at h{peer + 1}:2222 did '
                       r'not answer within 6 s', errors[0]), errors[0]
      assert cut.ended[task] - started >= 6  # It did wait that long.
    assert hosts.processes() == []
    assert not os.path.exists(logdir / 'params.txt')  # Nothing written.

    hosts.heal('h2')
    mh.Run(hosts, tmp_path, 'healed', logdir).finished()
    assert hosts.processes() == []
  mh.check_removed(hosts, before)
  names = os.listdir(logdir)
  assert {f'ckpt-{mh.STEPS}.stage{d}of2.index' for d in (0, 1)} <= set(names)
  final = f'ckpt-{mh.STEPS}'
  assert br.max_relative_diff(
      br.read_checkpoint_shards(alone / final),
      br.read_checkpoint_shards(logdir / final)) <= 1e-5
  # The evaler scores the run in one process: the reference's weights'
  # loss, computed in float64 numpy.
  want = br.numpy_metrics(br.read_checkpoint_shards(alone / final),
                          'Dev')['loss']
  assert abs(_score(logdir) - want) <= 1e-5 * want


def test_four_hosts_two_stages_two_replicas_equal_one_process(alone,
                                                             tmp_path):
  before = mh.interfaces()
  logdir = tmp_path / 'run'
  with mh.hosts_lib.Hosts(4) as hosts:
    mh.Run(hosts, tmp_path, 'four', logdir).finished()
    assert hosts.processes() == []
  mh.check_removed(hosts, before)
  final = f'ckpt-{mh.STEPS}'
  assert br.max_relative_diff(
      br.read_checkpoint_shards(alone / final),
      br.read_checkpoint_shards(logdir / final)) <= 1e-5
