"""FromText under hostile input, the type rule, `type/` safety, and the
spellings Lingvo writes.

Guards issue 11: of 4,200 fuzzed params texts, 42 raised MemoryError,
RecursionError, OverflowError or IndexError, 8 hung (`x : list(len=99999999)`),
75 broke the type rule, and `type/<module.Class>` imported any module a
logdir's params.txt named, so the text could run code in the evaler.
"""

from __future__ import annotations

import collections
import random
import sys
import time

import pytest
import tensorflow as tf

from lingvo_pipe.core import gpipe
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import params_literal
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.core.hyperparams import ParamsError


def _params(**defaults) -> Params:
  p = Params()
  for key, value in defaults.items():
    p.Define(key, value, f'The {key}.')
  return p


# ---- Fuzzing ----------------------------------------------------------------
_NASTY_VALUES = [
    'None', 'NoneType', 'true', 'false', "'x'", '"a;b"', '1e999', '-inf',
    'nan', '9' * 5000, '1' + '0' * 400, '-' * 20000 + '1', '[' * 5000,
    '[' * 40 + ']' * 40, '(' * 300 + ')' * 300, 'list(len=99999999)',
    'list(len=3)', 'tuple(len=2)', 'list(len=' + '9' * 5000 + ')',
    '[1] * 99999999', "'x' * 99999999", '2 ** 99999', '{1: 2}', '{[1]: 2}',
    '{**a}', '{1, 2}', 'b"x"', '1j', '...', 'lambda: 0', '__import__("os")',
    'type/os.path.join', 'type/collections.OrderedDict',
    'type/no_such_module_xyz.Thing', 'type/lingvo_pipe.no_such.Thing',
    'type/lingvo_pipe.core.gpipe/PipeliningLayer', 'type/a/b/c', 'type/',
    'tf.float32', 'tf.float33', 'tf.nn.relu', 'float32', 'bool', '\x00',
    '\udcff', "'unterminated", '[1, 2', 'a : b : c', ';;;', '#', '{}', '()',
]


def _mutate_line(line: str, rng: random.Random, lines: list[str]) -> str:
  path, _, value = line.partition(' : ')
  kind = rng.randrange(10)
  if kind == 8:  # Another key's value: often a valid value of another type.
    return f'{path} : {rng.choice(lines).partition(" : ")[2]}'
  if kind == 9:
    return f'{path} : {rng.choice(["None", "NoneType", "true", "0", "1.5"])}'
  if kind == 0:
    return f'{path} : {rng.choice(_NASTY_VALUES)}'
  if kind == 1:
    index = rng.choice(['[0]', '[7]', '[' + '9' * 5000 + ']', '[-1]', '[]'])
    return f'{path}{index} : {value}'
  if kind == 2:
    return f'{path}.{rng.choice(["foo", "cls", "name", "0"])} : {value}'
  if kind == 3:
    return f'{path}.cls : {rng.choice(_NASTY_VALUES)}'
  chars = list(line)
  for _ in range(rng.randint(1, 4)):
    pos = rng.randrange(len(chars) + 1)
    if kind == 4 and chars:
      del chars[min(pos, len(chars) - 1)]
    else:
      chars.insert(pos, rng.choice('[]():;.,\'"#\\ 0123456789-e\n\x00é'))
  return ''.join(chars)


def _fuzz_cases(count: int, seed: int = 11):
  """(model params, text) pairs: 1-3 mutated lines of a real params text."""
  rng = random.Random(seed)
  models = []
  for name in model_registry.list_models():
    for dataset in ('Train', 'Test'):
      p = model_registry.get_params(name, dataset)
      models.append((p, p.ToText().splitlines()))
  for _ in range(count):
    params, lines = rng.choice(models)
    picked = [_mutate_line(rng.choice(lines), rng, lines)
              for _ in range(rng.randint(1, 3))]
    yield params, rng.choice(['\n', '; ']).join(picked)


