"""Params and NestedMap methods that ported Lingvo configs and layers call.

Each test states the Lingvo behaviour it pins (from Lingvo's documented API),
so a ported params file or layer that uses it behaves as it did in Lingvo.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from lingvo_pipe.core import hyperparams
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.hyperparams import ParamsError
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import linear


def _tree() -> Params:
  inner = Params()
  inner.Define('dim', 8, 'Depth.')
  p = Params()
  p.Define('name', 'enc', 'Name.')
  p.Define('inner', inner, 'A nested Params.')
  p.Define('layers', [inner.Copy(), inner.Copy()], 'A list of Params.')
  return p


# ---- Params ------------------------------------------------------------------
def test_is_defined_follows_dotted_paths_and_indices():
  p = _tree()
  assert p.IsDefined('name') and p.IsDefined('inner.dim')
  assert p.IsDefined('layers[1].dim')
  assert not p.IsDefined('nam') and not p.IsDefined('inner.depth')
  assert not p.IsDefined('layers[2].dim') and not p.IsDefined('name.x')


def test_is_defined_does_not_define_keys_of_open_params():
  p = Params()
  p.Define('extra', None, 'Filled from text.')
  # Open Params, built the one way FromText builds Params under a None.
  p.FromText('extra : Params()\nextra.x : 1')
  assert p.extra.x == 1
  assert not p.extra.IsDefined('y')
  assert 'y' not in p.extra


def test_delete_removes_names_and_paths_and_returns_self():
  p = _tree()
  assert p.Delete('name', 'inner.dim') is p
  assert 'name' not in p and 'dim' not in p.inner
  assert 'name' not in p.ToText()


def test_delete_of_unknown_or_frozen_param_raises():
  p = _tree()
  with pytest.raises(ParamsError, match='inner.dimm'):
    p.Delete('inner.dimm')
  p.Freeze()
  with pytest.raises(ParamsError, match='frozen'):
    p.Delete('name')


def test_visit_keys_and_order_as_lingvo():
  Pair = collections.namedtuple('Pair', ['a', 'b'])

  @dataclasses.dataclass
  class Box:
    size: int

  p = _tree()
  p.Define('pair', Pair(1, 2), 'A namedtuple.')
  p.Define('box', Box(3), 'A dataclass.')
  seen = []
  p.Visit(lambda k, v: seen.append(('visit', k, v)),
          lambda k, v: seen.append(('enter', k)) or True,
          lambda k, v: seen.append(('exit', k)))
  assert seen == [
      ('enter', ''), ('visit', 'name', 'enc'),
      ('enter', 'inner'), ('visit', 'inner.dim', 8), ('exit', 'inner'),
      ('enter', 'layers'),
      ('enter', 'layers[0]'), ('visit', 'layers[0].dim', 8),
      ('exit', 'layers[0]'),
      ('enter', 'layers[1]'), ('visit', 'layers[1].dim', 8),
      ('exit', 'layers[1]'), ('exit', 'layers'),
      ('enter', 'pair'), ('visit', 'pair.a', 1), ('visit', 'pair.b', 2),
      ('exit', 'pair'),
      ('enter', 'box'), ('visit', 'box.size', 3), ('exit', 'box'),
      ('exit', ''),
  ]


def test_visit_declined_container_goes_to_visit_fn_without_exit():
  p = _tree()
  seen = []
  p.Visit(lambda k, v: seen.append(k), lambda k, v: k != 'layers',
          lambda k, v: seen.append(f'exit {k}'))
  assert seen == ['name', 'inner.dim', 'exit inner', 'layers', 'exit ']


def test_copy_fields_to_keeps_the_target_class_and_copies_params():
  src = linear.FCLayer.Params().Set(name='a', input_dim=3, output_dim=5)
  dst = linear.FCLayer.Params()
  dst.cls = type('MyFC', (linear.FCLayer,), {})
  out = hyperparams.CopyFieldsTo(src, dst, skip=['name'])
  assert out is dst and dst.cls.__name__ == 'MyFC'
  assert (dst.input_dim, dst.output_dim, dst.name) == (3, 5, '')
  assert dst.params_init == src.params_init
  assert dst.params_init is not src.params_init  # Nested Params are copies.
  assert src.CopyFieldsTo(linear.FCLayer.Params()).output_dim == 5


def test_copy_fields_to_a_target_without_the_field_names_it():
  src = _tree()
  dst = InstantiableParams()
  with pytest.raises(ParamsError, match=r"'name' is not defined.*skip"):
    hyperparams.CopyFieldsTo(src, dst)


# ---- NestedMap -----------------------------------------------------------------
def test_get_set_has_by_dotted_path():
  m = NestedMap()
  assert m.Set('a.b.c', 1) is m
  assert isinstance(m.a.b, NestedMap) and m.a.b.c == 1
  assert m.Get('a.b.c') == 1 and m.Get('a.x', 7) == 7 and m.Get('z') is None
  assert m.Has('a.b') and not m.Has('a.b.d')
  m.Set('a.b.c', 2)
  assert m.GetItem('a.b.c') == 2


def test_set_through_a_leaf_or_with_a_bad_key_raises():
  m = NestedMap(a=1)
  with pytest.raises(ValueError, match="'a' holds a int"):
    m.Set('a.b', 2)
  with pytest.raises(ValueError, match='identifiers'):
    m.Set('x.1y', 2)


def test_get_item_raises_key_error_naming_the_part():
  m = NestedMap(a=NestedMap(b=1), l=[NestedMap(c=2)])
  assert m.GetItem('l[0].c') == 2
  with pytest.raises(KeyError, match="no key 'x'"):
    m.GetItem('a.x')


def test_filter_drops_maps_emptied_by_it_but_keeps_empty_ones():
  m = NestedMap(a=1, b=NestedMap(c=2, d=3), e=NestedMap(f=2), g=NestedMap(),
                h=[1, 2, 3], i=[4])
  got = m.Filter(lambda v: v != 2 and v != 4)
  assert got == {'a': 1, 'b': {'d': 3}, 'g': {}, 'h': [1, 3]}
  assert isinstance(got.b, NestedMap)
  assert m.b.c == 2  # The original is unchanged.


def test_filter_key_val_sees_flatten_items_paths():
  m = NestedMap(a=NestedMap(w=1, b=2), layers=[NestedMap(w=3)])
  got = m.FilterKeyVal(lambda k, _: k.endswith('w'))
  assert got.FlattenItems() == [('a.w', 1), ('layers[0].w', 3)]
  assert m.FilterKeyVal(lambda k, v: False) == {}


def test_transform_flatten_pack_round_trip():
  m = NestedMap(b=NestedMap(y=2, x=1), a=[3, NestedMap(z=4)])
  assert m.Flatten() == [3, 4, 1, 2]  # Sorted keys, lists in order.
  assert m.FlattenItems() == [('a[0]', 3), ('a[1].z', 4), ('b.x', 1),
                              ('b.y', 2)]
  doubled = m.Transform(lambda v: 2 * v)
  assert isinstance(doubled, NestedMap) and doubled.b.x == 2
  packed = m.Pack([10, 20, 30, 40])
  assert packed.a[1].z == 20 and packed.b.y == 40
  assert isinstance(packed.a[1], NestedMap)


def test_union_merges_nested_maps_and_the_other_wins():
  a = NestedMap(x=1, n=NestedMap(p=1, q=2), l=[1])
  b = NestedMap(y=2, n=NestedMap(q=3, r=4), l=[5, 6])
  u = a.Union(b)
  assert u == {'x': 1, 'y': 2, 'n': {'p': 1, 'q': 3, 'r': 4}, 'l': [5, 6]}
  assert isinstance(u.n, NestedMap)
  assert a.n == {'p': 1, 'q': 2}  # Neither input changes.


def test_copy_fields_to_accepts_one_name_to_skip():
  src = linear.FCLayer.Params().Set(name='a', input_dim=3)
  dst = hyperparams.CopyFieldsTo(src, linear.FCLayer.Params(), skip='name')
  assert (dst.name, dst.input_dim) == ('', 3)


def test_set_with_list_indices_as_lingvo():
  m = NestedMap()
  m.Set('a[0].b', 1)  # Creates the list and a NestedMap in it.
  m.Set('a[1]', 2)    # Index == length appends.
  m.Set('a[0].c', 3)
  assert m == {'a': [{'b': 1, 'c': 3}, 2]}
  assert isinstance(m.a[0], NestedMap)
  with pytest.raises(ValueError, match=r'a\[5\] is past the end'):
    m.Set('a[5]', 0)


def test_transform_with_key_is_compatible_and_from_nested_dict():
  m = NestedMap.FromNestedDict({'b': {'x': 1}, 'a': [{'y': 2}, 3]})
  assert isinstance(m, NestedMap) and isinstance(m.a[0], NestedMap)
  keyed = m.TransformWithKey(lambda k, v: f'{k}={v}')
  assert keyed.Flatten() == ['a[0].y=2', 'a[1]=3', 'b.x=1']
  assert m.IsCompatible(keyed)
  assert not m.IsCompatible(NestedMap(b=NestedMap(x=1)))
