"""Params: definition, dotted paths, copy/freeze, text round trips, errors.

The text format is what the trainer stores in the logdir and what users type
in --model_params_override, so every value type used in the repo must come
back from `FromText(ToText())` with the same type and value, into a fresh
default tree, and every mistake must name the full path and a fix.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
from typing import Any

import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import gpipe
from lingvo_pipe.core import model_registry
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.core.hyperparams import ParamsError
import lingvo_pipe.layers


class Outer:
  """Holds a nested class, written as type/<module>.Outer.Inner."""

  class Inner:
    pass


class _Built:
  """A class that InstantiableParams can build (and text can name)."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = InstantiableParams(cls)
    p.Define('output_dim', 0, 'Depth.')
    p.Define('shape', [0, 2], 'A nested list.')
    return p

  def __init__(self, params: Params, extra: int = 0) -> None:
    self.params = params
    self.extra = extra


def _tree() -> Params:
  """a.b.dim, built bottom-up (inner trees exist before they are adopted)."""
  b = Params()
  b.Define('dim', 1, 'Depth.')
  a = Params()
  a.Define('b', b, 'Inner.')
  p = Params()
  p.Define('a', a, 'Outer.')
  p.Define('lr', 0.1, 'Learning rate.')
  p.Define('layers', [], 'Layer Params.')
  p.Define('optional', None, 'Params-valued key whose default is None.')
  return p


def _leaf(dim: int) -> Params:
  return _Built.Params().Set(output_dim=dim, shape=[dim, 2])


def _assert_same_tree(a: Any, b: Any, path: str = 'p') -> None:
  """Same keys, same leaf types, same leaf values (nan equals nan)."""
  if isinstance(a, Params):
    assert isinstance(b, Params), path
    assert list(dict(a.IterParams())) == list(dict(b.IterParams())), path
    for key, value in a.IterParams():
      _assert_same_tree(value, getattr(b, key), f'{path}.{key}')
    return
  assert type(a) is type(b), (path, a, b)
  if isinstance(a, (list, tuple)):
    assert len(a) == len(b), path
    for i, (x, y) in enumerate(zip(a, b)):
      _assert_same_tree(x, y, f'{path}[{i}]')
  elif isinstance(a, dict):
    assert list(a) == list(b), path
    for key in a:
      _assert_same_tree(a[key], b[key], f'{path}[{key!r}]')
  elif isinstance(a, float) and math.isnan(a):
    assert math.isnan(b), path
  else:
    assert a == b, (path, a, b)


# ---- Define, get, set ------------------------------------------------------
def test_define_get_set_and_doc():
  p = Params()
  p.Define('learning_rate', 0.1, 'Peak learning rate.')
  assert p.learning_rate == 0.1 and 'learning_rate' in p
  p.learning_rate = 0.2
  assert p.Set(learning_rate=0.3) is p and p.learning_rate == 0.3
  assert p.GetDoc('learning_rate') == 'Peak learning rate.'
  assert list(p.IterParams()) == [('learning_rate', 0.3)]
  assert not hasattr(p, 'no_such_key')  # ParamsError is an AttributeError.


@pytest.mark.parametrize('name, doc, match', [
    ('lr', 'Again.', 'already defined'),
    ('new', '', 'needs a doc string'),
    ('_private', 'Doc.', 'identifier'),
    ('a.b', 'Doc.', 'identifier'),
    ('layers[0]', 'Doc.', 'identifier'),
    # p.Copy would still read the method, so the key could never be read.
    ('Copy', 'Doc.', 'shadows'),
    ('is_frozen', 'Doc.', 'shadows'),
])
def test_define_rejects(name, doc, match):
  p = _tree()
  with pytest.raises(ParamsError, match=match):
    p.Define(name, 1, doc)


def test_set_dotted_paths_and_list_indices():
  p = _tree()
  p.layers = [_leaf(1), _leaf(2), _leaf(3)]
  p.Set(**{'a.b.dim': 5, 'layers[2].output_dim': 7, 'lr': 0.5})
  assert (p.a.b.dim, p.layers[2].output_dim, p.lr) == (5, 7, 0.5)
  assert p.Get('layers[2].output_dim') == 7 and p.Get('a.b.dim') == 5
  p.Set(**{'layers[0]': _leaf(9)})
  assert p.layers[0].output_dim == 9
  q = Params()
  q.Define('shape', (1, 2, 3), 'A tuple.')
  q.Set(**{'shape[1]': 5})
  assert q.shape == (1, 5, 3)


