"""The trainer binary: trains a registered model, checkpointing as it goes.

    python -m lingvo_pipe.trainer --model=synthetic.regression.MlpRegression \\
        --logdir=/tmp/mlp --model_params_override='task.train.max_steps: 200'

Everything that decides a run is in the logdir's `params.txt`, written before
the first step; a later run in the same logdir must have the same params
(else it refuses and prints the difference, unless --force).

A run can be killed at any moment (even SIGKILL) and restarted: it resumes
from the latest complete checkpoint, which holds the weights, the optimizer
slots and the global step, and the input order is a pure function of the
step, so it ends with the weights of an uninterrupted run. SIGTERM or
Ctrl-C (and --max_train_minutes running out) stop it after the current step
with a checkpoint of that step; a second signal stops it at once; during
start-up a signal stops it with a message (see `_signals`). A step whose
loss or gradient is not finite applies nothing, and one whose update makes
a weight or optimizer slot non-finite is caught right after it: either way
the trainer stops (exit 1) without saving, so the last checkpoint stays the
last good one.

Before it writes anything, the trainer checks everything the params, the
data and the logdir can get wrong (see `preflight`), and restores the
latest checkpoint: a bad config, or a damaged `checkpoint` file or
checkpoint, is one line, exit 2, and an untouched logdir.

What lands in the logdir: params.txt; checkpoint, ckpt-<step>.{index,data-*}
(the last task.train.max_checkpoints_to_keep); train/events.* (TensorBoard:
scalars, the params and the partition report as text); events.* (the
HParams session); timeline/step_<s>.{trace.json,png} (--timeline_steps);
profile/task<i>/ (--profile_steps: TensorFlow's profiler, each task's own).
"""

from __future__ import annotations

# pylint: disable=g-bad-import-order,g-import-not-at-top
import sys

from lingvo_pipe import _signals

if __name__ == '__main__':  # Before anything imports TensorFlow.
  _signals.exit_on_signals('trainer', _signals.STARTUP)
  from lingvo_pipe import _startup
  _startup.import_tensorflow(sys.argv)

from lingvo_pipe import _cli

import os
import time

from absl import flags
from absl import logging
import tensorflow as tf

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.core import base_model
from lingvo_pipe.core import checkpoints
from lingvo_pipe.core import cluster_share
from lingvo_pipe.pipeline import devices
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import learning_rate
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import optimizer
from lingvo_pipe.core import preflight
from lingvo_pipe.core import progress as progress_lib
from lingvo_pipe.core import run_summaries
from lingvo_pipe.core import step_profile
from lingvo_pipe.core import step_timeline
from lingvo_pipe.core import summaries
from lingvo_pipe.core import tied_weights
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.pipeline import placement
from lingvo_pipe.pipeline import processes
from lingvo_pipe.pipeline import watchdog

processes.define_flags()  # --cluster_spec, --job, --task: see worker.py.
flags.adopt_module_key_flags(processes)  # Listed by --help.

_MODEL = flags.DEFINE_string(
    'model', '', 'The model: a registered name under lingvo_pipe.params, '
    'e.g. synthetic.regression.MlpRegression, or module.Class of your own '
    'module (on PYTHONPATH or in the working directory) whose class is '
    'decorated with @model_registry.RegisterSingleTaskModel.')
_LOGDIR = flags.DEFINE_string('logdir', '', 'Directory for params.txt, '
                              'checkpoints and summaries.')
_OVERRIDE = flags.DEFINE_string(
    'model_params_override', '', 'Params overrides, "path : value" separated '
    'by ";", e.g. "task.train.learning_rate: 0.1; input.batch_size: 32".')
_OVERRIDE_FILE = flags.DEFINE_string(
    'model_params_file_override', '', 'A file of "path : value" lines, '
    'applied before --model_params_override.')
_MAX_STEPS = flags.DEFINE_integer('max_steps', None, 'Overrides '
                                  'task.train.max_steps.')
_MAX_MINUTES = flags.DEFINE_float(
    'max_train_minutes', 0.0, 'Stop after this many minutes of training '
    '(from the first step, tracing included) with a checkpoint of the last '
    'step; 0 = no limit. A later run continues to max_steps.')
_NUM_CPUS = flags.DEFINE_integer(
    'num_logical_cpu_devices', 2, 'Split the CPU into this many logical '
    'devices (pipeline stages without accelerators).')
