"""KerasLayer: theta, checkpoints, refusals, noise and dtypes (issue 28).

The transparency of whole models (against Keras itself) is in
tests/test_keras.py; the layer contract in test_conformance.py.
"""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe import keras as lp_keras
from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import keras_layer


def _layer(keras_obj, input_shape, name=None):
  p = lp_keras.layer_params(keras_obj, input_shape, weights=False)
  if name:
    p.name = name
  return p.Instantiate()


def test_theta_is_keyed_by_keras_path_and_checkpointed_once(tmp_path):
  mha = keras.layers.MultiHeadAttention(2, 4)
  mha.build((None, 5, 8), (None, 5, 8))
  layer = lp_keras.layer_params(mha).Instantiate()
  assert sorted(layer.theta) == sorted(
      f'{part}_{kind}' for part in ('query', 'key', 'value', 'attention_output')
      for kind in ('kernel', 'bias'))
  # The user's trained values came along, in Keras's order.
  for w, key in zip(mha.weights, layer.weight_keys):
    np.testing.assert_array_equal(layer.theta[key], w.value)
  assert len(layer.trainable_variables) == len(mha.trainable_weights)
  drop = _layer(keras.layers.Dropout(0.5), (None, 4))  # A seed generator.
  path = tf.train.Checkpoint(layer=layer, drop=drop).save(
      str(tmp_path / 'ckpt'))
  stored = [name for name, _ in tf.train.list_variables(path)
            if name.startswith(('layer/', 'drop/'))]
  assert len(stored) == len(layer.variables) == 8
  x = tf.ones([2, 5, 8])
  layer.FProp(layer.theta, x, x)
  with keras.StatelessScope():  # Keras initializes pending variables here.
    pass
  # pylint: disable-next=protected-access
  assert all(v._value is None for v in layer.keras_layer.variables)


def test_initial_weights_depend_on_path_only_and_leave_random_alone():
  dense = [keras.layers.Dense(3) for _ in range(3)]  # These draw seeds.
  state = random.getstate()
  a = _layer(dense[0], (None, 4), name='a')
  b = _layer(dense[1], (None, 4), name='b')
  a2 = _layer(dense[2], (None, 4), name='a')
  assert random.getstate() == state
  np.testing.assert_array_equal(a.theta.kernel, a2.theta.kernel)
  assert not np.allclose(a.theta.kernel, b.theta.kernel)


class _Counter(keras.layers.Layer):
  """Counts its calls in a non-trainable weight."""

  def build(self, input_shape):
    self.calls = self.add_weight(shape=(), initializer='zeros',
                                 trainable=False, name='calls')

  def call(self, x):
    self.calls.assign_add(1.0)
    return x


