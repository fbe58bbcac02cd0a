"""BaseLayer: params, eager variables, the child tree, seeds, stats, names.

The contract the pipeline relies on: a layer's initial weights are a pure
function of (random_seed, layer path, variable name), so a model gives the
same weights however it is later cut into stages.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.core.base_layer import LayerError
from lingvo_pipe.core.base_layer import WeightInit
from lingvo_pipe.core.base_layer import WeightParams
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.core.nested_map import NestedMap


class Dense(base_layer.BaseLayer):
  """y = x·w + b, with a count statistic."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Input and output depth.')
    return p

  def __init__(self, params):
    super().__init__(params)
    d = self.params.dim
    self.CreateVariable('w', WeightParams([d, d]))
    self.CreateVariable('b', WeightParams([d], WeightInit.Constant(0.0)))
    self.folded = []

  def FProp(self, theta, x):
    self.AddStats(NestedMap(count=tf.cast(tf.shape(x)[0], tf.float32)))
    return tf.matmul(x, theta.w) + theta.b

  @classmethod
  def FPropMeta(cls, p, x):
    return base_layer.LayerMeta.build(
        p, flops=2 * x.num_elements() * p.dim, out_shapes=(x,),
        num_params=p.dim * (p.dim + 1))

  def FoldStats(self, stats):
    self.folded.append(float(stats.count))
    return []


