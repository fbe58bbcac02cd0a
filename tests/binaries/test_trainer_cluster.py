"""The trainer on a cluster: K stage processes × R replicas, as a user runs it.

Every run goes through the launcher (`python -m lingvo_pipe.launch`), which
starts `python -m lingvo_pipe.worker` tasks on free ports of 127.0.0.1. The
model is the binaries' 2-stage MLP with BatchNorm (Adam, cosine schedule).
Each test compares the weights and optimizer slots that the checkpoints
hold, read without building a model, shard by shard. R=2 × K=2 resuming a
one-process run and a SIGKILLed worker's restart are in
test_cluster_recovery.py (tagged rehearsal: 4 processes each, 3 minutes).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time


import binary_runner as br
from lingvo_pipe.core import checkpoints

_REPORT = pathlib.Path(__file__).parents[2] / 'tools' / 'profile_report.py'

_ARGS = (f'--model={br.MODEL}',
         f'--model_params_override={br.FAST}; '
         'task.train.save_interval_steps: 10; '
         'task.train.lr_schedule: constant')


def _launch(logdir, steps, num_replicas=1, *extra):
  return br.start('launch', '--num_stages=2', f'--num_replicas={num_replicas}',
                  '--', *_ARGS, f'--logdir={logdir}', f'--max_steps={steps}',
                  *extra)


def _train_alone(logdir, steps, *extra):
  rc, _, err = br.run('trainer', *_ARGS, f'--logdir={logdir}',
                      f'--max_steps={steps}', *extra)
  assert rc == 0, err[-3000:]


def _finished(proc, timeout=300):
  rc, out, err = br.finish(proc, timeout)
  if rc:  # The lines that say why, then the end.
    lines = (out + err).splitlines()
    why = [l for l in lines if re.search(
        r'(error|Error|Check failed|terminate|Fatal|abort)', l)
           and '  File "' not in l]
    raise AssertionError('\n'.join(why[:30] + ['...'] + lines[-20:]))
  return out + err


def test_two_stage_processes_train_like_one_process_and_shard_checkpoints(
    tmp_path):
  # Steps 5-6 traced by TensorFlow's profiler, in each process: the weights
  # are still the same.
  _train_alone(tmp_path / 'alone', 20, '--profile_steps=5,6')
  # Step 3 recorded too: a real step, in every process, drawn by the chief.
  _finished(_launch(tmp_path / 'staged', 20, 1, '--timeline_steps=3',
                    '--profile_steps=5,6'))
  _check_merged_timeline(tmp_path / 'staged' / 'timeline')
  _check_profiles(tmp_path / 'alone', ['task0'], sends=False)
  _check_profiles(tmp_path / 'staged', ['task0', 'task1'], sends=True)
  names = sorted(os.listdir(tmp_path / 'staged'))
  assert 'ckpt-20.stage0of2.index' in names, names
  assert 'ckpt-20.stage1of2.index' in names, names
  assert not any(n.startswith('ckpt-20.index') for n in names), names
  diff = br.max_relative_diff(
      br.read_checkpoint_shards(tmp_path / 'alone' / 'ckpt-20'),
      br.read_checkpoint_shards(tmp_path / 'staged' / 'ckpt-20'))
  assert diff <= 1e-6, diff

  # The evaler reads the shards in one process and scores the same weights.
  scores = []
  for run in ('alone', 'staged'):
    rc, _, err = br.run('evaler', f'--model={br.MODEL}',
                        f'--logdir={tmp_path / run}', '--eval_dataset=Dev',
                        '--mode=latest')
    assert rc == 0, err[-3000:]
    scores.append(re.search(r'Scored .*ckpt-20 .*loss=([\d.e+-]+)',
                            err).group(1))
  assert abs(float(scores[0]) - float(scores[1])) <= 1e-5 * abs(
      float(scores[0])), scores


def _check_profiles(logdir, tasks, sends):
  """Each task traced its own 2 steps; the report reads them."""
  proc = subprocess.run([sys.executable, str(_REPORT), str(logdir)],
                        capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  heads = [l for l in proc.stdout.splitlines() if not l.startswith(' ')]
  assert [h.split(':')[0] for h in heads] == tasks, proc.stdout
  assert all('_train_step, 2 step(s) traced' in h for h in heads), heads
  assert 'MatMul' in proc.stdout, proc.stdout
  assert ('CollectiveBcastSendV2' in proc.stdout) == sends, proc.stdout


def _pids(proc, count, timeout=120):
  """The task pids the launcher prints (task 0 first)."""
  deadline = time.monotonic() + timeout
  line = ''
  while time.monotonic() < deadline and 'pids' not in line:
    line = proc.stderr.readline() or line
    if proc.poll() is not None:
      break
  m = re.search(r'pids ((?:\d+ ?)+)', line)
  assert m, f'no pids line from the launcher: {line!r}'
  pids = [int(p) for p in m.group(1).split()]
  assert len(pids) == count
  return pids


def test_a_batch_that_does_not_split_over_the_replicas_is_one_line(tmp_path):
  proc = br.start('launch', '--num_stages=2', '--num_replicas=3', '--',
                  *_ARGS, f'--logdir={tmp_path / "run"}', '--max_steps=5')
  rc, out, err = br.finish(proc, timeout=300)
  assert rc == 2, (out + err)[-3000:]
  assert re.search(r'batch_size=32 does not split over 3 replicas',
                   out + err), (out + err)[-3000:]
  assert not os.path.exists(tmp_path / 'run' / 'params.txt')


def _check_merged_timeline(directory):
  """One picture of both stage processes' ops: K=2 × M=4, F, R and B."""
  assert sorted(os.listdir(directory)) == ['step_3.png', 'step_3.trace.json']
  trace = json.loads((directory / 'step_3.trace.json').read_text())
  panels = {e['pid']: e['args']['name'] for e in trace['traceEvents']
            if e['name'] == 'process_name'}
  ops = sorted((e['args']['stage'], e['args']['micro_batch'], e['cat'])
               for e in trace['traceEvents']
               if e['ph'] == 'X' and panels[e['pid']] == 'measured')
  assert ops == sorted((k, m, kind) for k in range(2) for m in range(4)
                       for kind in ('forward', 'recompute', 'backward'))
  measured = [e for e in trace['traceEvents']
              if e['ph'] == 'X' and panels[e['pid']] == 'measured']
  first = {k: min(e['ts'] for e in measured if e['args']['stage'] == k)
           for k in range(2)}
  assert 0 <= first[1] - first[0] < 5e6  # One clock: stage 1 follows 0.


def _threads(pid):
  return len(os.listdir(f'/proc/{pid}/task'))


def test_a_long_run_does_not_pile_up_threads(tmp_path):
  """TF arms a collective's timeout with a thread that sleeps it out; with
  one per op, the default model's run held ~16,000 threads per process and
  died of SIGABRT after 400 steps. A task's threads must stay flat."""
  logdir = tmp_path / 'run'
  proc = _launch(logdir, 400)
  pids = _pids(proc, 2)

  def wait_for_step(step):
    deadline = time.monotonic() + 240
    while not any(checkpoints.step_of(c) >= step for c in
                  checkpoints.list_checkpoints(str(logdir))):
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)

  wait_for_step(20)
  before = [_threads(p) for p in pids]
  wait_for_step(200)
  after = [_threads(p) for p in pids]
  _finished(proc)
  assert all(a - b < 50 for a, b in zip(after, before)), (before, after)
