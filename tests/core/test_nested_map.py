"""NestedMap: attribute access, key checks, and tf.nest compatibility.

Thetas, batches and activations are NestedMaps that cross tf.function and
pipeline-stage boundaries through `tf.nest`, so flatten → pack must give
back a NestedMap (not a dict) with the same paths.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core.nested_map import NestedMap


def _theta() -> NestedMap:
  return NestedMap(
      w=np.ones([2]),
      fc=NestedMap(w=np.zeros([2, 3]), b=np.arange(3)),
      layers=[NestedMap(b=1.0), NestedMap(b=2.0, g=(3.0, 4.0))],
      none=None)


def test_attribute_access_mirrors_items():
  m = NestedMap(a=1)
  m.b = NestedMap(c=2)
  assert m.a == 1 and m['b'].c == 2 and m.b is m['b']
  del m.a
  assert 'a' not in m
  with pytest.raises(AttributeError):
    del m.a


def test_missing_attribute_suggests_close_keys():
  m = NestedMap(learning_rate=1, momentum=2)
  with pytest.raises(AttributeError) as e:
    m.learning_rat  # pylint: disable=pointless-statement
  assert "'learning_rat'" in str(e.value)
  assert 'Did you mean learning_rate' in str(e.value)
  assert not hasattr(m, 'zzz')


@pytest.mark.parametrize('key', [
    'keys', 'items', 'values', 'get', 'pop', 'update', 'copy',
    # Regression: NestedMap's own methods were accepted as keys, and then
    # m.Flatten read the method while m['Flatten'] held the value.
    'Flatten', 'FlattenItems', 'Pack', 'Transform', 'GetItem', 'DeepCopy',
])
def test_reserved_keys_are_rejected(key):
  with pytest.raises(ValueError, match='shadows'):
    NestedMap(**{key: 1})
  m = NestedMap()
  with pytest.raises(ValueError, match='shadows'):
    m[key] = 1
  with pytest.raises(ValueError, match='shadows'):
    setattr(m, key, 1)


@pytest.mark.parametrize('key', ['1a', 'a.b', 'a b', 3, ''])
def test_non_identifier_keys_are_rejected(key):
  with pytest.raises(ValueError, match='identifiers'):
    NestedMap({key: 1})


def test_tf_nest_flatten_pack_round_trip_keeps_the_type():
  m = _theta()
  leaves = tf.nest.flatten(m)
  packed = tf.nest.pack_sequence_as(m, leaves)
  assert type(packed) is NestedMap and type(packed.fc) is NestedMap
  assert type(packed.layers[1]) is NestedMap
  tf.nest.assert_same_structure(m, packed)
  assert [id(x) for x in tf.nest.flatten(packed)] == [id(x) for x in leaves]
  assert [id(x) for x in m.Flatten()] == [id(x) for x in leaves]
  assert type(m.Pack(leaves)) is NestedMap


def test_flatten_items_paths_follow_tf_nest_order():
  m = _theta()
  items = m.FlattenItems()
  assert [k for k, _ in items] == [
      'fc.b', 'fc.w', 'layers[0].b', 'layers[1].b', 'layers[1].g[0]',
      'layers[1].g[1]', 'none', 'w']
  assert all(v is leaf for (_, v), leaf in zip(items, tf.nest.flatten(m)))


def test_get_item_reads_every_flatten_items_path():
  # Regression: GetItem did not understand the '[i]' that FlattenItems
  # writes for lists.
  m = _theta()
  for path, leaf in m.FlattenItems():
    assert m.GetItem(path) is leaf
  assert m.GetItem('fc') is m.fc
  assert m.GetItem('layers[1]') is m.layers[1]


@pytest.mark.parametrize('path, match', [
    ('fc.ww', r"no key 'ww'.*Did you mean w"),
    ('layers[5].b', r'\[5\] is not an index of this list \(length 2'),
    ('fc[0]', r'\[0\] is not an index of this NestedMap'),
    ('w.x', r"no key 'x'"),
])
def test_get_item_errors_name_the_missing_part(path, match):
  with pytest.raises(KeyError, match=match):
    _theta().GetItem(path)


def test_deep_copy_copies_containers_and_shares_leaves():
  m = _theta()
  c = m.DeepCopy()
  assert type(c) is NestedMap and type(c.layers[0]) is NestedMap
  c.fc.w = 'changed'
  c.layers.append(NestedMap())
  c.layers[0].b = 9.0
  assert isinstance(m.fc.w, np.ndarray) and len(m.layers) == 2
  assert m.layers[0].b == 1.0
  assert c.w is m.w  # Leaves are shared.


def test_transform_applies_to_every_leaf():
  m = NestedMap(a=1, b=NestedMap(c=[2, 3]))
  doubled = m.Transform(lambda x: x * 2)
  assert doubled == NestedMap(a=2, b=NestedMap(c=[4, 6]))
  assert type(doubled.b) is NestedMap and m.a == 1


def test_copy_pickle_and_deepcopy_keep_the_type():
  m = _theta()
  shallow = m.copy()
  assert type(shallow) is NestedMap and shallow.fc is m.fc
  for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
    assert type(other) is NestedMap and type(other.layers[1]) is NestedMap
    np.testing.assert_array_equal(other.fc.w, m.fc.w)


def test_crosses_tf_function():
  @tf.function
  def double(m):
    return m.Transform(lambda x: 2 * x)

  out = double(NestedMap(a=tf.constant(1.0), b=NestedMap(c=tf.constant(2.0))))
  assert type(out) is NestedMap and float(out.b.c) == 4.0
