"""Params values as text: `ToText`'s format and the parser behind `FromText`.

A value is written as the Python literal it is, with two extensions that a
literal cannot express: dtypes as `tf.float32` and classes as
`type/package.module.Class`. Parsing reads the text as a Python expression
and evaluates only literals, `inf`/`nan`, those two forms, and containers of
them — nothing in a params file is ever executed — then checks the result
against the type of the value it replaces, so a typo in an override fails
with the key, the text and the expected type instead of changing a model.
"""

from __future__ import annotations

import ast
import importlib
import math
from typing import Any

import tensorflow as tf

from lingvo_pipe import errors


class ParamsError(errors.LingvoPipeError, AttributeError):
  """A key, path or value that the Params tree does not accept."""


def value_to_text(path: str, value: Any) -> str:
  if isinstance(value, tf.DType):
    return f'tf.{value.name}'
  if isinstance(value, type):
    return f'type/{value.__module__}.{value.__qualname__}'
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


_NAMES = {'None': None, 'True': True, 'False': False, 'inf': math.inf,
          'nan': math.nan}


def _parse_text(text: str) -> Any:
  """Reads ToText's values: literals, inf, nan, tf.<dtype>, type/<class>.

  They may nest anywhere (a dict of dtypes, a list with inf). Only these
  node kinds of the parsed expression are evaluated; nothing in it runs.
  """
  return _eval(ast.parse(text.strip(), mode='eval').body)


def _eval(node: ast.AST) -> Any:
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.Name) and node.id in _NAMES:
    return _NAMES[node.id]
  if isinstance(node, (ast.List, ast.Tuple)):
    items = [_eval(e) for e in node.elts]
    return items if isinstance(node, ast.List) else tuple(items)
  if isinstance(node, ast.Dict) and None not in node.keys:
    return {_eval(k): _eval(v) for k, v in zip(node.keys, node.values)}
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    value = _eval(node.operand)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return -value
  dotted = _dotted(node)
  if dotted and dotted.startswith('tf.'):
    return tf.as_dtype(dotted[3:])
  if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and
      _dotted(node.left) == 'type' and _dotted(node.right)):
    return _import_class(_dotted(node.right))
  raise ValueError(f'{ast.unparse(node)!r} is not a value that ToText writes')


def _dotted(node: ast.AST) -> str:
  """'a.b.c' for an attribute chain of names, else ''."""
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    head = _dotted(node.value)
    return f'{head}.{node.attr}' if head else ''
  return ''


def _import_class(dotted: str) -> type:
  """The class at 'module.Outer.Inner' (longest importable module prefix)."""
  parts = dotted.split('.')
  for cut in range(len(parts) - 1, 0, -1):
    module = '.'.join(parts[:cut])
    try:
      obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name and not (module + '.').startswith(e.name + '.'):
        raise  # The module exists but one of *its* imports is missing.
      continue
    for attr in parts[cut:]:
      obj = getattr(obj, attr)
    if not isinstance(obj, type):
      raise TypeError(f'{dotted} is a {type(obj).__name__}, not a class')
    return obj
  raise ImportError(f'no module of {dotted!r} can be imported')


def split_lines(text: str) -> list[str]:
  """Splits at newlines, and at ';' outside quoted strings and comments.

  A quote opens a string only where one can start (after `:[({,`), so the
  apostrophe of an unquoted `it's` does not. A line starting with '#' is a
  comment up to the newline.
  """
  lines, cur, quote, escaped, prev = [], '', '', False, ':'
  for ch in text:
    if ch == '\n' or (ch == ';' and not quote and
                      not cur.lstrip().startswith('#')):
      lines.append(cur)
      cur, quote, escaped, prev = '', '', False, ':'
      continue
    cur += ch
    if quote:
      if ch == quote and not escaped:
        quote = ''
      escaped = ch == '\\' and not escaped
    elif ch in '\'"' and prev in '[({,:':
      quote = ch
    prev = prev if ch.isspace() else ch
  return lines + [cur]


def parse_value(text: str, old: Any, path: str) -> Any:
  """Parses `text` into the type of `old` (the value it replaces)."""
  try:
    value = _parse_text(text)
  except (ValueError, SyntaxError, ImportError, AttributeError,
          TypeError) as e:
    if isinstance(old, str) or (old is None and
                                not text.startswith(tuple('[({\'"'))):
      return text  # An unquoted string, as users type on the command line.
    kind = 'a value' if old is None else type(old).__name__
    reason = str(e).rstrip('.')
    raise ParamsError(f'Cannot parse {path} : {text!r} as {kind}: '
                      f'{reason}.') from None
  if old is None or value is None:
    return value
  if isinstance(old, bool):
    ok = isinstance(value, bool)
  elif isinstance(old, int):
    ok = isinstance(value, int) and not isinstance(value, bool)
  elif isinstance(old, float):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    value = float(value) if ok else value
  elif isinstance(old, str):
    ok = isinstance(value, str)
    if not ok:
      value, ok = text, True  # e.g. 'adam' typed without quotes
  elif isinstance(old, tf.DType):
    ok = isinstance(value, tf.DType)
  elif isinstance(old, type):
    ok = isinstance(value, type)
  elif isinstance(old, (list, tuple)):
    ok = isinstance(value, (list, tuple))
    if ok:
      value = type(old)(value)
  elif isinstance(old, dict):
    ok = isinstance(value, dict)
  else:
    ok = True
  if not ok:
    raise ParamsError(
        f'Param {path!r}: text {text!r} is a {type(value).__name__}, '
        f'expected {type(old).__name__} (current value {old!r}).')
  return value
