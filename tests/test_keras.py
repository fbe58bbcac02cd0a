"""A Keras model pipelined: the same training as Keras's own (issue 28).

The references are Keras itself: the model under `tf.GradientTape`,
applied to each micro-batch in turn (GPipe normalises each micro-batch by
its own statistics), its moving statistics after one training call on the
whole batch, and `model.fit`. lingvo_pipe's side runs the layers that
`from_keras` made, pipelined K=2, M=4 on logical CPU devices.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe import keras as lp_keras
from lingvo_pipe.core import base_layer
from lingvo_pipe.core import base_model
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.core import optimizer
from lingvo_pipe.pipeline import transparency

BATCH, M = 16, 4


def _cnn(dropout_rate=0.0, batch_norm=True):
  layers = [keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation='relu')]
  if batch_norm:
    layers.append(keras.layers.BatchNormalization(momentum=0.9))
  layers.append(keras.layers.MaxPooling2D())
  if dropout_rate is not None:
    layers.append(keras.layers.Dropout(dropout_rate))
  layers += [keras.layers.Flatten(), keras.layers.Dense(5)]
  return keras.Sequential(layers)


def _pipeline(model, num_stages=2, num_micro_batches=M, **kwargs):
  return gpipe.PipeliningLayer.Params().Set(
      name='net', layers=lp_keras.from_keras(model), num_stages=num_stages,
      num_micro_batches=num_micro_batches, input_shapes=[[BATCH, 8, 8, 1]],
      **kwargs).Instantiate()


def _data(n=BATCH, seed=0):
  rng = np.random.default_rng(seed)
  return (tf.constant(rng.standard_normal((n, 8, 8, 1)), tf.float32),
          tf.constant(rng.integers(0, 5, n), tf.int32))


def _loss_fn(logits, labels):
  ce = keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                    from_logits=True)
  return {'loss': (tf.reduce_mean(ce), tf.cast(tf.size(ce), tf.float32))}


def _pipelined_step(net, x, y, step=3):
  collector = fprop_context.StatsCollector()
  with tf.GradientTape() as tape:
    with fprop_context.scope(training=True, step=step, stats=collector):
      loss = net.FPropLoss(net.theta, (x,), y, _loss_fn)['loss'][0]
  grads = tape.gradient(loss, net.theta)
  return loss, grads, collector.stats


def _by_keras_path(net, tree):
  """{Keras variable path below the model: value} of a theta-like tree."""
  out = {}
  for layer, theta in zip(net.children.layers, tree.layers):
    for key in layer.weight_keys:
      value = theta[key]
      if value is not None:
        out[f'{layer.keras_layer.name}/{key}'] = np.asarray(value)
  return out


def _keras_by_path(model, values):
  return {f'{v.path.split("/", 1)[1]}': np.asarray(x)
          for v, x in zip(model.weights, values)}


def _assert_close(got, want, what, tol=1e-5):
  assert sorted(got) == sorted(want), what
  for key in want:
    scale = max(float(np.max(np.abs(want[key]))), 1e-6)
    err = float(np.max(np.abs(got[key] - want[key]))) / scale
    assert err <= tol, f'{what} {key}: relative error {err:.2e}'


def test_pipelined_cnn_equals_keras_micro_batch_by_micro_batch():
  model = _cnn(dropout_rate=0.0)  # BatchNorm; the dropout layer is off.
  twin = keras.models.clone_model(model)
  twin.set_weights(model.get_weights())
  net = _pipeline(model)
  assert net.plan.num_stages == 2
  x, y = _data()
  loss, grads, stats = _pipelined_step(net, x, y)
  net.UpdateStats(stats)

  with tf.GradientTape() as tape:
    total = 0.0
    for m in range(M):
      rows = slice(m * BATCH // M, (m + 1) * BATCH // M)
      logits = model(x[rows], training=True)
      total += tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
          y[rows], logits, from_logits=True))
    want_loss = total / BATCH
  want_grads = tape.gradient(want_loss, model.trainable_variables)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  trainable = [v.path.split('/', 1)[1] for v in model.trainable_variables]
  _assert_close(_by_keras_path(net, grads),
                dict(zip(trainable, map(np.asarray, want_grads))),
                'gradient')
  twin(x, training=True)  # Keras's moving statistics for the whole batch.
  moving = {k: v for k, v in _keras_by_path(twin, twin.weights).items()
            if 'moving' in k}
  got = {k: v for k, v in _by_keras_path(net, net.theta).items()
         if 'moving' in k}
  assert len(moving) == 2
  _assert_close(got, moving, 'moving statistics')


def test_with_dropout_pipelined_equals_unpipelined():
  model = _cnn(dropout_rate=0.5, batch_norm=False)
  x, y = _data()
  k2 = _pipelined_step(_pipeline(model), x, y)
  k1 = _pipelined_step(_pipeline(model, 1, 1), x, y)
  net = _pipeline(model)
  _assert_close(_by_keras_path(net, k2[1]), _by_keras_path(net, k1[1]),
                'gradient')
  np.testing.assert_allclose(float(k2[0]), float(k1[0]), rtol=1e-5)
  no_dropout = _pipelined_step(_pipeline(_with_rate(model, 0.0)), x, y)
  assert abs(float(no_dropout[0]) - float(k2[0])) > 1e-3  # It did drop.


def _with_rate(model, rate):
  config = model.get_config()
  for layer in config['layers']:
    if layer['class_name'] == 'Dropout':
      layer['config']['rate'] = rate
  twin = keras.Sequential.from_config(config)
  twin.set_weights(model.get_weights())
  return twin


def test_twenty_sgd_steps_written_back_equal_model_fit():
  model = _cnn(dropout_rate=None, batch_norm=False)
  start = model.get_weights()
  x, y = _data(20 * BATCH, seed=1)
  lr = 0.1
  net = _pipeline(model)
  train = base_model.train_params().Set(optimizer='sgd', momentum=0.0)
  opt = optimizer.from_params(train)
  variables = list(net.trainable_variables)
  opt.build(variables)

  @tf.function
  def _step(xb, yb):
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        loss = net.FPropLoss(net.theta, (xb,), yb, _loss_fn)['loss'][0]
    opt.apply(tape.gradient(loss, variables), variables, lr, 0)

  for i in range(20):
    _step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
  model.compile(optimizer=keras.optimizers.SGD(lr),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  fitted = _keras_by_path(model, model.weights)
  model.set_weights(start)
  lp_keras.to_keras(net, model)
  written = _keras_by_path(model, model.weights)
  assert any(not np.allclose(a, b) for a, b in zip(start, model.weights))
  _assert_close(written, fitted, 'weights after 20 steps')


def test_to_keras_without_a_model_builds_one_that_predicts_the_same(
    tmp_path):
  model = _cnn(dropout_rate=0.2)
  net = _pipeline(model)
  x, _ = _data()
  built = lp_keras.to_keras(net)
  np.testing.assert_allclose(built.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-5,
                             atol=1e-6)
  path = str(tmp_path / 'cnn.keras')
  built.save(path)
  np.testing.assert_allclose(keras.models.load_model(path)(x), net.FProp(
      net.theta, x), rtol=1e-5, atol=1e-6)


def test_a_functional_chain_is_taken_and_a_branch_refused():
  inputs = keras.Input((6,))
  h = keras.layers.Dense(6, activation='relu', name='hidden')(inputs)
  chain = keras.Model(inputs, keras.layers.Dense(2, name='out')(h))
  assert [p.name for p in lp_keras.from_keras(chain)] == ['hidden', 'out']
  skip = keras.Model(inputs, keras.layers.Add(name='skip')([inputs, h]))
  with pytest.raises(base_layer.LayerError, match="layer 'skip' takes"):
    lp_keras.from_keras(skip)


def test_mixed_bfloat16_is_float32_weights_computing_in_bfloat16():
  model = keras.Sequential([
      keras.Input((4,)),
      keras.layers.Dense(3, dtype='mixed_bfloat16', name='fc')])
  (p,) = lp_keras.from_keras(model)
  assert (p.dtype, p.fprop_dtype) == (tf.float32, tf.bfloat16)
  layer = p.Instantiate()
  assert layer.theta.kernel.dtype == tf.float32
  x = tf.random.stateless_normal([2, 4], seed=[1, 2])
  y = layer.FProp(layer.theta, x)
  assert y.dtype == tf.bfloat16
  np.testing.assert_array_equal(np.asarray(tf.cast(y, tf.float32)),
                                np.asarray(tf.cast(model(x), tf.float32)))
  # A pipeline's fprop_dtype reaches a float32 Keras layer the same way.
  fp32 = lp_keras.from_keras(keras.Sequential([keras.Input((4,)),
                                               keras.layers.Dense(3)]))
  net = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=fp32, fprop_dtype=tf.bfloat16).Instantiate()
  dense = net.children.layers[0]
  assert dense.keras_layer.dtype_policy.name == 'mixed_bfloat16'
  assert dense.FProp(dense.theta, x).dtype == tf.bfloat16


def test_check_transparency_passes_for_a_cnn_with_batch_norm_and_dropout():
  # The unpipelined twin runs micro-batch by micro-batch (BatchNorm), in
  # float32 and in float64 (Keras layers computing in float64 on theta).
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=lp_keras.from_keras(_cnn(dropout_rate=0.5)),
      num_stages=2, num_micro_batches=M, input_shapes=[[BATCH, 8, 8, 1]])
  report = transparency.check_transparency(p, (_data()[0],), step=4,
                                           micro_batched_reference=True)
  assert report.ok(), str(report)
