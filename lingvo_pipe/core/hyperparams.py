"""Params: self-documenting, text-serialisable hyperparameters.

Every layer, task and model in lingvo_pipe is configured by a `Params` tree.
Each key is declared once with a default and a doc string (`Define`), so a
typo is an error that names the full path and the closest real key instead of
a silently ignored attribute. The tree prints as `path : value` lines
(`ToText`) that parse back (`FromText`); the trainer stores that text in the
logdir and refuses to resume under different params, printing `TextDiff`.

>>> p = Params()
>>> p.Define('learning_rate', 0.1, 'Peak learning rate.')
>>> p.Set(learning_rate=0.2).learning_rate
0.2
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from typing import Any, Callable, Iterator, Sequence

from lingvo_pipe.core import params_from_text
from lingvo_pipe.core import params_text
from lingvo_pipe.core.params_text import ParamsError

# ToText's line for bare Params in an untyped slot (params_from_text reads it).
BARE_PARAMS = 'Params()'
# An index has at most 9 digits: a 5,000-digit one is a malformed path, not
# a 5,000-digit int to convert.
_PATH_PART = re.compile(r'^([A-Za-z_]\w*)((?:\[\d{1,9}\])*)$')


def _suggest(name: str, candidates: list[str]) -> str:
  close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
  return f' Did you mean {" or ".join(repr(c) for c in close)}?' if close else ''


class _Param:
  """One defined key: its value, default, doc string and, for a None
  default, the type its values from text must have (None: any)."""

  __slots__ = ('name', 'value', 'default', 'doc', 'value_type')

  def __init__(self, name: str, default: Any, doc: str,
               value_type: Any = None) -> None:
    self.name = name
    self.value = default
    self.default = default
    self.doc = doc
    self.value_type = value_type


class Params:
  """An ordered tree of documented hyperparameters."""

  def __init__(self) -> None:
    self.__dict__['_params'] = {}
    self.__dict__['_frozen'] = False
    self.__dict__['_path'] = ''

  # ---- Definition and access -------------------------------------------
  def Define(self, name: str, default: Any, doc: str,
             value_type: Any = None) -> None:
    """Declares key `name` with a default value and a doc string.

    A default says what type the values read from text must have
    (`FromText`), except None, which says nothing: `value_type` (a type or a
    tuple of types, e.g. `int`) declares it for a None default, so that
    `random_seed : abc` is an error naming the param, not the string 'abc'.
    """
    self._CheckMutable(name)
    if not _PATH_PART.match(name) or '[' in name or name.startswith('_'):
      raise ParamsError(f'Param name {self._Full(name)!r} must be an '
                        'identifier that does not start with "_".')
    if hasattr(type(self), name):  # p.Copy would read the method, not it.
      raise ParamsError(f'Param name {self._Full(name)!r} shadows the '
                        f'{type(self).__name__} attribute {name!r}; rename it.')
    if name in self._params:
      raise ParamsError(f'Param {self._Full(name)!r} is already defined '
                        f'(doc: {self._params[name].doc!r}).')
    if not doc:
      raise ParamsError(f'Param {self._Full(name)!r} needs a doc string: say '
                        'what it does and in which unit.')
    if value_type is not None and default is not None:
      raise ParamsError(f'Param {self._Full(name)!r}: value_type is for a '
                        f'None default; {default!r} already has a type.')
    self._params[name] = _Param(name, default, doc, value_type)
    self._Adopt(name, default)

  def __getattr__(self, name: str) -> Any:
    if name.startswith('__'):
      raise AttributeError(name)
    params = self.__dict__['_params']
    if name not in params:
      raise self._UnknownKey(name)
    return params[name].value

  def __setattr__(self, name: str, value: Any) -> None:
    self._CheckMutable(name)
    if name not in self._params:
      raise self._UnknownKey(name)
    self._params[name].value = value
    self._Adopt(name, value)

  def __contains__(self, name: str) -> bool:
    return name in self._params

  def __dir__(self) -> list[str]:
    return list(super().__dir__()) + list(self._params)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Params):
      return NotImplemented
    return self._Flat() == other._Flat()

  def __repr__(self) -> str:
    return f'{type(self).__name__}(\n{self.ToText()})'

  def IterParams(self) -> Iterator[tuple[str, Any]]:
    """(name, value) pairs in definition order."""
    for name, param in self._params.items():
      yield name, param.value

  def GetDoc(self, name: str) -> str:
    if name not in self._params:
      raise self._UnknownKey(name)
    return self._params[name].doc

  def Get(self, path: str) -> Any:
    """The value at a dotted path such as 'layers[2].output_dim'."""
    parent, key, index = self._Walk(path, create=False)
    value = getattr(parent, key)
    return value if index is None else value[index]

  def Set(self, **kwargs: Any) -> 'Params':
    """Sets values by name or dotted path; returns self for chaining.

    `p.Set(learning_rate=0.1)` or `p.Set(**{'stage.fc.output_dim': 8,
    'layers[0].name': 'fc0'})`.
    """
    for path, value in kwargs.items():
      parent, key, index = self._Walk(path, create=False)
      parent._SetIndexed(key, [] if index is None else [index], value)
    return self

  # ---- Copy and freeze ---------------------------------------------------
  def Copy(self) -> 'Params':
    """A deep, unfrozen copy (classes, dtypes and other leaves are shared)."""
    new = copy.copy(self)
    new.__dict__['_params'] = {}
    new.__dict__['_frozen'] = False
    new.__dict__['_path'] = self._path
    for name, param in self._params.items():
      new._params[name] = _Param(name, _copy_value(param.value), param.doc,
                                 param.value_type)
      new._params[name].default = param.default
    return new

  def Freeze(self) -> 'Params':
    """Makes this tree (and every nested Params) read-only; returns self."""
    self.__dict__['_frozen'] = True
    for name, value in self.IterParams():
      for _, sub in _nested_params(value, name):
        sub.Freeze()
    return self

  @property
  def is_frozen(self) -> bool:
    return self._frozen

  # ---- Lingvo's tree operations ---------------------------------------------
  def IsDefined(self, path: str) -> bool:
    """Whether `path` ('a', 'a.b', 'layers[1].dim') names a defined param."""
    node: Any = self
    for part in path.split('.'):
      m = _PATH_PART.match(part)
      if not m or not isinstance(node, Params) or m.group(1) not in node:
        return False
      node = node._params[m.group(1)].value
      for index in (int(i) for i in re.findall(r'\d+', m.group(2))):
        if not isinstance(node, (list, tuple)) or index >= len(node):
          return False
        node = node[index]
    return True

  def Delete(self, *paths: str) -> 'Params':
    """Removes the params at `paths` (names or dotted paths); returns self.

    Raises:
      ParamsError: a path is not defined (the message lists its level's
        keys), or these Params are frozen.
    """
    for path in paths:
      parent, key, index = self._Walk(path, create=False)
      if index is not None:
        raise ParamsError(f'Cannot Delete {path!r}: it names a list item; '
                          'set the list instead.')
      parent._CheckMutable(key)
      del parent._params[key]
    return self

  def Visit(self, visit_fn: Callable[[str, Any], Any],
            enter_fn: Callable[[str, Any], bool] | None = None,
            exit_fn: Callable[[str, Any], Any] | None = None) -> None:
    """Walks the tree as Lingvo's `Params.Visit` does.

    Params, lists, tuples, namedtuples and dataclass instances can be
    entered: `enter_fn(key, value)` is called first and, if it returns True
    (the default), their items are visited, then `exit_fn(key, value)`.
    Anything else, or a container `enter_fn` declined, goes to
    `visit_fn(key, value)`. Keys are '' for this Params, then 'a.b' for a
    Params key, 'a[1]' for a list or tuple item, 'a.field' for a namedtuple
    or dataclass field.
    """
    _visit('', self, visit_fn, enter_fn or (lambda key, value: True),
           exit_fn or (lambda key, value: None))

  def CopyFieldsTo(self, to_p: 'Params',
                   skip: str | Sequence[str] | None = None) -> 'Params':
    """`CopyFieldsTo(self, to_p, skip)`: see the module function."""
    return CopyFieldsTo(self, to_p, skip)

  # ---- Text ----------------------------------------------------------------
  def ToText(self) -> str:
    """`path : value` lines, one per leaf, in definition order."""
    return ''.join(f'{k} : {v}\n' for k, v in self._Flat().items())

  def FromText(self, text: str) -> 'Params':
    """Applies `path : value` lines (ToText's format); returns self.

    Lines may be separated by newlines or ';' (the trainer's
    --model_params_override). A ';' inside a quoted string is part of the
    string; an unquoted string value (`optimizer : adam`) cannot contain ';'
    — quote it (ToText always does). Lines starting with '#' are comments. A
    value is parsed into the type of the value it replaces; a mismatch
    raises an error naming the key, the text and the expected type (see
    `params_text` for the rule and its exceptions).

    Raises:
      ParamsError: for any text that is not such lines; never another error.
    """
    params_from_text.apply_text(self, text)
    return self

  def TextDiff(self, other: 'Params') -> str:
    """Lines that differ: '- key : mine', '+ key : theirs'."""
    mine, theirs = self._Flat(), other._Flat()
    out = []
    for key in list(mine) + [k for k in theirs if k not in mine]:
      a, b = mine.get(key), theirs.get(key)
      if a != b:
        if a is not None:
          out.append(f'- {key} : {a}')
        if b is not None:
          out.append(f'+ {key} : {b}')
    return '\n'.join(out)

  # ---- Internals -------------------------------------------------------------
  def _Full(self, name: str) -> str:
    return f'{self._path}.{name}' if self._path else name

  def _UnknownKey(self, name: str) -> ParamsError:
    return ParamsError(
        f'Unknown param {self._Full(name)!r}.'
        f'{_suggest(name, list(self._params))} Defined here: '
        f'{", ".join(self._params) or "(none)"}.')

  def _CheckMutable(self, name: str) -> None:
    if self._frozen:
      raise ParamsError(
          f'Cannot set {self._Full(name)!r}: these Params are frozen (a '
          'layer keeps a frozen copy of its params). Change a Copy() and '
          'instantiate again.')

  def _Adopt(self, name: str, value: Any) -> None:
    """Records the full path of nested Params (all levels) for messages."""
    for path, sub in _nested_params(value, self._Full(name)):
      sub.__dict__['_path'] = path
      for key, item in sub.IterParams():
        sub._Adopt(key, item)

  def _Walk(self, path: str, create: bool) -> tuple['Params', str, int | None]:
    """Resolves 'a.b[2].c' to (Params holding c, 'c', list index or None)."""
    node: Params = self
    parts = path.split('.')
    done: list[str] = []
    for depth, part in enumerate(parts):
      m = _PATH_PART.match(part)
      if not m:
        raise ParamsError(f'Malformed param path {_short(path)!r} at '
                          f'{_short(part)!r}: use dotted names with optional '
                          '[index] (at most 9 digits), e.g. '
                          '"layers[2].output_dim".')
      key, indices = m.group(1), [int(i) for i in re.findall(r'\d+',
                                                            m.group(2))]
      if key not in node._params and isinstance(node, _OpenParams):
        node.Define(key, None, 'Set from text.')  # At any depth.
      if key not in node._params:
        raise ParamsError(
            f'Unknown param {self._Full(".".join(done + [key]))!r} in path '
            f'{path!r}.'
            f'{_suggest(key, list(node._params))} Defined at this level: '
            f'{", ".join(node._params) or "(none)"}.')
      last = depth == len(parts) - 1
      value = node._params[key].value
      for j, index in enumerate(indices):
        if not isinstance(value, (list, tuple)) or index >= len(value):
          size = len(value) if isinstance(value, (list, tuple)) else 'n/a'
          raise ParamsError(f'Index [{index}] out of range in '
                            f'{_short(path)!r} (list length {size}).')
        if last and j == len(indices) - 1:
          if j:
            raise ParamsError(f'Nested list indices are not settable: '
                              f'{path!r}.')
          return node, key, index
        value = value[index]
      if last:
        return node, key, None
      if not isinstance(value, Params):
        raise ParamsError(f'{".".join(done + [part])!r} in path {path!r} is '
                          f'a {type(value).__name__}, not Params.')
      node = value
      done.append(part)
    raise ParamsError(f'Empty param path {path!r}.')

  def _SetIndexed(self, key: str, indices: list[int], value: Any) -> None:
    if not indices:
      setattr(self, key, value)
      return
    self._CheckMutable(key)
    container = self._params[key].value
    if isinstance(container, tuple):
      container = list(container)
      container[indices[0]] = value
      setattr(self, key, tuple(container))
    else:
      container[indices[0]] = value
      self._Adopt(key, container)

  def _Flat(self) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, param in self._params.items():
      _flatten(name, param.value, out, untyped=param.default is None)
    return out


class InstantiableParams(Params):
  """Params with a `cls` key; `Instantiate()` builds `cls(self)`."""

  def __init__(self, cls: type | None = None) -> None:
    super().__init__()
    self.Define('cls', cls, 'The class that these params instantiate.')

  def Instantiate(self, **kwargs: Any) -> Any:
    if self.cls is None:
      raise ParamsError(f'Cannot instantiate {self._path or "params"}: '
                        '`cls` is None. Set p.cls or start from '
                        'SomeClass.Params().')
    return self.cls(self, **kwargs)


def CopyFieldsTo(from_p: Params, to_p: Params,
                 skip: str | Sequence[str] | None = None) -> Params:
  """Copies every field of `from_p` except `cls` and `skip` into `to_p`.

  Lingvo's helper for building one layer's Params from another's: `to_p`
  keeps its class (so `to_p.Instantiate()` builds what it did), nested Params
  are copied, other values are shared. Returns `to_p`.

  Raises:
    ParamsError: `to_p` has no field of that name; add it to `skip` or
      Define it in `to_p`'s class.
  """
  skipped = {skip} if isinstance(skip, str) else set(skip or ())
  skipped.add('cls')
  for name, value in from_p.IterParams():
    if name in skipped:
      continue
    if name not in to_p:
      raise ParamsError(
          f'CopyFieldsTo: {to_p._Full(name)!r} is not defined in the target '
          f'Params (it has {", ".join(to_p._params) or "no fields"}); pass '
          f'skip=[{name!r}] or Define it there.')
    to_p.Set(**{name: value.Copy() if isinstance(value, Params) else value})
  return to_p


def _visit(key: str, value: Any, visit_fn: Callable[[str, Any], Any],
           enter_fn: Callable[[str, Any], bool],
           exit_fn: Callable[[str, Any], Any]) -> None:
  """Params.Visit's recursion: see its docstring."""
  if isinstance(value, Params):
    items = [(f'{key}.{k}' if key else k, v) for k, v in value.IterParams()]
  elif isinstance(value, tuple) and hasattr(value, '_fields'):  # namedtuple
    items = [(f'{key}.{f}', getattr(value, f)) for f in value._fields]
  elif dataclasses.is_dataclass(value) and not isinstance(value, type):
    items = [(f'{key}.{f.name}', getattr(value, f.name))
             for f in dataclasses.fields(value)]
  elif isinstance(value, (list, tuple)):
    items = [(f'{key}[{i}]', v) for i, v in enumerate(value)]
  else:
    visit_fn(key, value)
    return
  if not enter_fn(key, value):
    visit_fn(key, value)
    return
  for sub_key, sub_value in items:
    _visit(sub_key, sub_value, visit_fn, enter_fn, exit_fn)
  exit_fn(key, value)


# ---- Value (de)serialisation -------------------------------------------------
def _nested_params(value: Any, path: str) -> Iterator[tuple[str, Params]]:
  """(path, Params) for `value` or each Params in a (nested) list of it."""
  if isinstance(value, Params):
    yield path, value
  elif isinstance(value, (list, tuple)):
    for i, item in enumerate(value):
      yield from _nested_params(item, f'{path}[{i}]')


def _short(text: str, limit: int = 120) -> str:
  return text if len(text) <= limit else text[:limit - 3] + '...'


def _copy_value(value: Any) -> Any:
  if isinstance(value, Params):
    return value.Copy()
  if isinstance(value, list):
    return [_copy_value(v) for v in value]
  if params_text.is_namedtuple(value):
    return type(value)(*(_copy_value(v) for v in value))
  if isinstance(value, tuple):
    return tuple(_copy_value(v) for v in value)
  if isinstance(value, dict):
    return {k: _copy_value(v) for k, v in value.items()}
  return value


class _OpenParams(Params):
  """Params that accept keys they have not defined (built by FromText)."""

  def __setattr__(self, name: str, value: Any) -> None:
    if name not in self._params:
      self.Define(name, None, 'Set from text.')
    super().__setattr__(name, value)


def _flatten(path: str, value: Any, out: dict[str, str],
             untyped: bool = False) -> None:
  """ToText's lines of `value` at `path` into `out`.

  Params in an untyped slot (a param whose default is None, or a list
  element) get a line that says what to build there: `x.cls : type/...`
  for InstantiableParams, `x : Params()` for bare Params. FromText builds
  Params nowhere else, so `costs.foo : 1` cannot turn a None into Params.
  """
  if isinstance(value, Params):
    if untyped and not isinstance(value, InstantiableParams):
      out[path] = BARE_PARAMS
    for name, param in value._params.items():
      _flatten(f'{path}.{name}', param.value, out,
               untyped=param.default is None)
  elif isinstance(value, (list, tuple)) and any(
      isinstance(v, Params) for v in value):
    out[path] = f'{type(value).__name__}(len={len(value)})'
    for i, item in enumerate(value):
      _flatten(f'{path}[{i}]', item, out, untyped=True)
  else:
    out[path] = params_text.value_to_text(path, value)
