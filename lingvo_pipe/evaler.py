"""The evaler binary: scores a trainer's checkpoints on Dev or Test, once each.

    python -m lingvo_pipe.evaler --logdir=/tmp/mlp --eval_dataset=Dev \\
        --mode=continuous

The model is the trainer's: the registry's config with the `task.*` lines of
`logdir/params.txt` applied (so training-time overrides hold), the input is
the eval split's Params (plus --model_params_override). It runs in inference
mode: no micro-batches, no recompute, BatchNorm on its moving averages.

Exactly once: each scored checkpoint gets a JSON score file in
`logdir/eval_<dataset>/` (step, metrics, number of examples, checkpoint path,
wall time), written atomically, and a checkpoint with a score file is never
scored again, across restarts too (`--checkpoint=STEP` scores just that
one, say to compare two runs at the same step). Only checkpoints listed in
the trainer's `checkpoint` state file are read (it lists a checkpoint only
once written); one deleted before or while it is read (the trainer keeps
only the last few) is logged and skipped, and each checkpoint is restored
through a fresh `tf.train.Checkpoint`, so a failed restore leaves nothing
pending for the next. TensorBoard summaries go to the same directory.

A checkpoint is never scored as a result unless every weight is finite (a
trainer of this version never saves one that is not, but an older one did).
In `latest` and `all` modes a non-finite checkpoint ends the run: one line
naming it and its variables, exit status 2, nothing recorded for it. In
`continuous` mode it is skipped with one warning line naming it, and the
evaler waits for the next one (exit 2 if it was the last, at max_steps).
A damaged state file or checkpoint is one line and exit 2 in every mode.
"""

from __future__ import annotations

# pylint: disable=g-bad-import-order,g-import-not-at-top
import sys

from lingvo_pipe import _signals

if __name__ == '__main__':  # Before anything imports TensorFlow.
  _signals.exit_on_signals('evaler', _signals.EVALER)
  from lingvo_pipe import _startup
  _startup.import_tensorflow(sys.argv)

from lingvo_pipe import _cli

import ast
import json
import os
import time

from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.core import checkpoints
from lingvo_pipe.pipeline import devices
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import summaries
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.core.nested_map import NestedMap

_MODEL = flags.DEFINE_string('model', '', 'The model (a registered name or '
                             'module.Class of your own module); default: the '
                             'one in logdir/params.txt.')
_LOGDIR = flags.DEFINE_string('logdir', '', 'The trainer\'s logdir.')
_DATASET = flags.DEFINE_enum('eval_dataset', 'Dev', ['Dev', 'Test'],
                             'Which split to score.')
_MODE = flags.DEFINE_enum(
    'mode', 'latest', ['latest', 'all', 'continuous'], 'latest: the newest '
    'checkpoint; all: every checkpoint, oldest first; continuous: wait for '
    'new ones until one at or past task.train.max_steps is scored.')
_CHECKPOINT = flags.DEFINE_string(
    'checkpoint', '', 'Score this one listed checkpoint instead (its step, '
    'e.g. 1500, or its name, ckpt-1500), say to compare two runs at the same '
    'step; not with --mode=continuous.')
_OVERRIDE = flags.DEFINE_string(
    'model_params_override', '', 'Params overrides ("path : value" separated '
    'by ";"), applied after logdir/params.txt.')
_NUM_CPUS = flags.DEFINE_integer('num_logical_cpu_devices', 2, 'Split the '
                                 'CPU into this many logical devices.')
_POLL_SECS = flags.DEFINE_float('poll_interval_secs', 10.0, 'continuous: '
                                'seconds between looks for new checkpoints.')
_TIMEOUT_SECS = flags.DEFINE_float(
    'timeout_secs', 0.0, 'continuous: give up (exit 1) after this many '
    'seconds without reaching max_steps; 0 waits forever.')