def test_fuzzed_texts_raise_only_params_error_and_import_nothing():
  cases = list(_fuzz_cases(5000))  # Imports every registered model first.
  modules_before = set(sys.modules)
  errors, accepted, slowest = collections.Counter(), 0, (0.0, '')
  for params, text in cases:
    target = params.Copy()
    start = time.thread_time()  # CPU time: robust to a busy machine.
    try:
      target.FromText(text)
      accepted += 1
      again = params.Copy().FromText(target.ToText())  # Still round-trips.
      assert again.ToText() == target.ToText(), text
    except ParamsError:
      errors['ParamsError'] += 1
    except Exception as e:  # pylint: disable=broad-except
      errors[f'{type(e).__name__}: {text[:200]!r}'] += 1
    spent = time.thread_time() - start
    slowest = max(slowest, (spent, text[:100]))
  print(f'accepted {accepted}, errors {dict(errors)}; slowest '
        f'{slowest[0] * 1e3:.1f} ms CPU: {slowest[1]!r}')
  assert set(errors) == {'ParamsError'}, errors
  assert slowest[0] < 1.0, slowest  # Bounded work: nothing hangs.
  new = {m for m in set(sys.modules) - modules_before
         if not m.startswith('lingvo_pipe')}
  assert not new, new


@pytest.mark.parametrize('text, match', [
    ('x : list(len=99999999)', 'exceed the 100,000'),
    ('x : list(len=' + '9' * 5000 + ')', 'Cannot parse'),
    ('layers[' + '9' * 5000 + '].name : a', 'at most 9 digits'),
    ('x : ' + '9' * 5000, 'Cannot parse'),
    ('x : 1' + '0' * 400, '308 digits'),
    ('x : ' + '[' * 100 + ']' * 100, 'nested deeper than 32'),
    ('x : ' + '-' * 20000 + '1', 'Cannot parse'),
    ('x : ' + 'a' * (params_literal.MAX_VALUE_CHARS + 1), 'characters'),
    ('layers[5] : 1', r'Index \[5\] out of range'),
    ('lr[0] : 1', r'Index \[0\] out of range'),
    ('x : 1j', 'complex literal'),
    ('x : {[1]: 2}', 'dict key'),
])
def test_hostile_values_are_refused_with_params_error(text, match):
  p = _params(x=None, lr=0.1, layers=[1, 2])
  with pytest.raises(ParamsError, match=match):
    p.FromText(text)


# ---- The type rule ----------------------------------------------------------
@pytest.mark.parametrize('text', ['lr : None', 'lr : NoneType',
                                  'dims : None', 'name : None'])
def test_none_does_not_replace_a_typed_value(text):
  # Issue 11: `learning_rate: None` was accepted and crashed in training.
  p = _params(lr=0.1, dims=[1], name='a')
  with pytest.raises(ParamsError, match='None cannot replace'):
    p.FromText(text)


def test_none_replaces_a_value_whose_default_is_none():
  p = _params(micro_batch_size=None)
  p.micro_batch_size = 8
  assert p.FromText('micro_batch_size : None').micro_batch_size is None
  p.micro_batch_size = 8
  assert p.FromText('micro_batch_size : NoneType').micro_batch_size is None


def test_no_new_keys_under_a_none_that_replaced_a_typed_value():
  inner = _params(depth=1)
  p = _params(inner=inner)
  p.inner = None  # Set in code; the default says it holds Params.
  with pytest.raises(ParamsError, match='not Params'):
    p.FromText('inner.depth : 2')
  with pytest.raises(ParamsError, match='not Params'):
    _params(lr=0.1).FromText('lr.cls : type/lingvo_pipe.core.gpipe.'
                             'PipeliningLayer')


def test_keys_grow_under_none_only_after_a_line_that_builds_params():
  # Issue 11: `task.pipeline.costs.foo : 1` turned the None into Params,
  # and the pipeline then crashed on len(costs).
  with pytest.raises(ParamsError, match='not Params'):
    _params(costs=None).FromText('costs.foo : 1')
  with pytest.raises(ParamsError, match='not Params'):
    _params(layers=[]).FromText('layers : list(len=1); layers[0].a : 1')
  p = _params(x=None).FromText('x : Params(); x.depth : 4')
  assert p.x.depth == 4 and p.ToText() == 'x : Params()\nx.depth : 4\n'
  with pytest.raises(ParamsError, match='Params\\(\\) cannot replace'):
    _params(lr=0.1).FromText('lr : Params()')


def test_list_header_keeps_non_lists_typed():
  with pytest.raises(ParamsError, match=r'list\(len=3\) cannot replace'):
    _params(lr=0.1).FromText('lr : list(len=3)')
  assert _params(x=None).FromText('x : list(len=2)').x == [None, None]


# ---- Declared types of None defaults (issue 29) ------------------------------
# `random_seed : abc` parsed as the string 'abc' (a None default holds
# anything), and the layer's int() then crashed with a traceback, exit 1.
_MLP = 'synthetic.regression.MlpRegression'


