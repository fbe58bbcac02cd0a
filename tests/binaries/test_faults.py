"""Faults, probed as issue 11 probed them: nothing is lost or mis-scored.

- A diverging update (learning rate 1e39, a save every step, no warm-up)
  saved NaN/Inf weights as the "last good" checkpoint in 2 of 5 runs, and
  the evaler scored it `loss=nan` and exited 0.
- The continuous evaler beside a trainer that keeps 2 checkpoints and saves
  every step crashed in 6 of 7 runs (NotFoundError): a checkpoint was
  deleted during its restore, and the next restore still pointed at it.
- A SIGTERM during start-up killed the trainer without a word; a signal
  during a save ran one more step; `_temp` dirs of killed saves stayed.
"""

import os
import re
import shutil
import signal
import stat

import numpy as np
import pytest
import tensorflow as tf

import binary_runner as br
from lingvo_pipe import _signals
from lingvo_pipe import trainer as trainer_lib
from lingvo_pipe.core import checkpoints
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import summaries

_COMMON = f'{br.FAST}; task.train.lr_warmup_steps: 0'


def _params(override: str):
  params = model_registry.get_params(br.MODEL, 'Train')
  return params.FromText(f'{_COMMON}; {override}')


def test_a_diverging_update_is_never_saved(tmp_path):
  logdir = tmp_path / 'logdir'
  each_step = (f'--model_params_override={_COMMON}; '
               'task.train.save_interval_steps: 1; '
               'task.train.lr_schedule: constant')
  rc, _, err = br.run('trainer', f'--model={br.MODEL}', f'--logdir={logdir}',
                      '--max_steps=5', each_step)
  assert rc == 0, err
  # The same run, on with a learning rate that overflows float32: the first
  # update makes every weight inf or NaN.
  rc, _, err = br.run('trainer', f'--model={br.MODEL}', f'--logdir={logdir}',
                      '--max_steps=10', '--force',
                      f'{each_step}; task.train.learning_rate: 1e39')
  assert rc == 1, err
  assert 'Non-finite weights after the update of step 5' in err
  assert 'Traceback' not in err
  listed = checkpoints.list_checkpoints(str(logdir))
  assert [checkpoints.step_of(c) for c in listed][-1] == 5
  assert f'the last good checkpoint is {listed[-1]}' in err
  for value in br.read_checkpoint(listed[-1]).values():
    assert np.all(np.isfinite(value))
  rc, _, err = br.run('evaler', f'--logdir={logdir}', '--mode=latest')
  assert rc == 0 and re.search(r'Scored \S*ckpt-5 .*loss=\d', err), err


def _save_non_finite_checkpoint(logdir, step):
  """Adds ckpt-<step> to `logdir` with a NaN in one weight."""
  params = _params('task.train.save_interval_steps: 10')
  trainer = trainer_lib.Trainer(params, str(logdir))
  trainer.restore()
  weight = trainer.task.trainable_variables[0]
  weight.assign(tf.fill(weight.shape, np.nan))
  trainer.step.assign(step)
  return trainer.save()


@pytest.fixture(scope='module')
def non_finite_runs(trained_logdir, tmp_path_factory):
  tmp = tmp_path_factory.mktemp('non_finite')
  latest, middle = tmp / 'latest', tmp / 'middle'
  shutil.copytree(trained_logdir, latest)
  shutil.copytree(trained_logdir, middle)
  _save_non_finite_checkpoint(latest, 31)
  _save_non_finite_checkpoint(middle, 25)  # Between ckpt-20 and ckpt-30.
  runs = [('evaler', (f'--logdir={latest}', '--mode=latest')),
          ('evaler', (f'--logdir={middle}', '--mode=continuous',
                      '--poll_interval_secs=0.1', '--timeout_secs=280'))]
  return dict(zip(('latest', 'continuous'), br.run_many(runs))), latest, middle


def test_the_evaler_refuses_to_score_a_non_finite_checkpoint(non_finite_runs):
  results, latest, _ = non_finite_runs
  rc, _, err = results['latest']
  lines = err.strip().splitlines()
  assert rc == 2, err
  assert re.match(r'evaler: error: \S*ckpt-31 holds non-finite values in 1 '
                  r'variables \(e.g. \S+\): not scored', lines[-1])
  assert not (latest / 'eval_dev').exists()


def test_continuous_mode_skips_a_non_finite_checkpoint(non_finite_runs):
  results, _, middle = non_finite_runs
  rc, _, err = results['continuous']
  assert rc == 0, err
  assert re.search(r'Skipping \S*ckpt-25 holds non-finite values', err)
  scored = sorted(n for n in os.listdir(middle / 'eval_dev')
                  if n.endswith('.json'))
  assert scored == ['ckpt-10.json', 'ckpt-20.json', 'ckpt-30.json']


