"""Schedules against a numpy float64 transcription of the module docstring."""

import math

import numpy as np
import pytest

from lingvo_pipe.core import base_model
from lingvo_pipe.core import learning_rate
from lingvo_pipe.core import model_registry


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
    frac = min(max((s - w) / max(p.max_steps - w, 1), 0.0), 1.0)
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
])
def test_invalid_params_name_the_key(override, key):
  with pytest.raises(learning_rate.LearningRateError, match=key):
    learning_rate.validate(_train(**override))


# ---- Smoke runs (issue 29) ---------------------------------------------------
# `--max_steps=5` is how people check that a model runs at all. With a
# 10-step warm-up the trainer refused it ("make max_steps larger than the
# warm-up"), and the cosine term then divided by max_steps − w (NaN at
# w = max_steps) and clipped to a rate of 0 from step 0 when max_steps < w.
def _assert_every_step_trains(p):
  learning_rate.validate(p)  # No refusal.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Every step at once: the formulas are elementwise (a constant rate with no
  # warm-up does not depend on the step: broadcast).
  rates = np.broadcast_to(learning_rate.learning_rate(
      p, tf.range(p.max_steps)).numpy(), [p.max_steps])
  bad = [(s, r) for s, r in enumerate(rates) if not 0 < r < math.inf]
  assert not bad, f'{p.lr_schedule}: (step, rate) {bad}'


@pytest.mark.parametrize('schedule', learning_rate.SCHEDULES)
@pytest.mark.parametrize('max_steps, warmup', [
    (5, 10), (10, 10), (11, 10), (1, 10), (1, 0), (1, 1), (2, 1)])
def test_every_step_of_a_short_run_has_a_positive_rate(schedule, max_steps,
                                                       warmup):
  _assert_every_step_trains(_train(
      lr_schedule=schedule, lr_warmup_steps=warmup, max_steps=max_steps,
      learning_rate=0.01, lr_decay_steps=2, lr_decay_rate=0.5))


@pytest.mark.parametrize('model', model_registry.list_models())
def test_smoke_runs_of_every_registered_model_train(model):
  train = model_registry.get_params(model, 'Train').task.train
  for max_steps in sorted({5, 10, train.lr_warmup_steps or 1}):
    _assert_every_step_trains(train.Copy().Set(max_steps=max_steps))


def test_a_run_inside_its_warm_up_is_warned_about_not_refused():
  p = _train(lr_schedule='cosine', lr_warmup_steps=10, max_steps=5)
  note = learning_rate.short_run_warning(p)
  assert 'max_steps=5' in note and '0.5×' in note and 'cosine decay' in note
  assert learning_rate.short_run_warning(p.Set(max_steps=11)) == ''
  assert learning_rate.short_run_warning(p.Set(lr_warmup_steps=0)) == ''
