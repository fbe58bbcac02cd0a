"""apply_dropout, DropoutLayer: the mask depends on (key, step, example)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import dropout


def _drop(x, rate=0.5, key='model.drop', step=7, mb=0, m=1, batch_axis=0,
          noise_shape_fn=None):
  """Dropout of micro-batch `mb` of `m` (x is that micro-batch)."""
  b = np.shape(x)[batch_axis] if batch_axis < np.ndim(x) else 1
  global_fields = dict(first_example=mb * b, global_batch_size=m * b)
  with fprop_context.scope(training=True, step=step, micro_batch_index=mb,
                           num_micro_batches=m, batch_axis=batch_axis,
                           **(global_fields if m > 1 else {})):
    return np.asarray(dropout.apply_dropout(x, rate, key, noise_shape_fn))


def _micro_batched(x, m, **kwargs):
  """Dropout applied to x cut into m micro-batches, concatenated back."""
  parts = np.split(x, m)
  return np.concatenate([_drop(part, mb=i, m=m, **kwargs)
                         for i, part in enumerate(parts)])


def test_eval_and_zero_rate_are_identity():
  x = np.random.rand(4, 5).astype(np.float32)
  np.testing.assert_array_equal(dropout.apply_dropout(x, 0.5, 'k'), x)
  np.testing.assert_array_equal(_drop(x, rate=0.0), x)


def test_same_step_micro_batch_and_key_give_the_same_mask():
  # The pipeline's recompute pass relies on this.
  x = np.ones([4, 16], np.float32)
  np.testing.assert_array_equal(_drop(x), _drop(x))
  np.testing.assert_array_equal(
      _drop(x, step=7, mb=1, m=2),
      _drop(x, step=tf.constant(7, tf.int64), mb=tf.constant(1), m=2))


@pytest.mark.parametrize('m', [2, 4, 8])
def test_mask_of_an_example_does_not_depend_on_micro_batching(m):
  x = np.random.rand(8, 3, 5).astype(np.float32)
  whole = _drop(x)
  np.testing.assert_array_equal(_micro_batched(x, m), whole)


@pytest.mark.parametrize('m', [1, 2, 4])
def test_time_major_batch_gets_the_batch_major_mask(m):
  # Regression: a time-major pipeline (batch_dim=1) put its batch *axis* in
  # the context field dropout read as the micro-batch *size*.
  x = np.random.rand(8, 3, 5).astype(np.float32)  # [B, T, D]
  whole = _drop(x)
  time_major = np.transpose(x, [1, 0, 2])  # [T, B, D]
  parts = np.split(time_major, m, axis=1)
  got = np.concatenate([_drop(p, mb=i, m=m, batch_axis=1)
                        for i, p in enumerate(parts)], axis=1)
  np.testing.assert_array_equal(np.transpose(got, [1, 0, 2]), whole)


def test_micro_batching_invariance_with_shared_noise_dims():
  x = np.ones([8, 6, 4], np.float32)
  share_time = lambda s: [s[0], 1, s[2]]
  whole = _drop(x, noise_shape_fn=share_time)
  np.testing.assert_array_equal(
      _micro_batched(x, 4, noise_shape_fn=share_time), whole)
  np.testing.assert_array_equal(whole, np.repeat(whole[:, :1], 6, axis=1))


def test_different_steps_and_keys_give_different_masks():
  x = np.ones([4, 64], np.float32)
  base = _drop(x)
  assert (base != _drop(x, step=8)).any()
  assert (base != _drop(x, key='model.other')).any()
  # Different micro-batches of one step get different rows of the mask.
  assert (_drop(x, mb=0, m=2) != _drop(x, mb=1, m=2)).any()


def test_rate_and_scaling():
  rate = 0.3
  x = np.full([200, 500], 2.0, np.float32)
  y = _drop(x, rate=rate)
  kept = y != 0
  np.testing.assert_allclose(y[kept], 2.0 / (1 - rate), rtol=1e-6)
  assert abs((1 - kept.mean()) - rate) < 0.01  # 100k draws: σ ≈ 0.0015.


def test_traced_once_masks_follow_tensor_step_and_micro_batch():
  x = tf.ones([2, 32])
  with fprop_context.scope(training=True, num_micro_batches=2,
                           step=tf.Variable(0, dtype=tf.int64),
                           global_batch_size=4,
                           first_example=tf.Variable(0)) as ctx:
    fn = tf.function(lambda x: dropout.apply_dropout(x, 0.5, 'k'))
    results = {}
    for step, mb in [(1, 0), (1, 1), (2, 0)]:
      ctx.step.assign(step)
      ctx.first_example.assign(2 * mb)
      results[step, mb] = fn(x).numpy()
  for (step, mb), got in results.items():
    np.testing.assert_array_equal(got, _drop(x, key='k', step=step, mb=mb,
                                             m=2))


def test_bad_rate_and_wrong_batch_dim_raise():
  with pytest.raises(base_layer.LayerError, match=r'model.drop: .*\[0, 1\)'):
    _drop(np.ones([2, 2], np.float32), rate=1.0)
  with pytest.raises(base_layer.LayerError, match='batch is on axis 4'):
    _drop(np.ones([2, 2], np.float32), batch_axis=4)


def test_dropout_layer_uses_its_path_as_key():
  p = dropout.DropoutLayer.Params().Set(name='drop', dropout_rate=0.25)
  layer = p.Instantiate()
  x = np.ones([4, 10], np.float32)
  with fprop_context.scope(training=True, step=7):
    y = layer.FProp(layer.theta, x).numpy()
  np.testing.assert_array_equal(y, _drop(x, rate=0.25, key='drop'))
  np.testing.assert_array_equal(layer.FProp(layer.theta, x), x)  # eval
  with pytest.raises(base_layer.LayerError, match='drop: dropout_rate'):
    p.Copy().Set(dropout_rate=-0.1).Instantiate()


def test_mask_does_not_depend_on_dtype():
  x = np.ones([4, 64], np.float32)
  half = _drop(tf.constant(x, tf.bfloat16))
  assert half.dtype == tf.bfloat16.as_numpy_dtype
  np.testing.assert_array_equal(half.astype(np.float32) != 0, _drop(x) != 0)


def test_unknown_batch_size_under_tf_function():
  fn = tf.function(lambda x: dropout.apply_dropout(x, 0.5, 'model.drop'),
                   input_signature=[tf.TensorSpec([None, 16])])
  x = np.ones([4, 16], np.float32)
  with fprop_context.scope(training=True, step=7, micro_batch_index=1,
                           num_micro_batches=2, first_example=4,
                           global_batch_size=8):
    got = fn(x).numpy()
  np.testing.assert_array_equal(got, _drop(x, mb=1, m=2))
