"""The evaler binary end to end: exactly-once scoring, exact metrics."""

import json
import os
import re
import shutil

import pytest

import binary_runner as br
from lingvo_pipe.core import checkpoints
from lingvo_pipe.core import summaries


def _scores(score_dir):
  return {name: json.loads((score_dir / name).read_text())
          for name in sorted(os.listdir(score_dir)) if name.endswith('.json')}


@pytest.fixture(scope='module')
def eval_runs(trained_logdir, tmp_path_factory):
  tmp = tmp_path_factory.mktemp('eval')
  copies = {}
  for name in ('all', 'latest', 'deleted', 'one'):
    copies[name] = tmp / name
    shutil.copytree(trained_logdir, copies[name])
  for suffix in ('.index', '.data-00000-of-00001'):  # Listed, then deleted.
    os.remove(copies['deleted'] / f'ckpt-20{suffix}')
  runs = [
      ('evaler', (f'--logdir={copies["all"]}', '--mode=all')),
      ('evaler', (f'--logdir={copies["latest"]}', '--mode=latest',
                  '--eval_dataset=Test', f'--model={br.MODEL}')),
      ('evaler', (f'--logdir={copies["deleted"]}', '--mode=all')),
      ('evaler', (f'--logdir={copies["one"]}', '--checkpoint=20')),
  ]
  results = dict(zip(copies, br.run_many(runs)))
  return results, copies


def test_all_scores_every_checkpoint_exactly_with_numpy(eval_runs):
  results, copies = eval_runs
  rc, _, err = results['all']
  assert rc == 0, err
  score_dir = copies['all'] / 'eval_dev'
  scores = _scores(score_dir)
  assert sorted(scores) == ['ckpt-10.json', 'ckpt-20.json', 'ckpt-30.json']
  for name, record in scores.items():
    step = int(re.search(r'\d+', name).group())
    assert record['step'] == step
    assert record['num_examples'] == 200  # 6 batches of 32 and one of 8.
    assert record['checkpoint'] == str(copies['all'] / f'ckpt-{step}')
    assert {'eval_seconds', 'wall_time'} <= set(record)
    want = br.numpy_metrics(br.read_checkpoint(record['checkpoint']), 'Dev')
    for key, value in want.items():
      assert record['metrics'][key] == pytest.approx(value, rel=1e-5)
  scalars = summaries.read_scalars(str(score_dir))
  assert [s for s, _ in scalars['loss']] == [10, 20, 30]


def test_second_run_scores_nothing_new(eval_runs):
  _, copies = eval_runs
  before = br.tree(copies['all'])
  rc, _, err = br.run('evaler', f'--logdir={copies["all"]}', '--mode=all')
  assert rc == 0, err
  assert 'Nothing new to score' in err
  assert br.tree(copies['all']) == before


def test_latest_scores_only_the_newest_on_test(eval_runs):
  results, copies = eval_runs
  rc, _, err = results['latest']
  assert rc == 0, err
  scores = _scores(copies['latest'] / 'eval_test')
  assert list(scores) == ['ckpt-30.json']
  assert scores['ckpt-30.json']['num_examples'] == 500
  assert not (copies['latest'] / 'eval_dev').exists()


def test_checkpoint_scores_that_one_once_and_a_missing_one_is_refused(
    eval_runs):
  results, copies = eval_runs
  rc, _, err = results['one']
  assert rc == 0, err
  scores = _scores(copies['one'] / 'eval_dev')
  assert list(scores) == ['ckpt-20.json']
  assert scores['ckpt-20.json'] == _scores(copies['all'] / 'eval_dev')[
      'ckpt-20.json'] | {'checkpoint': str(copies['one'] / 'ckpt-20'),
                          'eval_seconds': scores['ckpt-20.json'][
                              'eval_seconds'],
                          'wall_time': scores['ckpt-20.json']['wall_time']}
  before = br.tree(copies['one'])
  rc, _, err = br.run('evaler', f'--logdir={copies["one"]}',
                      '--checkpoint=ckpt-20')
  assert rc == 0, err
  assert 'already scored' in err
  assert br.tree(copies['one']) == before
  rc, _, err = br.run('evaler', f'--logdir={copies["one"]}',
                      '--checkpoint=25')
  assert rc == 2
  assert re.search(r'--checkpoint=25: no such checkpoint .*listed steps: '
                   r'10, 20, 30\); pass one of those steps', err), err
  assert br.tree(copies['one']) == before


def test_a_listed_checkpoint_deleted_before_reading_is_skipped(eval_runs):
  results, copies = eval_runs
  rc, _, err = results['deleted']
  assert rc == 0, err
  assert re.search(r'Skipping \S*ckpt-20: deleted', err)
  assert sorted(_scores(copies['deleted'] / 'eval_dev')) == [
      'ckpt-10.json', 'ckpt-30.json']


def test_continuous_beside_a_running_trainer_scores_each_once(tmp_path):
  logdir = tmp_path / 'logdir'
  # Started together: the evaler waits for the trainer's params.txt.
  evaler = br.start('evaler', f'--logdir={logdir}', '--mode=continuous',
                    '--poll_interval_secs=0.1', '--timeout_secs=280')
  trainer = br.start('trainer', f'--model={br.MODEL}', f'--logdir={logdir}',
                     '--max_steps=200', f'--model_params_override={br.FAST}; '
                     'task.train.save_interval_steps: 40')
  rc, _, err = br.finish(trainer)
  assert rc == 0, err
  rc, _, err = br.finish(evaler)
  assert rc == 0, err
  steps = [40, 80, 120, 160, 200]
  assert [checkpoints.step_of(c) for c in
          checkpoints.list_checkpoints(str(logdir))] == steps
  scored = re.findall(r'Scored \S*ckpt-(\d+) ', err)
  assert sorted(int(s) for s in scored) == steps  # Each exactly once.
  assert sorted(_scores(logdir / 'eval_dev')) == sorted(
      f'ckpt-{s}.json' for s in steps)
  loss = summaries.read_scalars(str(logdir / 'eval_dev'))['loss']
  assert sorted(s for s, _ in loss) == steps
