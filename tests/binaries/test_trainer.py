"""The trainer binary end to end: logdir, resume after SIGKILL, NaN, params,
stopping cleanly on SIGTERM and on --max_train_minutes."""

import os
import shutil
import signal
import time

import numpy as np
import pytest

import binary_runner as br
from lingvo_pipe.core import checkpoints
from lingvo_pipe.core import learning_rate
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import summaries

_TAGS = {'loss', 'mean_abs_error', 'learning_rate', 'grad_global_norm',
         'examples_per_sec', 'pipeline/partition_imbalance',
         'pipeline/bubble_fraction'}


def test_logdir_holds_params_checkpoints_and_summaries(trained_logdir):
  listed = checkpoints.list_checkpoints(str(trained_logdir))
  assert [checkpoints.step_of(c) for c in listed] == [10, 20, 30]
  values = br.read_checkpoint(listed[-1])
  assert values['step/.ATTRIBUTES/VARIABLE_VALUE'] == 30
  weights = [n for n in values if n.startswith('task/') and
             'moving' not in n]
  slots = [n for n in values if n.startswith('optimizer/_slots/')]
  assert len(slots) == 2 * len(weights)  # Adam: m and v per weight.
  # BatchNorm statistics were folded into the moving averages.
  assert np.abs(values['task/pipeline/bn0/moving_mean/.ATTRIBUTES/'
                       'VARIABLE_VALUE']).max() > 0

  scalars = summaries.read_scalars(str(trained_logdir / 'train'))
  assert _TAGS <= set(scalars)
  assert [s for s, _ in scalars['loss']] == [5, 10, 15, 20, 25, 30]
  train = model_registry.get_params(br.MODEL, 'Train').task.train
  train.max_steps = 30  # As the fixture's --max_steps.
  for step, value in scalars['learning_rate']:  # The rate of the last step.
    assert value == pytest.approx(
        float(learning_rate.learning_rate(train, step - 1)), rel=1e-6)
  losses = [v for _, v in scalars['loss']]
  assert losses[-1] < losses[0]


@pytest.fixture(scope='module')
def side_runs(trained_logdir, tmp_path_factory):
  """Independent runs, in parallel: inspect, params refusal, --force, NaN."""
  tmp = tmp_path_factory.mktemp('side')
  forced = tmp / 'forced'
  shutil.copytree(trained_logdir, forced)
  extended = tmp / 'extended'
  shutil.copytree(trained_logdir, extended)
  before = br.tree(trained_logdir)
  common = (f'--model={br.MODEL}', '--max_steps=30',
            f'--model_params_override={br.FAST}; '
            'task.train.save_interval_steps: 10')
  other_lr = ('--model_params_override=task.train.learning_rate: 0.5; '
              f'{br.FAST}; task.train.save_interval_steps: 10')
  runs = {
      'inspect': ('trainer', (*common, '--mode=inspect_params',
                              f'--logdir={tmp / "inspect"}')),
      'refused': ('trainer', (f'--model={br.MODEL}', '--max_steps=30',
                              other_lr, f'--logdir={trained_logdir}')),
      'forced': ('trainer', (f'--model={br.MODEL}', '--max_steps=30',
                             other_lr, f'--logdir={forced}', '--force')),
      'extended': ('trainer', (*common[:1], '--max_steps=35', *common[2:],
                               f'--logdir={extended}')),
      'nan': ('trainer', (f'--model={br.MODEL}', f'--logdir={tmp / "nan"}',
                          '--max_steps=20', '--model_params_override='
                          'input.nan_at_step: 7; '
                          'task.train.save_interval_steps: 3')),
      # Shorter than the model's 10-step warm-up: a smoke run.
      'smoke': ('trainer', (f'--model={br.MODEL}', '--max_steps=5',
                            f'--logdir={tmp / "smoke"}',
                            '--model_params_override='
                            'task.train.summary_interval_steps: 1')),
  }
  results = dict(zip(runs, br.run_many(list(runs.values()))))
  return results, tmp, before


def test_inspect_params_prints_final_params_and_writes_nothing(
    side_runs, trained_logdir):
  results, tmp, _ = side_runs
  rc, out, err = results['inspect']
  assert rc == 0, err
  params_txt = (trained_logdir / 'params.txt').read_text()
  assert out.startswith(params_txt)  # Same flags → the same final params.
  assert 'imbalance' in out[len(params_txt):]  # task.Inspect(): partition.
  assert not (tmp / 'inspect').exists()


def test_params_mismatch_refuses_without_force(side_runs, trained_logdir):
  results, _, before = side_runs
  rc, _, err = results['refused']
  assert rc == 2
  trained = model_registry.get_params(br.MODEL, 'Train').task.train
  assert f'- task.train.learning_rate : {trained.learning_rate}' in err
  assert '+ task.train.learning_rate : 0.5' in err
  assert err.strip().splitlines()[-1].startswith('trainer: error:')
  assert '--force' in err and 'Traceback' not in err
  assert br.tree(trained_logdir) == before