@pytest.mark.parametrize('path, match', [
    ('layers[5].output_dim', r'Index \[5\] out of range .* length 3'),
    ('lr.x', "'lr' .* is a float, not Params"),
    ('a..b', 'Malformed param path'),
])
def test_bad_paths(path, match):
  p = _tree()
  p.layers = [_leaf(1), _leaf(2), _leaf(3)]
  with pytest.raises(ParamsError, match=match):
    p.Set(**{path: 1})


@pytest.mark.parametrize('how', [
    lambda p: p.Set(**{'a.b.dimm': 1}),
    lambda p: setattr(p.a.b, 'dimm', 1),  # p.a.b.dimm = 1
    lambda p: p.FromText('a.b.dimm : 1'),
], ids=['Set', 'attribute', 'FromText'])
def test_unknown_key_names_full_path_and_suggests(how):
  # Regression: nested paths were recorded one level deep, so setting
  # p.a.b.dimm on a tree built bottom-up said 'b.dimm'.
  with pytest.raises(ParamsError) as e:
    how(_tree())
  assert "'a.b.dimm'" in str(e.value)
  assert "Did you mean 'dim'?" in str(e.value)


def test_unknown_key_in_a_list_element_names_the_index():
  p = _tree()
  p.layers = [_leaf(1), _leaf(2)]
  with pytest.raises(ParamsError, match=r"'layers\[1\]\.output_dimm'.*"
                     r"Did you mean 'output_dim'"):
    p.layers[1].output_dimm = 3


# ---- Copy, freeze, equality ------------------------------------------------
def test_copy_is_deep_and_independent():
  p = _tree()
  p.layers = [_leaf(1)]
  q = p.Copy()
  q.a.b.dim = 10
  q.layers[0].shape.append(99)
  q.layers[0].output_dim = 8
  q.layers.append(_leaf(2))
  assert p.a.b.dim == 1 and p.layers[0].shape == [1, 2]
  assert p.layers[0].output_dim == 1 and len(p.layers) == 1
  assert q.layers[0].cls is _Built  # Classes are shared, not copied.


def test_copy_of_frozen_is_unfrozen_all_the_way_down():
  p = _tree()
  p.layers = [_leaf(1)]
  q = p.Freeze().Copy()
  assert p.is_frozen and p.a.b.is_frozen and p.layers[0].is_frozen
  assert not (q.is_frozen or q.a.b.is_frozen or q.layers[0].is_frozen)
  q.layers[0].output_dim = 3  # Does not raise.


@pytest.mark.parametrize('how, path', [
    (lambda p: setattr(p, 'lr', 1.0), 'lr'),
    (lambda p: setattr(p.a.b, 'dim', 2), 'a.b.dim'),
    (lambda p: setattr(p.layers[0], 'output_dim', 2), 'layers[0].output_dim'),
    (lambda p: p.Set(**{'a.b.dim': 2}), 'a.b.dim'),
    (lambda p: p.Set(**{'layers[0]': _leaf(3)}), 'layers'),
    (lambda p: p.FromText('layers[0].output_dim : 2'),
     'layers[0].output_dim'),
    (lambda p: p.Define('extra', 1, 'Doc.'), 'extra'),
])
def test_frozen_params_refuse_changes_naming_the_path(how, path):
  p = _tree()
  p.layers = [_leaf(1)]
  p.Freeze()
  with pytest.raises(ParamsError) as e:
    how(p)
  assert f'Cannot set {path!r}' in str(e.value)
  assert 'frozen' in str(e.value) and 'Copy()' in str(e.value)


def test_equality():
  p = _tree()
  assert p == p.Copy() and p == _tree()
  q = p.Copy()
  q.lr = 0.2
  assert p != q
  r = p.Copy()
  r.Set(**{'a.b.dim': 1.0})  # A float is not the int it replaces.
  assert p != r
  s, t = p.Copy(), p.Copy()
  s.lr = t.lr = float('nan')
  assert s == t
  assert p != 'lr : 0.1' and p != 0.1


