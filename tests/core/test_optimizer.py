"""Optimizers: numpy float64 references, slot placement, checkpoints."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_model
from lingvo_pipe.core import optimizer

_SHAPES = [(3, 2), (4,)]


def _grads(num_steps):
  rng = np.random.default_rng(5)
  return [[rng.normal(size=s) for s in _SHAPES] for _ in range(num_steps)]


def _reference(train, inits, grads, lrs):
  """The update rules of the module docstring in float64."""
  out = []
  for v0, gs in zip(inits, zip(*grads)):
    v = v0.astype(np.float64)
    a = np.ones_like(v) if train.optimizer == 'rmsprop' else np.zeros_like(v)
    b = np.zeros_like(v)
    for t, (g, lr) in enumerate(zip(gs, lrs), start=1):
      if train.optimizer == 'sgd':
        a = train.momentum * a + g
        v = v - lr * a
      elif train.optimizer == 'adam':
        b1, b2, eps = train.adam_beta1, train.adam_beta2, train.epsilon
        a = b1 * a + (1 - b1) * g
        b = b2 * b + (1 - b2) * g * g
        v = v - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * a / (np.sqrt(b) + eps)
      else:
        a = train.rmsprop_decay * a + (1 - train.rmsprop_decay) * g * g
        b = train.momentum * b + lr * g / np.sqrt(a + train.epsilon)
        v = v - b
    out.append(v)
  return out


@pytest.mark.parametrize('name', optimizer.OPTIMIZERS)
def test_matches_numpy_reference(name):
  train = base_model.train_params().Set(optimizer=name, momentum=0.8,
                                        epsilon=1e-6)
  rng = np.random.default_rng(0)
  inits = [rng.normal(size=s).astype(np.float32) for s in _SHAPES]
  variables = [tf.Variable(x, name=f'w{i}') for i, x in enumerate(inits)]
  opt = optimizer.from_params(train)
  opt.build(variables)
  grads, lrs = _grads(5), [0.1, 0.05, 0.02, 0.02, 0.01]
  apply = tf.function(opt.apply)
  for step, (g, lr) in enumerate(zip(grads, lrs)):
    apply([tf.constant(x, tf.float32) for x in g], variables,
          tf.constant(lr), tf.constant(step, tf.int64))
  for got, want in zip(variables, _reference(train, inits, grads, lrs)):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_slots_live_on_their_variables_device():
  variables = []
  for i, shape in enumerate(_SHAPES):
    with tf.device(f'/device:CPU:{i + 1}'):
      variables.append(tf.Variable(tf.zeros(shape), name=f'w{i}'))
  opt = optimizer.from_params(
      base_model.train_params().Set(optimizer='rmsprop'))
  opt.build(variables)
  for var in variables:
    slots = opt.slots(var)
    assert sorted(slots) == ['momentum', 'ms']
    for slot in slots.values():
      assert slot.device == var.device, (slot.name, slot.device, var.device)
  # RMSProp's ms starts at 1 (TF1), its momentum at 0.
  np.testing.assert_array_equal(opt.slots(variables[0])['ms'].numpy(), 1.0)


def test_checkpoint_restores_slots_by_variable_name(tmp_path):
  train = base_model.train_params().Set(optimizer='adam')
  a = [tf.Variable(tf.zeros(s), name=f'layer{i}/w')
       for i, s in enumerate(_SHAPES)]
  opt = optimizer.from_params(train)
  opt.build(a)
  opt.apply([tf.ones(s) * (i + 1) for i, s in enumerate(_SHAPES)], a,
            tf.constant(0.1), tf.constant(0, tf.int64))
  path = tf.train.Checkpoint(opt=opt).save(str(tmp_path / 'ckpt'))

  # Same variables, listed in the other order: slots still match by name.
  b = [tf.Variable(tf.zeros(s), name=f'layer{i}/w')
       for i, s in enumerate(_SHAPES)]
  restored = optimizer.from_params(train)
  restored.build(list(reversed(b)))
  tf.train.Checkpoint(opt=restored).restore(path).assert_consumed()
  for va, vb in zip(a, b):
    for slot in ('m', 'v'):
      np.testing.assert_array_equal(opt.slots(va)[slot].numpy(),
                                    restored.slots(vb)[slot].numpy())


def test_none_gradient_leaves_variable_alone():
  v = tf.Variable([1.0, 2.0])
  opt = optimizer.from_params(base_model.train_params().Set(optimizer='sgd'))
  opt.build([v])
  opt.apply([None], [v], tf.constant(1.0), tf.constant(0, tf.int64))
  np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


def test_duplicate_variable_names_are_refused():
  opt = optimizer.from_params(base_model.train_params())
  with pytest.raises(optimizer.OptimizerError, match="'twin'.*unique"):
    opt.build([tf.Variable([1.0], name='twin'), tf.Variable([2.0],
                                                            name='twin')])


def test_apply_without_build_names_the_fix():
  v = tf.Variable([1.0], name='lonely')
  opt = optimizer.from_params(base_model.train_params().Set(optimizer='sgd'))
  with pytest.raises(optimizer.OptimizerError, match='lonely.*build'):
    opt.apply([tf.ones([1])], [v], tf.constant(1.0), tf.constant(0))


@pytest.mark.parametrize('override, key', [
    (dict(optimizer='adagrad'), 'optimizer'),
    (dict(momentum=1.0), 'momentum'),
    (dict(adam_beta2=-0.1), 'adam_beta2'),
    (dict(epsilon=-1.0), 'epsilon'),
])
def test_invalid_params_name_the_key(override, key):
  with pytest.raises(optimizer.OptimizerError, match=f'task.train.{key}'):
    optimizer.from_params(base_model.train_params().Set(**override))
