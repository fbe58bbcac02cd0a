"""Learning-rate schedules: the learning rate as a pure function of the step.

The rate depends on nothing but `task.train` and the global step, so a
restarted trainer computes exactly the rate the uninterrupted one would have,
and the schedule can be tested against a few lines of numpy.

`step` is the number of updates already applied (0 for the first update).
With `w = lr_warmup_steps` and `lr = learning_rate`, the rate of step s is

    warm(s)     = min(1, (s + 1) / w)                   (1 when w = 0)
    constant    = lr · warm(s)
    exponential = lr · warm(s) · rate^floor(s / lr_decay_steps)
    cosine      = lr · warm(s) · ½(1 + cos(π · clip((s − w) / max(max_steps − w,
                                                         1), 0, 1)))
    rsqrt       = lr · warm(s) · sqrt(max(w, 1) / max(s + 1, w, 1))

so every schedule peaks at `lr` when the warm-up ends; rsqrt is the
Transformer's "linear warm-up, then 1/√step" normalised to that peak.

Every step a run trains (0 ≤ s < max_steps) gets a rate > 0, also when
max_steps ≤ w: `--max_steps=5` is how people check that a model runs at
all, so a warm-up longer than the run is no error. Such a run only warms up
(`short_run_warning` says so); the cosine's decay would start after it.
"""

from __future__ import annotations

import math

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core.hyperparams import Params

SCHEDULES = ('constant', 'exponential', 'cosine', 'rsqrt')


class LearningRateError(errors.LingvoPipeError):
  """Training params that define no valid schedule."""


def validate(train: Params) -> None:
  """Checks `task.train`'s schedule fields; raises LearningRateError."""
  if not 0 < train.learning_rate < math.inf:
    raise LearningRateError(
        f'task.train.learning_rate must be finite and > 0, got '
        f'{train.learning_rate}; e.g. 1e-3.')
  if train.lr_schedule not in SCHEDULES:
    raise LearningRateError(
        f'task.train.lr_schedule is {train.lr_schedule!r}; use one of '
        f'{", ".join(SCHEDULES)}.')
  if train.lr_warmup_steps < 0:
    raise LearningRateError(f'task.train.lr_warmup_steps must be ≥ 0, got '
                            f'{train.lr_warmup_steps}.')
  if train.lr_schedule == 'exponential' and not (
      0 < train.lr_decay_rate < math.inf):
    raise LearningRateError(f'task.train.lr_decay_rate must be finite and '
                            f'> 0, got {train.lr_decay_rate}.')
  if train.lr_schedule == 'exponential' and train.lr_decay_steps <= 0:
    raise LearningRateError(f'task.train.lr_decay_steps must be > 0 for the '
                            f'exponential schedule, got '
                            f'{train.lr_decay_steps}.')


def short_run_warning(train: Params) -> str:
  """What a run no longer than its warm-up should know ('' if nothing)."""
  w, steps, kind = train.lr_warmup_steps, train.max_steps, train.lr_schedule
  if w <= 0 or steps > w:
    return ''
  decay = (f', and the {kind} decay never starts' if kind in ('cosine',
                                                              'rsqrt') else '')
  return (f'task.train.max_steps={steps} is no longer than the {w}-step '
          'warm-up (task.train.lr_warmup_steps): the last step trains at '
          f'{steps / w:.2g}× the warmed-up learning rate{decay}. Fine for a '
          'smoke run; train longer than the warm-up for a real one.')


def learning_rate(train: Params, step: tf.Tensor | int) -> tf.Tensor:
  """The learning rate (float32 scalar) of update number `step`.

  Args:
    train: `task.train` Params (see `base_model.train_params`).
    step: Updates applied so far: a Python int or an integer scalar tensor.

  Returns:
    A float32 scalar tensor.
  """
  validate(train)
  s = tf.cast(step, tf.float32)
  lr = tf.constant(train.learning_rate, tf.float32)
  w = float(train.lr_warmup_steps)
  warm = tf.minimum(1.0, (s + 1.0) / w) if w > 0 else tf.constant(1.0)
  kind = train.lr_schedule
  if kind == 'constant':
    decay = tf.constant(1.0)
  elif kind == 'exponential':
    periods = tf.floor(s / float(train.lr_decay_steps))
    decay = tf.pow(tf.constant(train.lr_decay_rate, tf.float32), periods)
  elif kind == 'cosine':
    # max(·, 1): a run no longer than its warm-up never decays (no 0/0).
    span = float(max(train.max_steps - w, 1))
    frac = tf.clip_by_value((s - w) / span, 0.0, 1.0)
    decay = 0.5 * (1.0 + tf.cos(math.pi * frac))
  else:  # rsqrt
    floor = max(w, 1.0)
    decay = tf.sqrt(floor / tf.maximum(s + 1.0, floor))
  return lr * warm * decay