_DEVICES = flags.DEFINE_string('devices', '', 'Comma-separated device per '
                               'pipeline stage (sets task.pipeline.devices).')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'inspect_params'],
                          'train, or print the final params and '
                          'task.Inspect() and exit (writes nothing).')
_PROFILE = flags.DEFINE_bool(
    'profile', False, 'With --mode=inspect_params: also time each pipeline '
    'layer on a real training batch and print the partition by measured '
    'time beside the FPropMeta one (PipeDream\'s profiling pass).')
_FORCE = flags.DEFINE_bool('force', False, 'Start even if logdir/params.txt '
                           'differs (it is then replaced).')
_DETERMINISTIC = flags.DEFINE_bool('deterministic', True, 'Enable TensorFlow '
                                   'op determinism (bit-exact resumes).')
_TIMELINE_STEPS = flags.DEFINE_list(
    'timeline_steps', [], 'Steps (counted from 1, e.g. 10 or 10,500) to '
    'record with the pipeline engine\'s timestamps: writes logdir/timeline/'
    'step_<s>.trace.json (chrome://tracing) and step_<s>.png (needs '
    'lingvo_pipe[plots]); on a cluster, every stage process\'s ops in one '
    'picture.')
_PROFILE_STEPS = flags.DEFINE_list(
    'profile_steps', [], 'First and last step (counted from 1, e.g. 10 or '
    '10,12) to trace with TensorFlow\'s profiler: every kernel of every '
    'thread. Each task writes logdir/profile/task<i>/ (TensorBoard\'s '
    'Profile tab, or tools/profile_report.py).')