def score_dir(logdir: str, dataset: str) -> str:
  return os.path.join(logdir, f'eval_{dataset.lower()}')


def _score_path(score_dir: str, ckpt: str) -> str:
  return os.path.join(score_dir, os.path.basename(ckpt) + '.json')


def read_scores(score_dir: str) -> list[dict]:
  """Every score record in `score_dir`, by step."""
  if not os.path.isdir(score_dir):
    return []
  out = []
  for name in os.listdir(score_dir):
    if name.endswith('.json') and not name.startswith('.'):
      with open(os.path.join(score_dir, name), encoding='utf-8') as f:
        out.append(json.load(f))
  return sorted(out, key=lambda r: r['step'])


class Evaler:
  """Restores checkpoints into the task and scores the eval split."""

  def __init__(self, params: Params, logdir: str, dataset: str) -> None:
    self._params = params
    self.task = params.task.Instantiate()
    self._input = params.input.Instantiate()
    self._input.CheckAvailable()
    with tf.device('/device:CPU:0'):
      self._step = tf.Variable(0, dtype=tf.int64, trainable=False,
                               name='global_step')
    self._logdir = logdir
    self.score_dir = score_dir(logdir, dataset)
    self._writer: tf.summary.SummaryWriter | None = None
    self._eval_fn = tf.function(self._eval_step, reduce_retracing=True)
    self.skipped: set[str] = set()  # Non-finite: not scored, not retried.

  def _eval_step(self, batch: NestedMap) -> NestedMap:
    with fprop_context.scope(training=False):
      return self.task.EvalStep(self.task.theta, batch)

  def unscored(self) -> list[str]:
    """Listed checkpoints without a score file, oldest first."""
    return [c for c in checkpoints.list_checkpoints(self._logdir)
            if not os.path.exists(_score_path(self.score_dir, c))]

  def score(self, ckpt: str, skip_non_finite: bool = False) -> dict | None:
    """Scores `ckpt` and records it.

    Returns None, scoring nothing, if `ckpt` was deleted before or while it
    was read, or if it holds non-finite weights and `skip_non_finite`.

    Raises:
      checkpoints.CheckpointError: `ckpt` is damaged, or (unless
        `skip_non_finite`) holds non-finite weights.
    """
    start = time.time()
    # A fresh object: after a failed restore, one keeps that checkpoint as
    # its pending restore (issue 11: the next restore then read a deleted
    # file). The optimizer's slots are not needed here (partial).
    restored = tf.train.Checkpoint(step=self._step, task=self.task)
    if not checkpoints.restore(restored, ckpt, partial=True):
      logging.warning('Skipping %s: deleted before it could be read.', ckpt)
      return None
    bad = checkpoints.non_finite(self.task.variables)
    if bad:
      what = (f'{ckpt} holds non-finite values in {len(bad)} variables (e.g. '
              f'{", ".join(bad[:2])}): not scored')
      if not skip_non_finite:
        raise checkpoints.CheckpointError(
            f'{what}. Score another checkpoint (--mode=all scores each), or '
            'delete it; the trainer that wrote it diverged.')
      logging.warning('Skipping %s.', what)
      self.skipped.add(ckpt)
      return None
    aggregator = self.task.CreateEvalAggregator()
    num_examples = 0
    for batch in base_input_generator.without_autotune_thread(
        self._input.EvalDataset()):
      outputs = self._eval_fn(batch)
      num_examples += int(tf.nest.flatten(batch)[0].shape[0])
      aggregator.Update(_numpy(batch), _numpy(outputs))
    record = {
        'step': int(self._step.numpy()),
        'checkpoint': ckpt,
        'metrics': {k: float(v) for k, v in aggregator.Finalize().items()},
        'num_examples': num_examples,
        'eval_seconds': time.time() - start,
        'wall_time': time.time(),
    }
    self._record(ckpt, record)
    return record

  def _record(self, ckpt: str, record: dict) -> None:
    try:
      os.makedirs(self.score_dir, exist_ok=True)
    except OSError as e:
      raise _cli.UserError(f'Cannot create {self.score_dir}: {e.strerror}; '
                           'make the logdir writable.') from None
    if self._writer is None:
      self._writer = tf.summary.create_file_writer(self.score_dir)
    summaries.scalars(self._writer, record['step'], record['metrics'])
    checkpoints.write_file_atomically(_score_path(self.score_dir, ckpt),
                               json.dumps(record, indent=1, sort_keys=True))
    logging.info('Scored %s (step %d, %d examples): %s', ckpt,
                 record['step'], record['num_examples'],
                 ', '.join(f'{k}={v:.6g}' for k, v in
                           sorted(record['metrics'].items())))

  def run_once(self, latest_only: bool) -> None:
    listed = checkpoints.list_checkpoints(self._logdir)
    if not listed:  # Not "nothing new": nothing at all.
      raise _cli.UserError(
          f'{self._logdir} holds no checkpoint yet (none is listed in '
          f'{os.path.join(self._logdir, checkpoints.STATE_FILE)}), so there '
          'is nothing to score; run the trainer first, or use '
          '--mode=continuous to wait for its checkpoints.')
    if not checkpoints.exists(listed[-1]):
      # The trainer deletes only older checkpoints: the newest, listed and
      # missing, was never written here (a state file copied alone).
      raise checkpoints.CheckpointError(
          f'{listed[-1]} is the newest checkpoint listed in '
          f'{os.path.join(self._logdir, checkpoints.STATE_FILE)}, but its '
          f'files are missing; {checkpoints.state_fix(self._logdir)}')
    todo = self.unscored()
    if latest_only:
      todo = [c for c in todo if c == listed[-1]]
    if not todo:
      logging.info('Nothing new to score in %s.', self._logdir)
    for ckpt in todo:
      self.score(ckpt)

  def run_one(self, which: str) -> None:
    """Scores the listed checkpoint `which` (a step or a name), once."""
    listed = checkpoints.list_checkpoints(self._logdir)
    name = os.path.basename(which.rstrip('/'))
    wanted = [c for c in listed if name in (os.path.basename(c),
                                            str(checkpoints.step_of(c)))]
    if not wanted:
      steps = ', '.join(str(checkpoints.step_of(c)) for c in listed)
      raise _cli.UserError(
          f'--checkpoint={which}: no such checkpoint is listed in '
          f'{os.path.join(self._logdir, checkpoints.STATE_FILE)} (listed '
          f'steps: {steps or "none"}); pass one of those steps.')
    ckpt = wanted[0]
    if ckpt not in self.unscored():
      logging.info('%s is already scored: %s.', ckpt,
                   _score_path(self.score_dir, ckpt))
      return
    if self.score(ckpt) is None:
      raise checkpoints.CheckpointError(
          f'{ckpt} was deleted before it could be read (the trainer keeps '
          'only its newest checkpoints); pass a newer step.')

  def run_continuous(self, poll_secs: float, deadline: float | None) -> None:
    """Scores new checkpoints until one at or past max_steps is scored."""
    max_steps = self._params.task.train.max_steps
    while True:
      for ckpt in self.unscored():
        if ckpt not in self.skipped:
          self.score(ckpt, skip_non_finite=True)
      if any(r['step'] >= max_steps for r in read_scores(self.score_dir)):
        logging.info('Scored a checkpoint at step ≥ %d: done.', max_steps)
        return
      if any(checkpoints.step_of(c) >= max_steps for c in self.skipped):
        raise checkpoints.CheckpointError(
            f'The checkpoint at step ≥ {max_steps} (task.train.max_steps) '
            'holds non-finite values, and no later one will come; score an '
            'earlier one with --mode=all.')
      _sleep_or_time_out(
          poll_secs, deadline,
          f'a checkpoint at step ≥ {max_steps} in {self._logdir}')