# 512 wide instead of 32: 3 MB checkpoints, so restores take long enough to
# race the trainer's deletions (the old evaler crashed in 2 of 3 runs so).
_WIDE = ('task.pipeline.layers[0].output_dim: 512; '
         'task.pipeline.layers[1].dim: 512; '
         'task.pipeline.layers[2].input_dim: 512; '
         'task.pipeline.layers[2].output_dim: 512; '
         'task.pipeline.layers[3].dim: 512; '
         'task.pipeline.layers[4].input_dim: 512')


def test_continuous_evaler_survives_checkpoints_deleted_under_it(tmp_path):
  logdir = tmp_path / 'logdir'
  evaler = br.start('evaler', f'--logdir={logdir}', '--mode=continuous',
                    '--poll_interval_secs=0.01', '--timeout_secs=900')
  trainer = br.start('trainer', f'--model={br.MODEL}', f'--logdir={logdir}',
                     '--max_steps=400', '--model_params_override='
                     'task.train.save_interval_steps: 1; '
                     'task.train.max_checkpoints_to_keep: 2; '
                     f'task.train.summary_interval_steps: 100; {_WIDE}')
  rc, _, err = br.finish(trainer, timeout=900)
  assert rc == 0, err
  rc, _, err = br.finish(evaler, timeout=900)
  assert rc == 0, err
  assert 'Traceback' not in err
  scored = [int(s) for s in re.findall(r'Scored \S*ckpt-(\d+) ', err)]
  skipped = re.findall(r'Skipping \S*ckpt-\d+: deleted', err)
  print(f'scored {len(scored)} checkpoints, skipped {len(skipped)} deleted')
  assert scored[-1] == 400 and len(set(scored)) == len(scored)
  scores = summaries.read_scalars(str(logdir / 'eval_dev'))['loss']
  assert sorted(s for s, _ in scores) == sorted(scored)


def _wait_for_a_reader(fifo, proc, timeout=240):
  """Opens `fifo` for writing once `proc` opens it for reading."""
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    try:
      return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader yet.
      time.sleep(0.02)
  raise AssertionError(f'the trainer never read {fifo} (rc={proc.poll()})')


def test_sigterm_during_start_up_prints_one_line_and_exits(tmp_path):
  # The trainer blocks reading its data from a FIFO: start-up, for sure.
  fifo = tmp_path / 'data.npz'
  os.mkfifo(fifo)
  proc = br.start('trainer', f'--model={br.MODEL}',
                  f'--logdir={tmp_path / "logdir"}',
                  f'--model_params_override=input.npz_path: {fifo}')
  writer = _wait_for_a_reader(str(fifo), proc)
  try:
    proc.send_signal(signal.SIGTERM)
    rc, out, err = br.finish(proc)
  finally:
    os.close(writer)
  assert rc == 128 + signal.SIGTERM, err
  assert err.strip().splitlines()[-1] == (
      f'trainer: SIGTERM received; {_signals.STARTUP}.')
  assert 'Traceback' not in err and not out
  assert not (tmp_path / 'logdir').exists()
  assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_signal_during_a_save_stops_right_after_that_save(tmp_path):
  params = _params('task.train.save_interval_steps: 5; '
                   'task.train.max_steps: 50')
  trainer = trainer_lib.Trainer(params, str(tmp_path))
  trainer.restore()
  save = trainer.save

  def _save_then_signal():
    path = save()
    if checkpoints.step_of(path) == 10:
      signal.raise_signal(signal.SIGTERM)  # As if it came during the save.
    return path

  trainer.save = _save_then_signal
  previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  _signals.stop_after_step(trainer)
  try:
    generator = params.input.Instantiate()
    writer = tf.summary.create_noop_writer()
    trainer.train(generator, writer)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  assert trainer.stop_reason == 'SIGTERM received'
  assert int(trainer.step.numpy()) == 10  # Not 11: no step after the save.
  assert [checkpoints.step_of(c) for c in
          checkpoints.list_checkpoints(str(tmp_path))] == [5, 10]


def test_temp_dirs_of_killed_saves_are_removed_at_start_up(trained_logdir,
                                                          tmp_path):
  logdir = tmp_path / 'logdir'
  shutil.copytree(trained_logdir, logdir)
  temp = logdir / 'ckpt-40_temp'
  temp.mkdir()
  (temp / 'part-00000-of-00001.index').write_bytes(b'half a save')
  rc, _, err = br.run('trainer', f'--model={br.MODEL}', f'--logdir={logdir}',
                      '--max_steps=40', f'--model_params_override={br.FAST}; '
                      'task.train.save_interval_steps: 10')
  assert rc == 0, err
  assert f'Removed {temp}, left by a save that was killed' in err
  assert not temp.exists()
  listed = checkpoints.list_checkpoints(str(logdir))
  assert checkpoints.step_of(listed[-1]) == 40