class Tree(base_layer.BaseLayer):
  """A variable, one child, a list of children (optionally on devices)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_stack', 2, 'Children in the list.')
    p.Define('devices', None, 'Device of each listed child.')
    p.Define('extra_sibling', False, 'Add one more child, first.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.extra_sibling:
      self.CreateChild('added', Dense.Params())
    self.CreateVariable('v', WeightParams([3]))
    self.CreateChild('fc', Dense.Params())
    self.CreateChildren('stack', [Dense.Params()] * p.num_stack,
                        devices=p.devices)


class WithHelper(base_layer.BaseLayer):
  """Builds a layer with Instantiate() (not CreateChild) in __init__."""

  def __init__(self, params):
    super().__init__(params)
    self.helper = Dense.Params().Set(name='helper').Instantiate()
    self.CreateVariable('w', WeightParams([4, 4]))


class Holder(base_layer.BaseLayer):

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('inner', WithHelper.Params())
    self.CreateChild('helper', Dense.Params())


def _values(layer: base_layer.BaseLayer) -> list[np.ndarray]:
  return [v.numpy() for v in tf.nest.flatten(layer.theta)]


# ---- Params and construction -----------------------------------------------
def test_params_keys_and_defaults():
  p = base_layer.BaseLayer.Params()
  assert [k for k, _ in p.IterParams()] == [
      'cls', 'name', 'dtype', 'fprop_dtype', 'random_seed', 'params_init']
  assert p.cls is base_layer.BaseLayer and p.dtype == tf.float32
  assert p.fprop_dtype is None and p.random_seed is None
  assert p.params_init.method == 'xavier' and p.params_init.scale == 1.0


def test_variables_are_created_eagerly_and_params_frozen():
  p = Dense.Params().Set(name='fc', dim=3)
  layer = p.Instantiate()
  # Before any FProp: every variable exists with its shape.
  assert sorted(layer.vars) == ['b', 'w']
  assert layer.vars.w.shape == (3, 3) and len(layer.trainable_variables) == 2
  assert layer.params.is_frozen and layer.params == p
  p.dim = 5  # The layer keeps its own copy.
  assert layer.params.dim == 3
  with pytest.raises(Exception, match='frozen'):
    layer.params.dim = 7
  assert layer.fprop_dtype == tf.float32
  x = tf.ones([2, 3])
  np.testing.assert_allclose(
      layer.FProp(layer.theta, x).numpy(),
      x.numpy() @ layer.vars.w.numpy(), rtol=1e-6)


def test_default_name_and_child_names():
  assert Dense.Params().Instantiate().path == 'dense'
  root = Tree.Params().Set(name='root').Instantiate()
  assert root.children.fc.params.name == 'fc'  # CreateChild's name.
  assert [c.params.name for c in root.children.stack] == ['stack_0',
                                                          'stack_1']


def test_theta_mirrors_the_child_tree():
  root = Tree.Params().Set(name='root', num_stack=3).Instantiate()
  theta = root.theta
  assert type(theta) is NestedMap
  assert sorted(theta) == ['fc', 'stack', 'v']
  assert sorted(theta.fc) == ['b', 'w'] and len(theta.stack) == 3
  assert theta.fc.w is root.children.fc.vars.w
  assert theta.stack[2].b is root.children.stack[2].vars.b
  assert [k for k, _ in theta.FlattenItems()] == [
      'fc.b', 'fc.w', 'stack[0].b', 'stack[0].w', 'stack[1].b',
      'stack[1].w', 'stack[2].b', 'stack[2].w', 'v']
  assert len(tf.nest.flatten(theta)) == len(root.variables)


def test_paths():
  root = Tree.Params().Set(name='model').Instantiate()
  assert [layer.path for layer in root.Walk()] == [
      'model', 'model.fc', 'model.stack[0]', 'model.stack[1]']
  # A pipeline keys its layers by name (unnamed: layer<i>), not position.
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='model', layers=[Dense.Params()] * 3 + [
          Dense.Params().Set(name='head')], num_stages=1).Instantiate()
  assert [layer.path for layer in pipe.children.layers] == [
      'model.layer0', 'model.layer1', 'model.layer2', 'model.head']


def test_create_children_places_variables_on_devices():
  devices = ['/device:CPU:1', '/device:CPU:2']
  root = Tree.Params().Set(devices=devices).Instantiate()
  for child, device in zip(root.children.stack, devices):
    for v in child.variables:
      assert v.device.endswith(device.replace('/device:', 'device:'))


# ---- Seeds -----------------------------------------------------------------
def test_initial_values_follow_the_documented_formula():
  # w = Xavier-uniform drawn with stable_seed(random_seed, path, name).
  layer = Dense.Params().Set(name='fc', random_seed=5).Instantiate()
  limit = math.sqrt(6.0 / (4 + 4))
  want = tf.random.stateless_uniform(
      [4, 4], base_layer.stable_seed(5, 'fc', 'w'), -limit, limit)
  np.testing.assert_array_equal(layer.vars.w.numpy(), want.numpy())


@pytest.mark.parametrize('seed', ['abc', 1.5, True])
def test_a_seed_that_is_no_int_is_named(seed):
  # Issue 29: int('abc') raised a bare ValueError; int(1.5) and int(True)
  # silently seeded with 1. Set in code (text is refused by FromText).
  with pytest.raises(LayerError, match=rf'fc: random_seed={seed!r}; give an '
                     'int'):
    Dense.Params().Set(name='fc', random_seed=seed).Instantiate()
  layer = Dense.Params().Set(name='fc', random_seed=np.int64(5)).Instantiate()
  assert layer.random_seed == 5


def test_same_params_give_the_same_weights_whatever_the_global_seed():
  p = Tree.Params().Set(name='root')
  tf.random.set_seed(1)
  a = _values(p.Instantiate())
  tf.random.set_seed(2)
  b = _values(p.Instantiate())
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def _w(root: base_layer.BaseLayer) -> np.ndarray:
  return root.children.stack[1].vars.w.numpy()


@pytest.mark.parametrize('change', [
    dict(random_seed=7),  # Another seed.
    dict(name='other'),  # Another path.
])
def test_other_seed_or_path_gives_other_weights(change):
  base = Tree.Params().Set(name='root')
  a, b = base.Instantiate(), base.Copy().Set(**change).Instantiate()
  assert not np.allclose(_w(a), _w(b))
  # Siblings of one layer differ from each other too.
  assert not np.allclose(_w(a), a.children.stack[0].vars.w.numpy())


def test_weights_do_not_change_when_siblings_are_added():
  a = Tree.Params().Set(name='root').Instantiate()
  b = Tree.Params().Set(name='root', extra_sibling=True,
                        num_stack=4).Instantiate()
  np.testing.assert_array_equal(_w(a), _w(b))
  np.testing.assert_array_equal(a.vars.v.numpy(), b.vars.v.numpy())
  np.testing.assert_array_equal(a.children.fc.vars.w.numpy(),
                                b.children.fc.vars.w.numpy())


def test_children_inherit_the_seed_unless_they_set_their_own():
  root = Tree.Params().Set(name='root', random_seed=11).Instantiate()
  assert {layer.random_seed for layer in root.Walk()} == {11}
  assert Tree.Params().Instantiate().random_seed == (
      base_layer.DEFAULT_RANDOM_SEED)
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=[Dense.Params(), Dense.Params().Set(random_seed=3)])
  net = p.Instantiate()
  assert [c.random_seed for c in net.children.layers] == [
      base_layer.DEFAULT_RANDOM_SEED, 3]


@pytest.mark.parametrize('num_stages', [2, 4])
def test_weights_do_not_depend_on_the_number_of_stages(num_stages):
  def net(k):
    return gpipe.PipeliningLayer.Params().Set(
        name='net', layers=[Dense.Params() for _ in range(4)], num_stages=k,
        input_shapes=[[8, 4]]).Instantiate()

  for x, y in zip(_values(net(1)), _values(net(num_stages))):
    np.testing.assert_array_equal(x, y)


def test_a_layer_built_inside_init_is_not_taken_for_the_child():
  # Regression: a layer built with Instantiate() inside a child's __init__
  # read the child's build context, got the child's path 'root.inner' and
  # so the seeds of the child's own variables.
  root = Holder.Params().Set(name='root').Instantiate()
  inner = root.children.inner
  assert inner.path == 'root.inner' and inner.helper.path == 'helper'
  assert inner.helper.vars.w.shape == inner.vars.w.shape
  assert not np.allclose(inner.helper.vars.w.numpy(), inner.vars.w.numpy())


# ---- Weight initialisers ---------------------------------------------------
class Holds(base_layer.BaseLayer):
  """One variable of a given shape and initialiser."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('shape', [1], 'Variable shape.')
    p.Define('init', None, 'WeightInit; None uses params_init.')
    p.Define('var_dtype', None, 'Variable dtype; None uses p.dtype.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', WeightParams(p.shape, p.init, p.var_dtype))


