"""A logdir trained once for the tests of this directory."""

import pytest

import binary_runner as br


@pytest.fixture(scope='session')
def trained_logdir(tmp_path_factory):
  """30 steps of the synthetic model, a checkpoint every 10."""
  logdir = tmp_path_factory.mktemp('trained') / 'logdir'
  rc, _, err = br.run(
      'trainer', f'--model={br.MODEL}', f'--logdir={logdir}', '--max_steps=30',
      f'--model_params_override={br.FAST}; '
      'task.train.save_interval_steps: 10')
  assert rc == 0, err
  return logdir
