"""Every layer in lingvo_pipe.layers keeps the layer contract.

The partitioner trusts FPropMeta (shapes, flops, bytes) without building a
layer, the pipeline trusts FProp to be stateless (its recompute pass must
reproduce the forward pass), and the trainer trusts Params to round-trip
through text. A layer that breaks any of these fails somewhere far away, so
this suite checks them for every `BaseLayer` subclass defined in any module
of `lingvo_pipe.layers`, on the samples in `samples_basic.py`,
`samples_seq.py` and `samples_keras.py` (wrapped Keras layers). A layer without a sample fails `test_every_layer_has_a_
sample`, naming the class.
"""

import importlib
import inspect
import os
import pkgutil
import sys

import numpy as np
import pytest
import tensorflow as tf

import lingvo_pipe.layers
from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context

sys.path.insert(0, os.path.dirname(__file__))  # For the samples modules.

_SAMPLE_MODULES = ('samples_basic', 'samples_seq', 'samples_keras')


def discover_layers():
  """Public BaseLayer subclasses defined in lingvo_pipe.layers.* modules."""
  found = []
  package = lingvo_pipe.layers
  for info in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f'{package.__name__}.{info.name}')
    for name, obj in inspect.getmembers(module, inspect.isclass):
      if (issubclass(obj, base_layer.BaseLayer) and
          obj.__module__ == module.__name__ and not name.startswith('_')):
        found.append(obj)
  return sorted(found, key=lambda c: (c.__module__, c.__name__))


def load_samples():
  """(samples, no_compute, not_linear_in_batch) from the samples modules."""
  samples, no_compute, not_linear = {}, set(), set()
  for name in _SAMPLE_MODULES:
    try:
      module = importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name == name:
        continue  # samples_seq.py may not exist yet.
      raise
    for cls, entries in module.SAMPLES.items():
      samples.setdefault(cls, []).extend(entries)
    no_compute |= set(getattr(module, 'NO_COMPUTE', ()))
    not_linear |= set(getattr(module, 'FLOPS_NOT_LINEAR_IN_BATCH', ()))
  return samples, no_compute, not_linear


def missing_samples(classes, samples):
  """Names of the classes that have no sample."""
  return [f'{c.__module__}.{c.__name__}' for c in classes
          if not samples.get(c)]


# ---- The checker ------------------------------------------------------------
def _make_inputs(shapes, input_maker, rng):
  if input_maker is not None:
    return tuple(input_maker(shapes, rng))
  return tf.nest.map_structure(
      lambda s: tf.constant(rng.standard_normal(s.as_list()), tf.float32),
      tuple(shapes))


def _as_tuple(out):
  return out if isinstance(out, tuple) else (out,)


def _assert_all_close(a, b, what, exact=False):
  tf.nest.assert_same_structure(a, b, check_types=False)
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    x, y = np.asarray(x), np.asarray(y)
    if exact or not np.issubdtype(x.dtype, np.floating):
      np.testing.assert_array_equal(x, y, err_msg=what)
    else:
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=what)


def _double_batch(shapes):
  return tf.nest.map_structure(
      lambda s: s if s.rank == 0 else tf.TensorShape([2 * s[0]] + s[1:]),
      tuple(shapes))


def _check_meta(cls, p, shapes, outputs, layer, has_compute, linear_in_batch):
  name = cls.__name__
  meta = cls.FPropMeta(p, *shapes)
  real = tf.nest.map_structure(lambda t: t.shape, _as_tuple(outputs))
  try:
    tf.nest.assert_same_structure(meta.out_shapes, real, check_types=False)
  except (ValueError, TypeError) as e:
    raise AssertionError(f'{name}: FPropMeta out_shapes structure '
                         f'{meta.out_shapes} != outputs {real}: {e}') from e
  for want, got in zip(tf.nest.flatten(meta.out_shapes),
                       tf.nest.flatten(real)):
    assert want.as_list() == got.as_list(), (
        f'{name}: FPropMeta out_shapes {meta.out_shapes} != real {real}')
  dtypes = [t.dtype for t in tf.nest.flatten(_as_tuple(outputs))]
  assert list(meta.out_dtypes) == dtypes, (
      f'{name}: FPropMeta out_dtypes {meta.out_dtypes} != real {dtypes}')
  real_bytes = sum(v.shape.num_elements() * v.dtype.size
                   for v in tf.nest.flatten(layer.theta))
  assert meta.param_bytes == real_bytes, (
      f'{name}: FPropMeta param_bytes {meta.param_bytes} != variable bytes '
      f'{real_bytes}')
  if has_compute:
    assert meta.flops > 0, f'{name}: FPropMeta flops must be > 0'
  if linear_in_batch:
    doubled = cls.FPropMeta(p, *_double_batch(shapes)).flops
    assert doubled == 2 * meta.flops, (
        f'{name}: flops {meta.flops} at batch B but {doubled} at 2B')