def _sleep_or_time_out(poll_secs: float, deadline: float | None,
                       waiting_for: str) -> None:
  """Sleeps one poll interval; exits 1 if --timeout_secs has passed."""
  if deadline is not None and time.monotonic() > deadline:
    raise _cli.RunStopped(f'timed out after --timeout_secs='
                          f'{_TIMEOUT_SECS.value:g} waiting for {waiting_for}.',
                          exit_code=1)
  time.sleep(poll_secs)


def _wait_for_params(logdir: str, poll_secs: float,
                     deadline: float | None) -> None:
  """continuous: the evaler may start before the trainer wrote params.txt."""
  path = os.path.join(logdir, _cli.PARAMS_FILE)
  if not os.path.exists(path):
    logging.info('Waiting for the trainer to write %s.', path)
  while not os.path.exists(path):
    _sleep_or_time_out(poll_secs, deadline, path)


def _numpy(tree: NestedMap) -> NestedMap:
  return tf.nest.map_structure(
      lambda t: t.numpy() if hasattr(t, 'numpy') else np.asarray(t), tree)


def build_params(logdir: str, dataset: str) -> Params:
  """Registry params of the eval split + the trainer's task.* + overrides."""
  path = os.path.join(logdir, _cli.PARAMS_FILE)
  if not os.path.isfile(path):
    raise _cli.UserError(f'{path} not found: --logdir must be a trainer\'s '
                         'logdir; run the trainer first or fix --logdir.')
  lines = _cli.read_text_file(path, 'restore the file the trainer wrote'
                             ).splitlines()
  try:
    trained = next((ast.literal_eval(l.split(':', 1)[1].strip())
                    for l in lines if l.startswith('model :')), '')
  except (ValueError, SyntaxError):
    raise _cli.UserError(f'{path}: unreadable "model : ..." line; restore '
                         'the file the trainer wrote.') from None
  model = _MODEL.value or trained
  if trained and model != trained:
    raise _cli.UserError(f'--model={model} but {path} was trained as '
                         f'{trained}; drop --model or fix --logdir.')
  params = model_registry.get_params(model, dataset)
  _cli.apply_overrides(params, '\n'.join(l for l in lines
                                         if l.startswith('task.')),
                       _OVERRIDE.value)
  return params