def test_force_replaces_params(side_runs):
  results, tmp, _ = side_runs
  rc, _, err = results['forced']
  assert rc == 0, err
  assert 'task.train.learning_rate : 0.5' in (
      tmp / 'forced' / 'params.txt').read_text()


def test_larger_max_steps_continues_the_same_run(side_runs):
  # max_steps is the run's length, not its identity: no --force needed.
  results, tmp, _ = side_runs
  rc, _, err = results['extended']
  assert rc == 0, err
  listed = checkpoints.list_checkpoints(str(tmp / 'extended'))
  assert checkpoints.step_of(listed[-1]) == 35
  assert 'task.train.max_steps : 35' in (
      tmp / 'extended' / 'params.txt').read_text()


def test_a_smoke_run_shorter_than_the_warm_up_trains_from_step_0(side_runs):
  # Issue 29: --max_steps=5 with the model's 10-step warm-up exited 2 ("make
  # max_steps larger than the warm-up"), and the cosine factor was 0 there.
  results, tmp, _ = side_runs
  rc, _, err = results['smoke']
  assert rc == 0, err
  assert 'no longer than the 10-step warm-up' in err
  rates = summaries.read_scalars(str(tmp / 'smoke' / 'train'))[
      'learning_rate']
  assert [s for s, _ in rates] == [1, 2, 3, 4, 5]
  assert all(0 < r < 1 for _, r in rates), rates
  listed = checkpoints.list_checkpoints(str(tmp / 'smoke'))
  assert [checkpoints.step_of(c) for c in listed] == [5]


def test_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    side_runs):
  results, tmp, _ = side_runs
  rc, _, err = results['nan']
  assert rc == 1, err
  assert 'at step 7' in err and 'Non-finite loss' in err
  assert 'Traceback' not in err
  listed = checkpoints.list_checkpoints(str(tmp / 'nan'))
  assert [checkpoints.step_of(c) for c in listed] == [3, 6]
  assert os.path.basename(listed[-1]) in err
  for value in br.read_checkpoint(listed[-1]).values():
    assert np.all(np.isfinite(value))


def _wait_for_checkpoint(logdir, proc, timeout=240):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    if checkpoints.list_checkpoints(str(logdir)):
      return
    time.sleep(0.02)
  raise AssertionError(f'no checkpoint appeared (rc={proc.poll()})')


def test_sigkill_then_restart_reproduces_uninterrupted_weights(tmp_path):
  steps = 600
  args = (f'--model={br.MODEL}', f'--max_steps={steps}',
          f'--model_params_override={br.FAST}; '
          'task.train.save_interval_steps: 50')
  whole, killed = tmp_path / 'whole', tmp_path / 'killed'
  reference = br.start('trainer', *args, f'--logdir={whole}')
  victim = br.start('trainer', *args, f'--logdir={killed}')
  _wait_for_checkpoint(killed, victim)
  time.sleep(0.3)  # Somewhere mid-run, possibly mid-save.
  victim.send_signal(signal.SIGKILL)
  victim.communicate()
  survived = checkpoints.list_checkpoints(str(killed))
  assert survived and checkpoints.step_of(survived[-1]) < steps, (
      'the trainer finished before it could be killed')

  rc, _, err = br.run('trainer', *args, f'--logdir={killed}')
  assert rc == 0, err
  assert f'Restored {survived[-1]}' in err
  rc, _, err = br.finish(reference)
  assert rc == 0, err
  final = f'ckpt-{steps}'
  diff = br.max_relative_diff(br.read_checkpoint(str(whole / final)),
                              br.read_checkpoint(str(killed / final)))
  print(f'killed after {survived[-1]}; max relative difference {diff:.3g}')
  assert diff <= 1e-6


def test_sigterm_and_time_limit_stop_after_a_step_with_its_checkpoint(
    tmp_path):
  args = (f'--model={br.MODEL}', '--max_steps=100000',
          f'--model_params_override={br.FAST}; '
          'task.train.save_interval_steps: 100000')  # Only the final save.
  termed = br.start('trainer', *args, f'--logdir={tmp_path / "termed"}')
  timed = br.start('trainer', *args, f'--logdir={tmp_path / "timed"}',
                   '--max_train_minutes=0.02')
  deadline = time.monotonic() + 240
  while not (tmp_path / 'termed' / 'train').exists():  # Training started.
    assert termed.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  time.sleep(1.0)
  termed.send_signal(signal.SIGTERM)
  for proc, name, reason in ((termed, 'termed', 'SIGTERM received'),
                             (timed, 'timed', '--max_train_minutes=0.02 reached')):
    rc, _, err = br.finish(proc)
    assert rc == 0, err
    listed = checkpoints.list_checkpoints(str(tmp_path / name))
    assert len(listed) == 1, listed  # The stop's own save.
    step = checkpoints.step_of(listed[0])
    assert 0 < step < 100000
    assert f'Stopped at step {step} of 100000 ({reason})' in err
    values = br.read_checkpoint(listed[0])
    assert values['step/.ATTRIBUTES/VARIABLE_VALUE'] == step