def check_layer(cls, p, shapes, input_maker=None, has_compute=True,
                linear_in_batch=True):
  """Raises AssertionError if layer `cls` breaks the contract on `shapes`."""
  name = cls.__name__
  shapes = base_layer.as_shape(tuple(shapes))
  layer = p.Copy().Instantiate()
  inputs = _make_inputs(shapes, input_maker, np.random.default_rng(0))

  eager = layer.FProp(layer.theta, *inputs)
  traced = tf.function(lambda theta, *xs: layer.FProp(theta, *xs))
  _assert_all_close(eager, traced(layer.theta, *inputs),
                    f'{name}: FProp differs eagerly and under tf.function')
  _check_meta(cls, p, shapes, eager, layer, has_compute, linear_in_batch)

  with fprop_context.scope(training=True, step=3, micro_batch_index=0,
                           num_micro_batches=1):
    first = layer.FProp(layer.theta, *inputs)
    second = layer.FProp(layer.theta, *inputs)
    # A fresh trace: the context is read when tracing, not when running.
    retraced = tf.function(lambda theta, *xs: layer.FProp(theta, *xs))
    again_traced = retraced(layer.theta, *inputs)
  _assert_all_close(first, second, f'{name}: FProp is not stateless in '
                    'training (same theta, inputs, step)', exact=True)
  _assert_all_close(first, again_traced, f'{name}: training FProp differs '
                    'under tf.function')

  parsed = cls.Params().FromText(p.ToText())
  assert parsed == p, (f'{name}: Params do not round-trip through text:\n'
                       f'{p.TextDiff(parsed)}')

  twin = p.Copy().Instantiate()
  _assert_all_close(layer.theta, twin.theta, f'{name}: two instantiations of '
                    'the same Params have different initial weights',
                    exact=True)


# ---- The suite --------------------------------------------------------------
_SAMPLES, _NO_COMPUTE, _NOT_LINEAR = load_samples()
_CASES = [
    pytest.param(cls, p, shapes, maker, id=f'{cls.__name__}-{i}')
    for cls in sorted(_SAMPLES, key=lambda c: c.__name__)
    for i, (p, shapes, maker) in enumerate(_SAMPLES[cls])
]


def test_every_layer_has_a_sample():
  missing = missing_samples(discover_layers(), _SAMPLES)
  assert not missing, (
      f'Layers without a conformance sample: {missing}. Add (params, '
      'input_shapes, input_maker) entries to SAMPLES in tests/layers/'
      'samples_basic.py or samples_seq.py.')


@pytest.mark.parametrize('cls, p, shapes, maker', _CASES)
def test_layer_conforms(cls, p, shapes, maker):
  check_layer(cls, p, shapes, maker, has_compute=cls not in _NO_COMPUTE,
              linear_in_batch=cls not in _NOT_LINEAR)


# ---- The checker rejects broken layers --------------------------------------
class _Scale(base_layer.BaseLayer):
  """A correct layer: x · s over the last dim."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 3, 'Depth of the input.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('s', base_layer.WeightParams([self.params.dim]))

  def FProp(self, theta, x):
    return x * theta.s

  @classmethod
  def FPropMeta(cls, p, x):
    return base_layer.LayerMeta.build(p, flops=x.num_elements(),
                                      out_shapes=(x,), num_params=p.dim)


class _WrongShape(_Scale):

  @classmethod
  def FPropMeta(cls, p, x):
    return base_layer.LayerMeta.build(p, flops=x.num_elements(),
                                      out_shapes=(x[:-1],), num_params=p.dim)


class _WrongParams(_Scale):

  @classmethod
  def FPropMeta(cls, p, x):
    return base_layer.LayerMeta.build(p, flops=x.num_elements(),
                                      out_shapes=(x,), num_params=1)


class _FlopsIgnoreBatch(_Scale):

  @classmethod
  def FPropMeta(cls, p, x):
    return base_layer.LayerMeta.build(p, flops=p.dim, out_shapes=(x,),
                                      num_params=p.dim)


class _Stateful(_Scale):
  """Draws fresh noise on every call: the recompute pass would differ."""

  def FProp(self, theta, x):
    return x * theta.s + tf.random.uniform(tf.shape(x))


class _NoMeta(base_layer.BaseLayer):

  def FProp(self, theta, x):
    return x


def test_checker_accepts_a_correct_layer():
  check_layer(_Scale, _Scale.Params(), ([2, 3],))


@pytest.mark.parametrize('cls, match', [
    (_WrongShape, 'out_shapes'),
    (_WrongParams, 'param_bytes'),
    (_FlopsIgnoreBatch, 'at batch B'),
    (_Stateful, 'FProp'),
])
def test_checker_rejects_broken_layers(cls, match):
  with pytest.raises(AssertionError, match=match):
    check_layer(cls, cls.Params(), ([2, 3],))


def test_checker_rejects_missing_fpropmeta():
  with pytest.raises(NotImplementedError, match='_NoMeta must implement'):
    check_layer(_NoMeta, _NoMeta.Params(), ([2, 3],))


def test_missing_samples_names_the_class():
  assert missing_samples([_Scale], {}) == [f'{__name__}._Scale']
  assert not missing_samples([_Scale], {_Scale: [(_Scale.Params(), (), None)]})