# ---- Text ------------------------------------------------------------------
_VALUES = {
    'int': 3, 'negative_int': -7, 'big_int': 10**20,
    'float': 2.0, 'tiny_float': 1e-7, 'negative_zero': -0.0,
    'inf': float('inf'), 'minus_inf': float('-inf'), 'nan': float('nan'),
    'true': True, 'false': False, 'none': None,
    'string': 'adam', 'empty_string': '',
    'string_with_colon_semicolon': 'a: b; c',
    'string_with_quotes': 'it\'s "quoted"',
    'string_with_newline': 'line 1\nline 2',
    'string_with_backslash': 'C:\\dir\\;x',
    'list': [1, 2], 'nested_list': [[8, 2], [3, [4, ()]]], 'empty_list': [],
    'tuple': (1, 2), 'one_tuple': (1,), 'empty_tuple': (),
    'nested_tuple': ((1,), (2, 3)), 'string_list': ['a,b', 'c]'],
    'float32': tf.float32, 'bfloat16': tf.bfloat16, 'int32': tf.int32,
    'dtype_list': [tf.float32, tf.int32], 'dtype_one_tuple': (tf.bfloat16,),
    'class': gpipe.PipeliningLayer, 'nested_class': Outer.Inner,
    'builtin_class': int,
    'class_list': [Outer.Inner, base_layer.BaseLayer],
    'mixed_list': [tf.float32, 'x, y', 1.5, None, float('inf')],
    'inf_list': [-1.5, float('inf'), float('nan')],
    'dict': {'a': 1, 'b': [1, 2]}, 'nested_dict': {'a': {'b': (1,)}},
    'dtype_dict': {'k': tf.float32, 'v': Outer.Inner},
}


def _round_trip(value: Any, default: Any) -> Any:
  src = Params()
  src.Define('x', value, 'The value.')
  dst = Params()
  dst.Define('x', default, 'The value.')
  dst.FromText(src.ToText())
  return dst.x


@pytest.mark.parametrize('name', sorted(_VALUES))
def test_value_round_trips_into_a_none_default(name):
  # Regression: dicts of dtypes and lists holding inf or nan came back as
  # strings (or failed to parse).
  _assert_same_tree(_VALUES[name], _round_trip(_VALUES[name], None))


@pytest.mark.parametrize('name', sorted(_VALUES))
def test_value_round_trips_into_a_default_of_its_type(name):
  # (None into a typed default is refused: see test_params_text.py.)
  _assert_same_tree(_VALUES[name], _round_trip(_VALUES[name], _VALUES[name]))


def test_to_text_is_one_line_per_leaf():
  p = _tree()
  p.layers = [_leaf(4)]
  assert p.ToText().splitlines() == [
      'a.b.dim : 1',
      'lr : 0.1',
      'layers : list(len=1)',
      f'layers[0].cls : type/{__name__}._Built',
      'layers[0].output_dim : 4',
      'layers[0].shape : [4, 2]',
      'optional : None',
  ]


def test_to_text_rejects_what_it_cannot_parse_back():
  p = _tree()
  p.lr = lambda step: 0.1
  with pytest.raises(ParamsError, match="'lr' holds a function"):
    p.ToText()


@pytest.mark.parametrize('num_layers', [0, 1, 3])
def test_list_of_params_grows_and_shrinks_from_text(num_layers):
  src = _tree()
  src.layers = [_leaf(i + 1) for i in range(num_layers)]
  src.layers[-1:] = [_leaf(7).Set(output_dim=70)] if num_layers else []
  for start in ([], [_leaf(5), _leaf(6)]):
    dst = _tree()
    dst.layers = start
    dst.FromText(src.ToText())
    _assert_same_tree(src, dst)
    assert dst == src and not src.TextDiff(dst)


def test_tuple_of_params_round_trips():
  src = _tree()
  src.layers = (_leaf(1), _leaf(2))
  dst = _tree().FromText(src.ToText())
  assert isinstance(dst.layers, tuple) and dst == src