def _draw(shape, init) -> np.ndarray:
  return Holds.Params().Set(shape=shape, init=init).Instantiate().vars.w.numpy(
  ).astype(np.float64)


def test_xavier_is_uniform_within_the_glorot_limit():
  for scale in (1.0, 2.0):
    w = _draw([400, 600], WeightInit.Xavier(scale))
    limit = scale * math.sqrt(6.0 / (400 + 600))
    assert w.min() >= -limit and w.max() <= limit
    assert w.max() > 0.99 * limit and w.min() < -0.99 * limit
    # Var of U(−L, L) is L²/3; the estimator's relative std here is 0.2%.
    assert w.var() == pytest.approx(limit**2 / 3, rel=0.02)
  # Conv kernels: fans include the receptive field.
  w = _draw([3, 3, 32, 64], WeightInit.Xavier())
  limit = math.sqrt(6.0 / (9 * 32 + 9 * 64))
  assert w.max() <= limit and w.max() > 0.99 * limit


def test_he_is_normal_with_std_sqrt_2_over_fan_in():
  w = _draw([3, 3, 64, 128], WeightInit.He())
  std = math.sqrt(2.0 / (3 * 3 * 64))
  assert w.std() == pytest.approx(std, rel=0.02)
  assert abs(w.mean()) < 5 * std / math.sqrt(w.size)


def test_other_initialisers():
  g = _draw([500, 500], WeightInit.Gaussian(0.5))
  assert g.std() == pytest.approx(0.5, rel=0.02)
  u = _draw([500, 500], WeightInit.Uniform(2.0))
  assert u.min() >= -2 and u.max() <= 2
  assert u.var() == pytest.approx(4.0 / 3, rel=0.02)
  t = _draw([500, 500], WeightInit.TruncatedGaussian(1.0))
  assert np.abs(t).max() <= 2.0
  # Std of N(0, 1) truncated to ±2: 1 − 2·2·φ(2) / (Φ(2) − Φ(−2)).
  phi = math.exp(-2.0) / math.sqrt(2 * math.pi)
  var = 1 - 4 * phi / math.erf(2 / math.sqrt(2))
  assert t.var() == pytest.approx(var, rel=0.02)
  np.testing.assert_array_equal(_draw([2, 3], WeightInit.Constant(3.0)),
                                np.full([2, 3], 3.0))


def test_layer_params_init_and_dtypes():
  layer = Holds.Params().Set(
      shape=[2, 2], params_init=WeightInit.Constant(0.5),
      dtype=tf.bfloat16).Instantiate()
  assert layer.vars.w.dtype == tf.bfloat16
  np.testing.assert_array_equal(layer.vars.w.numpy().astype(np.float32),
                                np.full([2, 2], 0.5))
  v = Holds.Params().Set(var_dtype=tf.float64).Instantiate().vars.w
  assert v.dtype == tf.float64
  with pytest.raises(LayerError, match=r"\.w: unknown WeightInit method "
                     r"'bogus'; use one of"):
    Holds.Params().Set(init=WeightInit.Xavier().Set(
        method='bogus')).Instantiate()