class _Noisy(keras.layers.Layer):
  """Adds noise from a SeedGenerator of its own."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.seeds = keras.random.SeedGenerator(1)

  def call(self, x, training=False):
    return x + keras.random.normal(keras.ops.shape(x), seed=self.seeds)


keras.saving.register_keras_serializable('lingvo_pipe_tests')(_Counter)
keras.saving.register_keras_serializable('lingvo_pipe_tests')(_Noisy)


@pytest.mark.parametrize('make, why', [
    (lambda: _Counter(name='counter'), 'updates its non-trainable state'),
    (lambda: _Noisy(name='noisy'), 'SeedGenerator'),
    (lambda: keras.layers.Dense(3, kernel_regularizer='l2'), 'regularizer'),
    (lambda: keras.layers.Dense(3, kernel_constraint='non_neg'),
     'constraint'),
    (lambda: keras.layers.Dense(3, activity_regularizer='l2'), 'adds a loss'),
    (lambda: keras.layers.BatchNormalization(renorm=True), 'renorm=True'),
])
def test_a_layer_the_pipeline_cannot_train_faithfully_is_refused(make, why):
  layer = make()
  with pytest.raises(base_layer.LayerError) as e:
    lp_keras.layer_params(layer, (None, 4))
  message = str(e.value)
  assert '\n' not in message and why in message
  assert message.startswith(f'from_keras: Keras layer {type(layer).__name__} '
                            f'{layer.name!r} cannot be pipelined faithfully')


def test_attention_dropout_and_masks_are_refused_too():
  mha = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name='att')
  mha.build((None, 5, 8), (None, 5, 8))
  with pytest.raises(base_layer.LayerError, match="'att'.*SeedGenerator"):
    lp_keras.layer_params(mha)
  with pytest.raises(base_layer.LayerError, match='Keras mask'):
    lp_keras.layer_params(keras.layers.Embedding(9, 4, mask_zero=True),
                          (None, 6))


def test_params_written_by_hand_are_refused_when_built():
  p = lp_keras.layer_params(keras.layers.Dense(3), (None, 4))
  p.keras_layer = keras.saving.serialize_keras_object(
      keras.layers.Dense(3, kernel_regularizer='l2'))
  p.name = 'fc'
  with pytest.raises(base_layer.LayerError, match=r'^fc: Keras layer Dense'):
    p.Instantiate()


def test_unregistered_class_unknown_weights_and_wrong_shapes_name_a_fix():

  class Unregistered(keras.layers.Layer):

    def call(self, x):
      return x

  with pytest.raises(base_layer.LayerError,
                     match='register_keras_serializable'):
    lp_keras.layer_params(Unregistered(), (None, 4))
  p = lp_keras.layer_params(keras.layers.Dense(3), (None, 4)).Set(
      name='fc', keras_weights='sha256:0000')
  with pytest.raises(base_layer.LayerError,
                     match=r"^fc: keras_weights='sha256:0000' .* from_keras"):
    p.Instantiate()
  with pytest.raises(base_layer.LayerError, match='do not fit'):
    keras_layer.KerasLayer.FPropMeta(p, [2, 5])


def test_float32_weights_compute_in_float64_on_theta_cast():
  p = lp_keras.layer_params(keras.layers.Dense(3), (None, 4), weights=False)
  p.name = 'fc'
  fp32, fp64 = p.Instantiate(), p.Copy().Set(fprop_dtype=tf.float64
                                             ).Instantiate()
  assert fp64.keras_layer.dtype_policy.name == 'float64'
  assert fp64.theta.kernel.dtype == tf.float32  # Same weights as float32.
  np.testing.assert_array_equal(fp64.theta.kernel, fp32.theta.kernel)
  x = tf.random.stateless_normal([2, 4], seed=[5, 6], dtype=tf.float64)
  y = fp64.FProp(fp64.theta, x)
  assert y.dtype == tf.float64
  np.testing.assert_allclose(
      y, x @ tf.cast(fp32.theta.kernel, tf.float64), rtol=1e-12)


def test_frozen_batch_norm_keeps_its_statistics_and_adds_none():
  bn = _layer(keras.layers.BatchNormalization(trainable=False),
              (None, 3))
  assert not bn.trainable_variables
  collector = fprop_context.StatsCollector()
  x = tf.random.stateless_normal([8, 3], seed=[3, 4]) * 4 + 2
  with fprop_context.scope(training=True, stats=collector):
    y = bn.FProp(bn.theta, x)
  assert not collector.stats
  np.testing.assert_allclose(y, x / np.sqrt(1 + 1e-3), rtol=1e-6)


@pytest.mark.parametrize('make', [
    lambda: keras.layers.Dropout(0.5),
    lambda: keras.layers.SpatialDropout2D(0.5),
    lambda: keras.layers.GaussianNoise(0.5),
    lambda: keras.layers.GaussianDropout(0.5),
    lambda: keras.layers.AlphaDropout(0.5),
])
def test_noise_is_a_function_of_step_and_example(make):
  layer = _layer(make(), (None, 4, 4, 3), name='noise')
  x = tf.random.stateless_normal([8, 4, 4, 3], seed=[1, 2])
  np.testing.assert_array_equal(layer.FProp(layer.theta, x), x)  # Eval.

  def run(step, first, rows):
    with fprop_context.scope(training=True, step=step, first_example=first,
                             global_batch_size=8):
      return np.asarray(layer.FProp(layer.theta, x[rows]))

  whole = run(5, 0, slice(0, 8))
  halves = np.concatenate([run(5, 0, slice(0, 4)), run(5, 4, slice(4, 8))])
  np.testing.assert_array_equal(whole, halves)  # However it is cut.
  assert not np.allclose(whole, run(6, 0, slice(0, 8)))
  assert not np.allclose(whole, np.asarray(x))


def test_noise_statistics_follow_keras_definitions():
  zeros, ones = tf.zeros([64, 64]), tf.ones([64, 64, 1, 8])
  with fprop_context.scope(training=True, step=1):
    noise = _layer(keras.layers.GaussianNoise(0.5), (None, 64))
    assert abs(float(np.std(noise.FProp(noise.theta, zeros))) - 0.5) < 0.02
    spatial = _layer(keras.layers.SpatialDropout2D(0.5), (None, 64, 1, 8))
    y = np.asarray(spatial.FProp(spatial.theta, ones))
    assert set(np.unique(y)) == {0.0, 2.0}
    assert (y == y[:, :1]).all()  # One draw per example and channel.
