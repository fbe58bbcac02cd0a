"""Params values as text: `ToText`'s format and the type rule of `FromText`.

A value is written as the Python literal it is, with extensions that a
literal cannot express: dtypes as `tf.float32`, classes as
`type/package.module.Class`, and namedtuples as a dict of their fields (as
Lingvo writes them). `params_literal.parse` reads a value back without
running anything; `parse_value` then applies the type rule:

    a value keeps the type of the value it replaces.

So a typo in an override fails with the key, the text and the expected type
instead of changing a model. The rule's exceptions, each for a reason:

- a param whose default is None holds anything (None says nothing about its
  type), so texts of any tree round-trip into one with None defaults;
- an int is accepted for a float (`learning_rate : 1`);
- a str param takes an unquoted word as that string (`optimizer : adam`) and
  a list of strings (`activation : ['RELU', 'NONE']`), as Lingvo does;
- a bool param takes Lingvo's `true`/`false`, a dtype param its bare name
  (`float32`, `bool`), a namedtuple param a tuple or a dict of its fields;
- list and tuple are one kind: the text says which (`[1]` or `(1,)`, like
  `list(len=N)` or `tuple(len=N)`), so every value round-trips;
- None replaces a value only where the default is None (or the value is
  None already): `learning_rate : None` is an error, not a crash later;
- a param with a None default holds what its `Define(..., value_type=...)`
  declares (`random_seed : abc` is an error, not the string 'abc' that
  `int()` later chokes on), or anything if it declares nothing.

Keys never grow under a None: a None becomes Params only by a line that
says which, `x.cls : type/...` or `x : Params()` (ToText writes them for
Params in untyped slots), so `task.pipeline.costs.foo : 1` is an error.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from lingvo_pipe.core import params_literal
from lingvo_pipe.core.params_literal import ParamsError

__all__ = ['ParamsError', 'is_namedtuple', 'parse_value', 'split_lines',
           'value_to_text']

# What a user meant as a value, never as a bare word: a number ('-1.5',
# '.5'), a container or quoted string, a list header, a class or a dtype.
_LITERAL_START = re.compile(
    r'^([\[({\'"]|[+-]*(\d|\.\d)|(list|tuple)\(|type/|tf\.)')


def is_namedtuple(value: Any) -> bool:
  return isinstance(value, tuple) and hasattr(type(value), '_fields')


def value_to_text(path: str, value: Any) -> str:
  """`value` as FromText reads it back (see the module docstring)."""
  if isinstance(value, tf.DType):
    return f'tf.{value.name}'
  if isinstance(value, type):
    return f'type/{value.__module__}.{value.__qualname__}'
  if is_namedtuple(value):
    value = dict(zip(type(value)._fields, value))
  if isinstance(value, (list, tuple)):
    inner = ', '.join(value_to_text(path, v) for v in value)
    if isinstance(value, tuple):
      return f'({inner},)' if len(value) == 1 else f'({inner})'
    return f'[{inner}]'
  if isinstance(value, dict):
    inner = ', '.join(f'{k!r}: {value_to_text(path, v)}'
                      for k, v in value.items())
    return '{' + inner + '}'
  if value is None or isinstance(value, (bool, int, float, str)):
    return repr(value)
  if hasattr(value, 'item') and hasattr(value, 'dtype'):  # numpy scalar
    return repr(value.item())
  raise ParamsError(
      f'Param {path!r} holds a {type(value).__name__} ({value!r}), which '
      'cannot be written as text. Store a number, string, bool, None, '
      'list/tuple, dtype, class or nested Params (e.g. a name string for a '
      'function).')


def split_lines(text: str) -> list[str]:
  """Splits at newlines, and at ';' outside quoted strings and comments.

  A quote opens a string only where one can start (after `:[({,`), so the
  apostrophe of an unquoted `it's` does not. A line starting with '#' is a
  comment up to the newline.
  """
  lines, cur, quote, escaped, prev = [], [], '', False, ':'
  for ch in text:
    if ch == '\n' or (ch == ';' and not quote and
                      not ''.join(cur).lstrip().startswith('#')):
      lines.append(''.join(cur))
      cur, quote, escaped, prev = [], '', False, ':'
      continue
    cur.append(ch)
    if quote:
      if ch == quote and not escaped:
        quote = ''
      escaped = ch == '\\' and not escaped
    elif ch in '\'"' and prev in '[({,:':
      quote = ch
    prev = prev if ch.isspace() else ch
  return lines + [''.join(cur)]


def _looks_like_a_literal(text: str) -> bool:
  """Text a user meant as a number or container, never as a bare word."""
  return bool(_LITERAL_START.match(text))


def parse_value(text: str, old: Any, path: str, default: Any = None,
                value_type: Any = None) -> Any:
  """Parses `text` into the type of `old` (the value it replaces).

  Args:
    text: The value's text.
    old: The value it replaces (its type is the expected type).
    path: The param's path, for messages.
    default: The param's default (None: the param may hold anything).
    value_type: What a param with a None default holds (a type or a tuple
      of types; see `Params.Define`); None: anything.

  Raises:
    ParamsError: naming the path, the text and the expected type.
  """
  kind = 'a value' if old is None else describe(type(old))
  if len(text) > params_literal.MAX_VALUE_CHARS:
    raise ParamsError(f'Cannot parse {path} : {_shown(text)}: its '
                      f'{len(text):,} characters exceed the '
                      f'{params_literal.MAX_VALUE_CHARS:,} a value may have.')
  if old is None and value_type is not None:
    kind = describe(value_type)
  try:
    value = params_literal.parse(text)
  except ParamsError as e:
    word = _as_word(text, old, value_type)
    if word is not None:
      return word
    raise ParamsError(f'Cannot parse {path} : {_shown(text)} as {kind}: '
                      f'{e}; give {kind}.') from None
  if value is None:
    if old is None or default is None:
      return None
    raise ParamsError(
        f'Param {path!r}: None cannot replace its {type(old).__name__} value '
        f'{old!r} (its default is {default!r}); give a '
        f'{type(old).__name__}.')
  if old is None:
    if value_type is None or holds(value_type, value):
      return float(value) if value_type is float else value
    raise ParamsError(
        f'Param {path!r}: text {_shown(text)} is {describe(type(value))}, '
        f'but it holds {kind} or None; give {kind}.')
  converted = _convert(value, old, text)
  if converted is _MISMATCH:
    raise ParamsError(
        f'Param {path!r}: text {_shown(text)} is a {type(value).__name__}, '
        f'expected {type(old).__name__} (current value {old!r}).')
  return converted


_MISMATCH = object()


def _shown(text: str) -> str:
  return repr(text if len(text) <= 200 else text[:197] + '...')


def _types_of(value_type: Any) -> tuple[type, ...]:
  return value_type if isinstance(value_type, tuple) else (value_type,)


def describe(value_type: Any) -> str:
  """'an int', 'a list or a str': what `Define(value_type=...)` declares."""
  names = [getattr(t, '__name__', str(t)) for t in _types_of(value_type)]
  return ' or '.join(f'an {n}' if n[0] in 'aeiou' else f'a {n}'
                     for n in names)


def holds(value_type: Any, value: Any) -> bool:
  """Whether a param declared with `value_type` may hold `value`: bool is
  no int, an int is a float, and list and tuple are one kind (as above)."""
  for t in _types_of(value_type):
    if t in (int, float) and isinstance(value, bool):
      continue
    if (isinstance(value, t) or t is float and isinstance(value, int) or
        t in (list, tuple) and isinstance(value, (list, tuple))):
      return True
  return False


def _as_word(text: str, old: Any, value_type: Any = None) -> Any:
  """An unquoted string (`adam`) or dtype name (`bool`), where allowed."""
  typed = old is None and value_type is not None
  if isinstance(old, str) or (old is None and not _looks_like_a_literal(text)
                              and (not typed or str in _types_of(value_type))):
    return text
  if isinstance(old, tf.DType) or typed and tf.DType in _types_of(value_type):
    try:
      return tf.as_dtype(text.strip())  # 'bool', 'string', 'half'
    except TypeError:
      pass
  return None


def _convert(value: Any, old: Any, text: str) -> Any:
  """`value` as the type of `old`, or _MISMATCH."""
  if isinstance(old, bool):
    return value if isinstance(value, bool) else _MISMATCH
  if isinstance(old, int):
    ok = isinstance(value, int) and not isinstance(value, bool)
    return value if ok else _MISMATCH
  if isinstance(old, float):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else _MISMATCH
  if isinstance(old, str):
    if isinstance(value, str):
      return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
      return value  # Lingvo: a str param may hold a list of strings.
    return text.strip()  # e.g. 'adam' or '123' typed without quotes
  if isinstance(old, tf.DType):
    return value if isinstance(value, tf.DType) else _MISMATCH
  if isinstance(old, type):
    return value if isinstance(value, type) else _MISMATCH
  if is_namedtuple(old):
    return _namedtuple(value, type(old))
  if isinstance(old, (list, tuple)):  # The text says which (round trips).
    return value if isinstance(value, (list, tuple)) else _MISMATCH
  if isinstance(old, dict):
    return value if isinstance(value, dict) else _MISMATCH
  return value


def _namedtuple(value: Any, cls: type) -> Any:
  """A `cls` from a tuple of its fields in order, or a dict by field name."""
  fields = list(cls._fields)  # type: ignore[attr-defined]
  if isinstance(value, dict) and sorted(map(str, value)) == sorted(fields):
    return cls(**{str(k): v for k, v in value.items()})
  if isinstance(value, (list, tuple)) and len(value) == len(fields):
    return cls(*value)
  return _MISMATCH
