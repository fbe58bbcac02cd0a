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


_SAMPLERS = [tf.random.stateless_uniform, tf.random.stateless_normal]


@pytest.mark.parametrize('sampler', _SAMPLERS)
@pytest.mark.parametrize('total,rest', [(64, [16, 24]), (13, [7, 3]),
                                        (10, [5]), (6, []), (9, [2, 3])])
def test_drawn_rows_are_the_rows_of_the_global_draw(sampler, total, rest):
  # Only this call's rows are drawn; they must be bit for bit the rows of
  # one draw for the whole global batch (the definition of the mask), at
  # every offset: rows of 21 or 5 elements start mid-way through Philox's
  # groups of 4.
  x = tf.zeros([total] + rest)
  seed = dropout.mask_seed('model.noise', 7)
  every = sampler([total] + rest, seed).numpy()
  for first in range(total):
    for n in {1, 2, total - first}:
      if first + n > total:
        continue
      with fprop_context.scope(training=True, step=7, first_example=first,
                               global_batch_size=total):
        got = dropout.example_noise(x[first:first + n], 'model.noise',
                                    sampler)
      np.testing.assert_array_equal(got, every[first:first + n])


def test_drawn_rows_with_unknown_dims_under_tf_function():
  seed = dropout.mask_seed('model.noise', 3)
  every = tf.random.stateless_uniform([8, 5, 3], seed).numpy()
  fn = tf.function(
      lambda x: dropout.example_noise(x, 'model.noise',
                                      tf.random.stateless_uniform),
      input_signature=[tf.TensorSpec([None, None, 3])])
  with fprop_context.scope(training=True, step=3, first_example=3,
                           global_batch_size=8):
    got = fn(tf.zeros([2, 5, 3]))
  np.testing.assert_array_equal(got, every[3:5])


def test_another_sampler_draws_the_global_batch_and_slices_it():
  def sampler(shape, seed):
    return tf.random.stateless_uniform(shape, seed, minval=-2.0, maxval=2.0)
  seed = dropout.mask_seed('model.noise', 1)
  every = sampler([6, 4], seed).numpy()
  with fprop_context.scope(training=True, step=1, first_example=2,
                           global_batch_size=6):
    got = dropout.example_noise(tf.zeros([3, 4]), 'model.noise', sampler)
  np.testing.assert_array_equal(got, every[2:5])


def test_the_counter_carries_into_its_high_word():
  key, counter, alg = tf.raw_ops.StatelessRandomGetKeyCounterAlg(
      seed=tf.constant([1, 2], tf.int64))
  near_wrap = tf.constant([2**64 - 1, 5], tf.uint64)
  np.testing.assert_array_equal(dropout._advance(near_wrap, 1), [0, 6])
  np.testing.assert_array_equal(dropout._advance(counter, 3),
                                [counter[0] + 3, counter[1]])

  def draw(c, n):
    return tf.raw_ops.StatelessRandomUniformV2(
        shape=[n], key=key, counter=c, alg=alg, dtype=tf.float32).numpy()
  # Philox's second group of 4 from the counter below the wrap is the first
  # group from the one after it: the carry is where Philox puts it.
  np.testing.assert_array_equal(draw(near_wrap, 8)[4:],
                                draw(dropout._advance(near_wrap, 1), 4))


def test_a_micro_batch_draws_its_own_rows_only(monkeypatch):
  # The cost: a micro-batch of 8 rows of a 64-row global batch draws 8 rows
  # (+ at most 3 elements to reach Philox's group), not 64.
  drawn = []
  raw = dropout._COUNTER_BASED[tf.random.stateless_uniform]

  def counting(**kwargs):
    drawn.append(int(np.prod(kwargs['shape'])))
    return raw(**kwargs)
  monkeypatch.setitem(dropout._COUNTER_BASED, tf.random.stateless_uniform,
                      counting)
  with fprop_context.scope(training=True, step=1, first_example=25,
                           global_batch_size=64):
    dropout.apply_dropout(tf.ones([8, 5, 7]), 0.5, 'model.drop')
  assert len(drawn) == 1 and 8 * 35 <= drawn[0] <= 8 * 35 + 3