class Trainer:
  """Holds the task, optimizer, global step and checkpoint of one run."""

  def __init__(self, params: Params, logdir: str,
               timeline_steps: tuple[int, ...] = (),
               profile_steps: tuple[int, int] | None = None) -> None:
    self._params = params
    self._train = params.task.train
    self.task: base_model.BaseTask = params.task.Instantiate()
    self._vars = list(self.task.trainable_variables)
    self._opt = optimizer.from_params(self._train)
    # A tied weight's copy: its slots are saved by the owner's process.
    self._opt.build(self._vars, untracked=tied_weights.copies_in(self.task))
    with tf.device('/device:CPU:0'):
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name='global_step')
    self._ckpt = tf.train.Checkpoint(step=self.step, task=self.task,
                                     optimizer=self._opt)
    self.share = cluster_share.Share.of(self.task)
    # What a save writes: checked finite after every update.
    self._saved_vars = list(self.task.variables) + list(self._opt.variables)
    self._logdir = logdir
    self._restored = False
    self._latest: str | None = None
    # No AutoGraph: FProps are graph code already (tf.cond, tf.while_loop),
    # and converting the pipeline's Python makes tracing ~3x slower.
    self._step_fn = tf.function(self._train_step, autograph=False)
    self._timeline = (step_timeline.TimelineSteps(
        logdir, timeline_steps, self.task, self._train_step)
                      if timeline_steps else None)
    self._profiler = step_profile.StepProfiler(logdir, profile_steps,
                                               self.share.task)
    self.stop_reason = ''  # Set (by a signal handler) to stop after a step.

  def restore(self) -> int:
    """Restores the latest checkpoint, if any (whole or sharded, written by
    any number of stage processes). Reads the logdir, writes nothing.

    Raises:
      checkpoints.CheckpointError: the state file or the latest checkpoint
        is damaged or missing (TensorFlow would start from step 0).
    """
    listed = checkpoints.list_checkpoints(self._logdir)  # Refuses damage.
    self._restored = True
    if listed:
      latest = listed[-1]
      if not checkpoints.restore(self._ckpt, latest,
                                 partial=self.share.multi_process):
        raise checkpoints.CheckpointError(
            f'{latest} is the latest checkpoint in '
            f'{os.path.join(self._logdir, checkpoints.STATE_FILE)} but its '
            f'files are gone; {checkpoints.state_fix(self._logdir)}')
      tied_weights.restore_copies(latest, self.task, self._opt)
      self._latest = latest
      logging.info('Restored %s (step %d).', latest, int(self.step.numpy()))
    return int(self.step.numpy())

  def save(self) -> str:
    """Writes a checkpoint of this step: each stage process of replica 0
    its shard; once all are written, the chief lists it and deletes the
    ones beyond task.train.max_checkpoints_to_keep."""
    if not self._restored:
      raise RuntimeError('Trainer.save() before restore(): call restore() '
                         'first; it reads the logdir\'s checkpoints.')
    share, step = self.share, int(self.step.numpy())
    path = checkpoints.path_of(self._logdir, step)
    if share.writes_shard:
      checkpoints.save(self._ckpt, self._logdir, step, share.stage,
                       share.num_stages)
    share.barrier('save')  # Every shard is on disk.
    if share.is_chief:
      checkpoints.commit(self._logdir, path,
                         self._train.max_checkpoints_to_keep)
    self._latest = path
    return path

  @property
  def latest_checkpoint(self) -> str | None:
    return self._latest

  def _train_step(self, batch: base_model.NestedMap,
                  timeline: list | None = None):
    """One step: loss, gradients, and the update iff all are finite.

    `timeline`, if a list, collects the pipeline's op timestamps.

    Returns:
      (metrics, gradient norm, status, learning rate); status 0: applied;
      1: loss or gradient not finite, nothing applied; 2: applied, but a
      weight or slot became non-finite (must not be saved).
    """
    train, variables = self._train, self._vars
    step = self.step.read_value()
    batch = self.share.replica_batch(batch)  # The global batch's slice.
    collector = fprop_context.StatsCollector()
    with fprop_context.scope(training=True, step=step, stats=collector,
                             timeline=timeline):
      with tf.GradientTape() as tape:
        metrics = self.task.FProp(self.task.theta, batch)
        loss = metrics['loss'][0]
        if train.weight_decay > 0:
          loss += train.weight_decay * 0.5 * tf.add_n(
              [tf.reduce_sum(tf.square(v)) for v in variables])
      grads = tape.gradient(loss, variables)
    norm = self.share.global_norm(  # Every stage's, in every process.
        tf.linalg.global_norm(self.share.counted(grads, variables)))
    finite = tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(norm))
    if train.clip_gradient_norm > 0:
      grads, _ = tf.clip_by_global_norm(grads, train.clip_gradient_norm,
                                        use_norm=norm)
    lr = learning_rate.learning_rate(train, step)

    def _apply() -> tf.Tensor:
      self._opt.apply(grads, variables, lr, step)
      self.task.UpdateStats(collector.stats)  # BatchNorm: once per step.
      self.step.assign_add(1)
      # Read after the assignments (automatic control dependencies).
      return tf.where(checkpoints.all_finite(self._saved_vars), 0, 2)

    status = tf.cond(finite, _apply, lambda: tf.constant(1))
    # Agreed by every process: the loss and norm are already; the weights'
    # finiteness is checked where they live.
    status = tf.where(self.share.any_task(tf.equal(status, 2), 'weights'),
                      2, status)
    return metrics, norm, status, lr

  def train(self, generator: base_input_generator.BaseInputGenerator,
            writer: tf.summary.SummaryWriter,
            max_minutes: float = 0.0) -> None:
    """Trains from the current step to max_steps; exits 1 on a bad step.

    Stops early, with a checkpoint of the last step, after `max_minutes`
    (if > 0) or once `stop_reason` is set.
    """
    train = self._train
    deadline = time.time() + 60 * max_minutes if max_minutes > 0 else None
    start = int(self.step.numpy())
    batch_size = generator.params.batch_size
    progress = progress_lib.Progress(train.max_steps, batch_size)
    rate = progress_lib.Rate(batch_size)
    if self._timeline is not None:
      self._timeline.plan_warm_ups(
          start + 1, base_input_generator.train_batch_shapes(generator))
    watchdog.expect_step(first=True)  # A stuck step ends a cluster task.
    for batch in base_input_generator.without_autotune_thread(
        generator.TrainDataset(start)):
      s = int(self.step.numpy())
      done = s + 1
      if done == start + 1:
        logging.info('Tracing the train step (compiles the model; minutes '
                     'for a deep pipeline)…')
      self._profiler.before(done)
      if self._timeline is not None and self._timeline.wants(done):
        metrics, norm, status, lr = self._timeline.run(done, batch)
      else:
        metrics, norm, status, lr = self._step_fn(batch)
      self._profiler.after(done)
      if int(status):
        self._stop_on_non_finite(s, metrics, norm, lr, writer, int(status))
      if done == start + 1:
        logging.info('Traced and ran the first step.')
        rate.examples_per_sec(done)  # Starts the clock after tracing.
      if self.share.is_chief:
        progress.update(done, float(metrics['loss'][0]))
      if done % train.summary_interval_steps == 0 or done == train.max_steps:
        self._write_summaries(writer, done, metrics, norm, lr,
                              rate.examples_per_sec(done))
      if deadline is not None and time.time() >= deadline:
        self.stop_reason = f'--max_train_minutes={max_minutes:g} reached'
      saved = done % train.save_interval_steps == 0
      if saved:
        logging.info('Saved %s.', self.save())
      # Read after the save: a signal during it stops here, not a step later.
      # Every process stops after the same step (a signal or a deadline may
      # reach them a step apart): the stop is agreed.
      stop = self.share.agree_to_stop(bool(self.stop_reason))
      watchdog.expect_step()
      if stop and not self.stop_reason:
        self.stop_reason = 'another task of the run is stopping'
      if done >= train.max_steps or stop:
        if not saved:
          logging.info('Saved %s.', self.save())
        if self.stop_reason and done < train.max_steps:
          logging.info('Stopped at step %d of %d (%s); run again to '
                       'continue.', done, train.max_steps, self.stop_reason)
        break
    self._profiler.close()  # Training ended inside the traced steps.
    watchdog.no_step_expected()
    if self.share.is_chief:
      progress.log(overall=True)

  def _write_summaries(self, writer, step, metrics, norm, lr,
                       examples_per_sec: float) -> None:
    values = {name: value for name, (value, _) in metrics.items()}
    if 'log_pplx' in values:  # A token mean: its exponential, the step's.
      values['perplexity'] = tf.exp(tf.minimum(
          tf.cast(values['log_pplx'], tf.float32), 80.0))
    values.update(learning_rate=lr, grad_global_norm=norm,
                  examples_per_sec=examples_per_sec)
    values.update(self.task.Summaries())
    summaries.scalars(writer, step, values)

  def _stop_on_non_finite(self, step: int, metrics, norm, lr, writer,
                          status: int) -> None:
    writer.flush()
    kept = self.latest_checkpoint
    kept_text = (f'the last good checkpoint is {kept}' if kept else
                 'no checkpoint was written')
    fix = ('Lower task.train.learning_rate or set '
           'task.train.clip_gradient_norm.')
    if status == 1:
      logging.error('Non-finite loss (%s) or gradient norm (%s) at step %d: '
                    'nothing was applied and nothing saved; %s. %s',
                    float(metrics['loss'][0]), float(norm), step, kept_text,
                    fix)
    else:
      bad = checkpoints.non_finite(self._saved_vars)
      logging.error('Non-finite weights after the update of step %d '
                    '(learning rate %g, gradient norm %g): %d variables, '
                    'e.g. %s; nothing saved; %s. %s', step, float(lr),
                    float(norm), len(bad), bad[:3], kept_text, fix)
    raise _cli.RunStopped(exit_code=1)