@pytest.mark.parametrize('line, match', [
    ('task.random_seed : abc', "'abc' as an int"),
    ('task.random_seed : 1.5', 'is a float, but it holds an int or None'),
    ('task.random_seed : true', 'is a bool, but it holds an int'),
    ('task.pipeline.layers[2].random_seed : "7"', 'is a str'),
    ('task.random_seed : list(len=2)', 'would make it a list'),
    ('task.random_seed : Params()', 'would make it a Params'),
    ('task.random_seed.cls : type/lingvo_pipe.layers.linear.FCLayer',
     'would make it a Params'),
    ('task.fprop_dtype : abc', "'abc' as a DType"),
    ('task.pipeline.micro_batch_size : abc', "'abc' as an int"),
    ('task.pipeline.micro_batch_size : 2.5', 'is a float'),
    ('task.pipeline.devices : abc', "'abc' as a list"),
    ('task.pipeline.split_points : 2', 'is an int, but it holds a list'),
    ('task.pipeline.memory_optimizer : 5', 'holds a str or None'),
    ('task.pipeline.memory_budget_bytes : big', 'as an int or a float'),
    ('task.pipeline.inline_stage_calls : 1', 'holds a bool or None'),
])
def test_a_none_default_holds_only_its_declared_type(line, match):
  p = model_registry.get_params(_MLP, 'Train')
  before = p.ToText()
  with pytest.raises(ParamsError, match=match) as e:
    p.FromText(line)
  assert line.split(' : ')[0].replace('.cls', '') in str(e.value)
  assert p.ToText() == before  # Refused before anything changed.


@pytest.mark.parametrize('line, want', [
    ('task.random_seed : 7', 7),
    ('task.fprop_dtype : float64', tf.float64),
    ('task.fprop_dtype : tf.bfloat16', tf.bfloat16),
    ('task.pipeline.memory_budget_bytes : 1e9', 1e9),
    ('task.pipeline.costs : profile', 'profile'),
    ('task.pipeline.costs : [1, 2.5, 1, 1, 1]', [1, 2.5, 1, 1, 1]),
    ('task.pipeline.split_points : (2,)', (2,)),
    ('task.pipeline.devices : ["/device:CPU:1", "/device:CPU:0"]',
     ['/device:CPU:1', '/device:CPU:0']),
    ('task.pipeline.inline_stage_calls : false', False),
    ('task.random_seed : None', None),
])
def test_a_none_default_takes_its_declared_type(line, want):
  p = model_registry.get_params(_MLP, 'Train').FromText(line)
  assert p.Get(line.split(' : ')[0]) == want


def _none_defaults(p: Params, path: str = ''):
  """(path, declared type, value) of every param whose default is None."""
  for name, param in p._params.items():  # pylint: disable=protected-access
    here = f'{path}{name}'
    if param.default is None:
      yield here, param.value_type, param.value
    values = param.value if isinstance(param.value, (list, tuple)) else [
        param.value]
    for i, value in enumerate(values):
      if isinstance(value, Params):
        index = f'[{i}]' if isinstance(param.value, (list, tuple)) else ''
        yield from _none_defaults(value, f'{here}{index}.')


def test_every_none_default_of_a_registered_model_declares_its_type():
  # The class of issue 29's bug: a None default says nothing about the
  # type, so any text went through. A param that holds Params (a layer's
  # `body`) is built by its own lines and needs no declaration.
  untyped = set()
  for name in model_registry.list_models():
    for path, value_type, value in _none_defaults(
        model_registry.get_params(name, 'Train')):
      if value_type is None and not isinstance(value, Params):
        untyped.add(path)
  assert not untyped, sorted(untyped)


def test_value_type_is_only_for_a_none_default():
  with pytest.raises(ParamsError, match='value_type is for a None default'):
    Params().Define('lr', 0.1, 'Rate.', value_type=float)