def _main(argv: list[str]) -> None:
  del argv  # The flags parser refuses positional arguments.
  with _cli.exit_on_user_error('evaler'):
    devices.configure_logical_cpus(_NUM_CPUS.value)  # Before any TF op.
    if not _LOGDIR.value:
      raise _cli.UserError('--logdir is required: the trainer\'s logdir.')
    logdir = _LOGDIR.value
    if _CHECKPOINT.value and _MODE.value == 'continuous':
      raise _cli.UserError(
          f'--checkpoint={_CHECKPOINT.value} scores one checkpoint, '
          '--mode=continuous waits for new ones: drop one of the two.')
    _cli.check_writable_dir(score_dir(logdir, _DATASET.value))
    deadline = (time.monotonic() + _TIMEOUT_SECS.value
                if _TIMEOUT_SECS.value > 0 else None)
    if _MODE.value == 'continuous':
      _wait_for_params(logdir, _POLL_SECS.value, deadline)
    params = build_params(logdir, _DATASET.value)
    evaler = Evaler(params, logdir, _DATASET.value)
    if _CHECKPOINT.value:
      evaler.run_one(_CHECKPOINT.value)
    elif _MODE.value == 'continuous':
      evaler.run_continuous(_POLL_SECS.value, deadline)
    else:
      evaler.run_once(latest_only=_MODE.value == 'latest')


def run() -> None:
  """Console-script entry point (`lingvo_pipe_evaler`)."""
  _cli.run_binary(_main, 'evaler', sys.modules[__name__])


if __name__ == '__main__':
  run()