def _overridden_params() -> Params:
  """Registry params + the override file and --override."""
  if not _MODEL.value:
    raise _cli.UserError('--model is required, e.g. '
                         '--model=synthetic.regression.MlpRegression.')
  params = model_registry.get_params(_MODEL.value, 'Train')
  file_text = (_cli.read_override_file(_OVERRIDE_FILE.value)
               if _OVERRIDE_FILE.value else '')
  return _cli.apply_overrides(params, file_text, _OVERRIDE.value)


def build_params() -> Params:
  """Registry params + overrides + flags, validated."""
  params = _overridden_params()
  if _MAX_STEPS.value is not None:
    params.task.train.max_steps = _MAX_STEPS.value
  if _MAX_MINUTES.value < 0:
    raise _cli.UserError(f'--max_train_minutes={_MAX_MINUTES.value:g} is '
                         'negative; give the minutes to train, or 0 for no '
                         'limit.')
  _cli.set_devices(params, _DEVICES.value)
  _cli.validate_train_params(params)
  return params


def _inter_op_threads() -> int:
  """--inter_op_threads, or for 0 what the model's schedule needs: read
  from its params before TensorFlow starts (building them starts nothing).
  Params that do not build give 0 here; `build_params` reports them."""
  if flags.FLAGS.inter_op_threads:
    return flags.FLAGS.inter_op_threads
  try:
    params = _overridden_params()
  except Exception:  # pylint: disable=broad-except
    return 0
  schedules: list[object] = []
  params.Visit(lambda key, value: schedules.append(value)
               if key.rsplit('.', 1)[-1] == 'schedule' else None)
  return processes.inter_op_threads_for(*schedules)