# ---- Names -----------------------------------------------------------------
class Named(base_layer.BaseLayer):
  """Creates whatever `p.steps` lists: ('var'|'child'|'children', name)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('steps', [], '(kind, name) pairs.')
    p.Define('devices', None, 'Devices of a children step.')
    return p

  def __init__(self, params):
    super().__init__(params)
    for kind, name in self.params.steps:
      if kind == 'var':
        self.CreateVariable(name, WeightParams([1]))
      elif kind == 'child':
        self.CreateChild(name, Dense.Params())
      else:
        self.CreateChildren(name, [Dense.Params()] * 2,
                            devices=self.params.devices)


@pytest.mark.parametrize('steps, match', [
    ([('var', 'w'), ('var', 'w')], "'w' is already a variable or child"),
    ([('var', 'w'), ('child', 'w')], "'w' is already"),
    ([('children', 's'), ('var', 's')], "'s' is already"),
    # Regression: the checkpoint name of list child 0 ('s_0') clashed with
    # a later variable 's_0' inside TensorFlow's tracking, not as a
    # LayerError naming the layer.
    ([('children', 's'), ('var', 's_0')], "'s_0' is already"),
    ([('var', 's_1'), ('children', 's')], "'s_1' is already"),
    # Regression: names that theta (a NestedMap) refuses failed late, with
    # a message that did not name the layer.
    ([('var', 'values')], "'values' cannot name a variable or child"),
    ([('child', 'Flatten')], "'Flatten' cannot name"),
    ([('var', 'a.b')], "'a.b' cannot name"),
])
def test_bad_or_duplicate_names_raise_naming_the_layer(steps, match):
  with pytest.raises(LayerError, match=match) as e:
    Named.Params().Set(name='lay', steps=steps).Instantiate()
  assert str(e.value).startswith('lay: ')


def test_devices_must_match_the_children():
  with pytest.raises(LayerError, match=r"CreateChildren\('s'\) got 2 params "
                     r"but 1 devices"):
    Named.Params().Set(name='lay', steps=[('children', 's')],
                       devices=['/device:CPU:0']).Instantiate()


# ---- Contract defaults -----------------------------------------------------
def test_fprop_meta_and_fprop_defaults_raise_clearly():
  with pytest.raises(NotImplementedError,
                     match=r'Holds must implement FPropMeta\(p, '
                     r'\*input_shapes\)'):
    Holds.FPropMeta(Holds.Params(), tf.TensorShape([2, 2]))
  layer = Holds.Params().Instantiate()
  with pytest.raises(NotImplementedError, match='Holds must implement FProp'):
    layer(tf.zeros([1]))


# ---- Statistics ------------------------------------------------------------
def test_add_stats_collects_by_path_only_when_asked():
  root = Tree.Params().Set(name='root').Instantiate()
  fc = root.children.stack[1]
  fc.FProp(fc.theta, tf.zeros([3, 4]))  # No collector: nothing happens.
  collector = StatsCollector()
  with fprop_context.scope(training=True, stats=collector):
    fc.FProp(fc.theta, tf.zeros([3, 4]))
    fc.FProp(fc.theta, tf.zeros([5, 4]))
  assert list(collector.stats) == ['root.stack[1]']
  assert float(collector.stats['root.stack[1]'].count) == 8.0


def test_update_stats_routes_by_path():
  root = Tree.Params().Set(name='root').Instantiate()
  root.UpdateStats({'root.stack[1]': NestedMap(count=tf.constant(8.0)),
                    'root.fc': NestedMap(count=tf.constant(2.0))})
  assert root.children.stack[1].folded == [8.0]
  assert root.children.fc.folded == [2.0]
  assert root.children.stack[0].folded == []
  with pytest.raises(LayerError, match="'root.nope', which is not a layer "
                     "under 'root'"):
    root.UpdateStats({'root.nope': NestedMap(count=tf.constant(1.0))})
  with pytest.raises(NotImplementedError,
                     match='root collected statistics but Tree does not '
                     'fold them'):
    root.UpdateStats({'root': NestedMap(count=tf.constant(1.0))})


# ---- Checkpoints -----------------------------------------------------------
def test_checkpoint_names_are_readable_and_restore(tmp_path):
  root = Tree.Params().Set(name='root').Instantiate()
  path = tf.train.Checkpoint(model=root).save(str(tmp_path / 'ckpt'))
  names = {n for n, _ in tf.train.list_variables(path)}
  for want in ('model/v', 'model/fc/w', 'model/fc/b', 'model/stack_0/w',
               'model/stack_1/b'):
    assert f'{want}/.ATTRIBUTES/VARIABLE_VALUE' in names
  other = Tree.Params().Set(name='root', random_seed=99).Instantiate()
  assert not np.allclose(_w(other), _w(root))
  status = tf.train.Checkpoint(model=other).restore(path)
  status.assert_existing_objects_matched()
  for x, y in zip(_values(root), _values(other)):
    np.testing.assert_array_equal(x, y)