def test_params_valued_key_with_none_default_round_trips():
  src = _tree()
  src.optional = _leaf(3)
  dst = _tree().FromText(src.ToText())
  assert isinstance(dst.optional, InstantiableParams)
  _assert_same_tree(src, dst)
  assert dst.optional.Instantiate().params.output_dim == 3
  # And back to None.
  assert _tree().Set(optional=_leaf(1)).FromText(_tree().ToText()) == _tree()


def test_bare_params_under_a_none_default_are_built_from_text():
  src = _tree()
  inner = Params()
  inner.Define('depth', 4, 'Depth.')
  src.optional = inner
  dst = _tree().FromText(src.ToText())
  assert dst.optional.depth == 4 and dst == src


def test_changing_cls_rebuilds_from_the_new_class_params():
  p = gpipe.PipeliningLayer.Params()
  p.layers = [base_layer.BaseLayer.Params()]
  p.FromText('layers[0].cls : type/lingvo_pipe.core.gpipe.PipeliningLayer\n'
             'layers[0].num_stages : 3')
  assert p.layers[0].cls is gpipe.PipeliningLayer
  assert p.layers[0].num_stages == 3


def test_trainer_override_syntax():
  p = model_registry.get_params('synthetic.regression.MlpRegression', 'Train')
  p.FromText('task.train.learning_rate: 0.1; task.pipeline.num_micro_batches: 8'
             ';task.train.optimizer: sgd')
  assert p.task.train.learning_rate == 0.1
  assert p.task.pipeline.num_micro_batches == 8
  assert p.task.train.optimizer == 'sgd'  # Unquoted string.


@pytest.mark.parametrize('text, want', [
    # ';' separates lines only outside quoted strings.
    ("name : 'a;b'; lr : 0.2", ('a;b', 0.2)),
    ('name : "x\\";y" ;lr:0.3', ('x";y', 0.3)),
    # An apostrophe inside an unquoted string does not open a quote.
    ("name: it's; lr: 0.4", ("it's", 0.4)),
    # Unquoted strings keep their colons; only the first ':' separates.
    ('name : /job:worker/task:1', ('/job:worker/task:1', 0.1)),
    # A comment runs to the newline, ';' included.
    ('# comment; lr : 9\nname : n\n\n  lr : 0.5  ', ('n', 0.5)),
    ('name : 123', ('123', 0.1)),  # A string param keeps the text.
    ('name :', ('', 0.1)),
])
def test_from_text_lines_and_unquoted_strings(text, want):
  p = Params()
  p.Define('name', 'x', 'A string.')
  p.Define('lr', 0.1, 'A float.')
  p.FromText(text)
  assert (p.name, p.lr) == want


@pytest.mark.parametrize('text, want', [
    ('adam', 'adam'), ('', ''), ('/job:w/task:1', '/job:w/task:1')])
def test_unquoted_string_for_a_none_default(text, want):
  assert _tree().FromText(f'optional : {text}').optional == want


@pytest.mark.parametrize('key, text, expected_type', [
    ('dim', 'hello', 'int'),
    ('dim', '1.5', 'int'),
    ('flag', '1', 'bool'),
    ('flag', 'yes', 'bool'),  # Lingvo's true/false are bools, 'yes' is not.
    ('dtype', 'float33', 'DType'),
    ('dtype', 'tf.float33', 'DType'),
    ('shape', '5', 'list'),
    ('cls', 'type/lingvo_pipe.core.gpipe.NoSuchLayer', 'type'),
    ('mapping', '[1]', 'dict'),
])
def test_wrong_type_from_text_names_key_text_and_type(key, text, expected_type):
  p = Params()
  p.Define('dim', 1, 'An int.')
  p.Define('flag', True, 'A bool.')
  p.Define('dtype', tf.float32, 'A dtype.')
  p.Define('shape', [1], 'A list.')
  p.Define('cls', int, 'A class.')
  p.Define('mapping', {}, 'A dict.')
  with pytest.raises(ParamsError) as e:
    p.FromText(f'{key} : {text}')
  msg = str(e.value)
  assert key in msg and repr(text) in msg and expected_type in msg