def _inspect(params: Params) -> str:
  """--mode=inspect_params: the task's plan, profiled with --profile."""
  task_cls = params.task.cls
  if not _PROFILE.value:
    return task_cls.InspectParams(params.task)
  if not hasattr(task_cls, 'PipelineInputs'):
    raise _cli.UserError(f'--profile times the layers of a pipelined task; '
                         f'{task_cls.__name__} has no pipeline.')
  generator = params.input.Instantiate()
  generator.CheckAvailable()
  batch = next(iter(base_input_generator.without_autotune_thread(
      generator.TrainDataset(0))))
  return task_cls.InspectParams(params.task,
                                profile_inputs=task_cls.PipelineInputs(batch))


def _prepare(params: Params, logdir: str):
  """Everything that can refuse the run, before the logdir is touched.

  Returns:
    (trainer, input generator).
  """
  _cli.check_writable_dir(logdir)
  _cli.check_params_file(logdir, params, _FORCE.value)
  generator = params.input.Instantiate()
  generator.CheckAvailable()
  dataset = generator.TrainDataset(0)  # Builds (lazily): checks batch size.
  # Partition, devices, FPropMeta shapes.
  trainer = Trainer(params, logdir, _timeline_steps(),
                    step_profile.parse(_PROFILE_STEPS.value))
  for size in generator.TrainBatchSizes():  # Length buckets: one each.
    trainer.share.check_batch_size(size, 'input')
  preflight.check_train_batches(trainer.task, generator, dataset.element_spec)
  return trainer, generator


def _main(argv: list[str]) -> None:
  del argv  # The flags parser refuses positional arguments.
  with _cli.exit_on_user_error('trainer'):
    cluster = processes.cluster_from(flags.FLAGS.cluster_spec,
                                     flags.FLAGS.job, flags.FLAGS.task)
    if cluster is None or _MODE.value != 'train':
      devices.configure_logical_cpus(_NUM_CPUS.value)  # Before any TF op.
      runtime = processes.start(None)
    else:  # One task of a multi-process run: its server and peers first.
      runtime = processes.start(
          cluster, collective_timeout_s=flags.FLAGS.collective_timeout_secs,
          peer_timeout_s=flags.FLAGS.peer_timeout_secs,
          unreachable_s=flags.FLAGS.peer_unreachable_secs,
          compute_slice_us=flags.FLAGS.compute_slice_us,
          inter_op_threads=_inter_op_threads())
      placement.use(runtime.peers)
    if _DETERMINISTIC.value:
      tf.config.experimental.enable_op_determinism()
    params = build_params()
    if _MODE.value == 'inspect_params':
      print(params.ToText(), end='')
      print(_inspect(params))
      return
    with runtime:  # A dead peer: one line naming it, then exit.
      _train(params, _LOGDIR.value)


def _train(params: Params, logdir: str) -> None:
  """Checks, restores, then trains (in this task of the run)."""
  trainer, generator = _prepare(params, logdir)
  share = trainer.share
  start = trainer.restore()  # Reads only: damage is refused here.
  if share.is_chief:  # Everything is valid: only now touch the logdir.
    _cli.create_logdir(logdir, params.ToText())
    for path in checkpoints.remove_temp_dirs(logdir):
      logging.info('Removed %s, left by a save that was killed.', path)
    for path in checkpoints.remove_unlisted(logdir):
      logging.info('Removed %s, written by a save that was killed before it '
                   'was listed.', path)
  if start >= params.task.train.max_steps:
    logging.info('Already at step %d ≥ max_steps %d: nothing to do.', start,
                 params.task.train.max_steps)
    return
  if share.multi_process:
    logging.info('This process is %s.', share.describe())
  if share.is_chief:
    writer = _cli.summary_writer(logdir, 'train')
    run_summaries.write_run_description(logdir, writer, start, params,
                                        trainer.task)
  else:
    writer = tf.summary.create_noop_writer()
  _signals.stop_after_step(trainer)
  trainer.train(generator, writer, _MAX_MINUTES.value)
  writer.close()


def _timeline_steps() -> tuple[int, ...]:
  try:
    return tuple(int(s) for s in _TIMELINE_STEPS.value)
  except ValueError:
    raise _cli.UserError(
        f'--timeline_steps={",".join(_TIMELINE_STEPS.value)}: give step '
        'numbers, e.g. --timeline_steps=10 or 10,500.') from None


def run() -> None:
  """Console-script entry point (`lingvo_pipe_trainer`)."""
  _cli.run_binary(_main, 'trainer', sys.modules[__name__])


if __name__ == '__main__':
  run()
