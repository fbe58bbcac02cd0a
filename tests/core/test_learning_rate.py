"""Schedules against a numpy float64 transcription of the module docstring."""

import math

import numpy as np
import pytest

from lingvo_pipe.core import base_model
from lingvo_pipe.core import learning_rate


def _train(**kwargs):
  return base_model.train_params().Set(**kwargs)


def _reference(p, s):
  """The documented formulas, one step at a time, in float64."""
  w = p.lr_warmup_steps
  warm = min(1.0, (s + 1) / w) if w > 0 else 1.0
  if p.lr_schedule == 'constant':
    decay = 1.0
  elif p.lr_schedule == 'exponential':
    decay = p.lr_decay_rate ** math.floor(s / p.lr_decay_steps)
  elif p.lr_schedule == 'cosine':
    frac = min(max((s - w) / (p.max_steps - w), 0.0), 1.0)
    decay = 0.5 * (1 + math.cos(math.pi * frac))
  else:
    decay = math.sqrt(max(w, 1) / max(s + 1, w, 1))
  return p.learning_rate * warm * decay


@pytest.mark.parametrize('schedule', learning_rate.SCHEDULES)
@pytest.mark.parametrize('warmup', [0, 1, 7])
def test_matches_reference(schedule, warmup):
  p = _train(lr_schedule=schedule, lr_warmup_steps=warmup, learning_rate=0.3,
             lr_decay_steps=5, lr_decay_rate=0.5, max_steps=40)
  steps = [0, 1, 2, 5, 6, 7, 8, 19, 39, 40, 100]
  got = [float(learning_rate.learning_rate(p, s)) for s in steps]
  want = [_reference(p, s) for s in steps]
  # float32 cos near π: absolute tolerance relative to the peak rate.
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * 0.3)


def test_warmup_is_linear_and_peaks_at_learning_rate():
  p = _train(lr_schedule='rsqrt', lr_warmup_steps=4, learning_rate=1.0)
  got = [float(learning_rate.learning_rate(p, s)) for s in range(6)]
  np.testing.assert_allclose(got[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
  assert got[4] < 1.0 and max(got) == pytest.approx(1.0)


def test_tensor_step_equals_int_step():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  p = _train(lr_schedule='exponential', lr_decay_steps=3)
  assert float(learning_rate.learning_rate(p, tf.constant(7, tf.int64))) == (
      float(learning_rate.learning_rate(p, 7)))


@pytest.mark.parametrize('override, key', [
    (dict(lr_schedule='linear'), 'lr_schedule'),
    (dict(lr_warmup_steps=-1), 'lr_warmup_steps'),
    (dict(lr_schedule='exponential', lr_decay_steps=0), 'lr_decay_steps'),
    (dict(lr_schedule='cosine', lr_warmup_steps=10, max_steps=10),
     'max_steps'),
])
def test_invalid_params_name_the_key(override, key):
  with pytest.raises(learning_rate.LearningRateError, match=key):
    learning_rate.validate(_train(**override))