def test_bracketed_garbage_is_not_taken_for_a_string():
  # Regression: text that failed to parse became a string under a None
  # default, e.g. '[-1.5, inf]' (then unparseable) silently.
  with pytest.raises(ParamsError, match=r"optional : '\[/GPU:0\]'"):
    _tree().FromText('optional : [/GPU:0]')


def test_malformed_line_names_it():
  with pytest.raises(ParamsError, match="Malformed params line 'lr 0.1'"):
    _tree().FromText('lr 0.1')


def test_text_diff():
  p = _tree()
  p.layers = [_leaf(1), _leaf(2)]
  q = p.Copy()
  q.lr = 0.2
  q.layers = q.layers[:1]
  assert not p.TextDiff(p.Copy())
  diff = p.TextDiff(q).splitlines()
  assert '- lr : 0.1' in diff and '+ lr : 0.2' in diff
  assert '- layers : list(len=2)' in diff and '+ layers : list(len=1)' in diff
  assert '- layers[1].output_dim : 2' in diff
  assert not any(line.startswith('+ layers[1]') for line in diff)


def test_instantiable_params():
  p = InstantiableParams(_Built)
  obj = p.Instantiate(extra=3)
  assert isinstance(obj, _Built) and obj.params is p and obj.extra == 3
  with pytest.raises(ParamsError, match='`cls` is None'):
    InstantiableParams().Instantiate()


# ---- Round trip of every config in the repo --------------------------------
def _layer_classes() -> list[type]:
  classes = {}
  for info in pkgutil.iter_modules(lingvo_pipe.layers.__path__):
    module = importlib.import_module(f'lingvo_pipe.layers.{info.name}')
    for name, obj in inspect.getmembers(module, inspect.isclass):
      if (issubclass(obj, base_layer.BaseLayer) and not name.startswith('_')
          and obj.__module__ == module.__name__):
        classes[f'{module.__name__}.{name}'] = obj
  return [classes[k] for k in sorted(classes)]


def _perturb(p: Params) -> Params:
  """Changes every int/float/bool/str leaf, so defaults cannot hide a bug."""
  for key, value in p.IterParams():
    if isinstance(value, Params):
      _perturb(value)
    elif isinstance(value, bool):
      setattr(p, key, not value)
    elif isinstance(value, int):
      setattr(p, key, value + 3)
    elif isinstance(value, float):
      setattr(p, key, value * 0.5 + 0.25)
    elif isinstance(value, str) and key != 'cls':
      setattr(p, key, value + "_x;'")
  return p


def test_every_layer_params_round_trips_into_a_fresh_default():
  classes = _layer_classes()
  assert len(classes) >= 10  # The layer library is found at all.
  for cls in classes:
    p = _perturb(cls.Params())
    _assert_same_tree(p, cls.Params().FromText(p.ToText()), cls.__name__)


def test_pipeline_of_every_layer_round_trips_into_a_fresh_default():
  p = gpipe.PipeliningLayer.Params().Set(
      layers=[_perturb(c.Params()) for c in _layer_classes()],
      input_shapes=[[8, 4]], devices=['/device:CPU:0', '/device:CPU:1'])
  fresh = gpipe.PipeliningLayer.Params()
  _assert_same_tree(p, fresh.FromText(p.ToText()))
  longer = gpipe.PipeliningLayer.Params().Set(
      layers=[base_layer.BaseLayer.Params()] * (len(p.layers) + 2))
  _assert_same_tree(p, longer.FromText(p.ToText()))


@pytest.mark.parametrize('dataset', model_registry.DATASETS)
def test_every_registered_model_round_trips(dataset):
  names = model_registry.list_models()
  assert names
  for name in names:
    p = model_registry.get_params(name, dataset)
    # Into the classes' own defaults ...
    _assert_same_tree(p.task, p.task.cls.Params().FromText(p.task.ToText()))
    _assert_same_tree(p.input, p.input.cls.Params().FromText(p.input.ToText()))
    # ... and into a skeleton that knows nothing about the model.
    skeleton = Params()
    skeleton.Define('model', '', 'Name.')
    skeleton.Define('task', None, 'Task.')
    skeleton.Define('input', None, 'Input.')
    _assert_same_tree(p, skeleton.FromText(p.ToText()), name)