# ---- type/ resolves only what is safe ---------------------------------------
def test_type_outside_the_package_is_refused_and_not_imported(tmp_path,
                                                             monkeypatch):
  marker = tmp_path / 'imported'
  (tmp_path / 'lp_trap_module.py').write_text(
      f'open({str(marker)!r}, "w").close()\nclass Trap:\n  pass\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  for text in ('type/lp_trap_module.Trap', 'type/lp_trap_module/Trap'):
    with pytest.raises(ParamsError, match='never imports other modules'):
      _params(cls=int).FromText(f'cls : {text}')
    with pytest.raises(ParamsError, match='never imports'):
      _params(x=None).FromText(f'x.cls : {text}')
  assert 'lp_trap_module' not in sys.modules
  assert not marker.exists()


def test_type_resolves_imported_modules_and_the_package():
  p = _params(cls=int, x=None)
  p.FromText('cls : type/collections.OrderedDict')  # Already imported.
  assert p.cls is collections.OrderedDict
  p.FromText('cls : type/lingvo_pipe.pipeline.schedule.Action')
  assert p.cls.__name__ == 'Action'
  with pytest.raises(ParamsError, match='no working Params'):
    p.FromText('x.cls : type/lingvo_pipe.params.synthetic.regression/'
               'MlpRegression')  # A model config, not a params class.


def test_type_in_a_logdir_text_never_runs_a_module_in_the_evaler():
  text = 'task.cls : type/lp_never_imported_xyz.Task'
  p = model_registry.get_params('synthetic.regression.MlpRegression', 'Dev')
  with pytest.raises(ParamsError, match='never imports'):
    p.FromText(text)
  assert 'lp_never_imported_xyz' not in sys.modules


# ---- Lingvo's spellings (peer behaviours) ---------------------------------
@pytest.mark.parametrize('text, want', [
    ('flag : false', False), ('flag : true', True), ('flag : False', False),
    ('flag : NoneType', None), ('flag : None', None)])
def test_true_false_and_nonetype_parse_as_lingvo_does(text, want):
  # Issue 11: 'false' was stored as the string 'false', which is truthy.
  value = _params(flag=None).FromText(text).flag
  assert value is want
  if isinstance(want, bool):
    assert _params(flag=not want).FromText(text).flag is want


_Point = collections.namedtuple('_Point', ['x', 'y'])


def test_a_namedtuple_round_trips_and_copies():
  # Issue 11: ToText wrote `v : (1, 2)`, which FromText could not read into
  # the namedtuple (TypeError), and Copy() made it a plain tuple.
  src = _params(v=_Point(1, 2))
  src.v = _Point(3, [4, 5])
  assert src.ToText() == "v : {'x': 3, 'y': [4, 5]}\n"
  dst = _params(v=_Point(1, 2)).FromText(src.ToText())
  assert type(dst.v) is _Point and dst.v == (3, [4, 5])
  assert type(src.Copy().v) is _Point
  assert _params(v=_Point(1, 2)).FromText('v : (7, 8)').v == _Point(7, 8)
  with pytest.raises(ParamsError, match='expected _Point'):
    _params(v=_Point(1, 2)).FromText('v : (7, 8, 9)')


def test_a_list_of_strings_replaces_a_string_as_in_lingvo():
  # Lingvo accepts a list for a str param ("we may have stored a list as a
  # string"); it must round-trip.
  p = _params(activation='RELU').FromText("activation : ['RELU', 'NONE']")
  assert p.activation == ['RELU', 'NONE']
  again = _params(activation='RELU').FromText(p.ToText())
  assert again.activation == ['RELU', 'NONE'] and again == p
  assert _params(activation='RELU').FromText('activation : [1, 2]'
                                            ).activation == '[1, 2]'


@pytest.mark.parametrize('text, want', [
    ('dtype : float32', tf.float32), ('dtype : bfloat16', tf.bfloat16),
    ('dtype : bool', tf.bool), ('dtype : tf.int32', tf.int32),
    ('x : float32', tf.float32), ('x : [float32, int32]', [tf.float32,
                                                          tf.int32]),
    ('x : bool', 'bool'), ('name : float32', 'float32')])
def test_bare_dtype_names_parse_as_lingvo_writes_them(text, want):
  p = _params(dtype=tf.float32, x=None, name='n')
  key = text.split(' :')[0]
  assert getattr(p.FromText(text), key) == want


def test_lingvo_type_spelling_with_a_slash():
  p = _params(cls=int)
  p.FromText('cls : type/lingvo_pipe.core.gpipe/PipeliningLayer')
  assert p.cls is gpipe.PipeliningLayer
  p.FromText(f'cls : type/{__name__}/_Point')
  assert p.cls is _Point
  holder = _params(layer=None).FromText(
      'layer.cls : type/lingvo_pipe.core.gpipe/PipeliningLayer\n'
      'layer.num_stages : 3')
  assert isinstance(holder.layer, InstantiableParams)
  assert holder.layer.num_stages == 3
