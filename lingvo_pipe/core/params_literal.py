"""The value of one `path : value` line, read without running anything.

A params text comes from the command line, from override files and from a
logdir's `params.txt`, which the evaler reads: text that someone else wrote.
So the value is parsed as a Python expression and only these node kinds are
evaluated (anything else is a `ParamsError`):

    literals      None, True/False, ints, floats, strings; inf, nan
    Lingvo's      true/false, NoneType, float32 (a dtype without `tf.`)
    dtypes        tf.float32, tf.bfloat16, ...
    classes       type/package.module.Class or type/package.module/Class
    containers    [...], (...), {...} of the above

and every input is bounded, so that no text can make the parser hang or
exhaust memory, and no error but `ParamsError` escapes:

    MAX_VALUE_CHARS   characters in one value
    MAX_ITEMS         elements of one container, and N of `list(len=N)`
    MAX_DEPTH         nesting of containers and signs
    ints              within float64's range, so any int converts to a float
                      (a 5,000-digit literal is refused; indices have ≤ 9
                      digits, see hyperparams)

`type/` names a class in a module that is already imported, or anywhere
under `lingvo_pipe` (its tasks and params included). It never imports a
module outside `lingvo_pipe`: importing runs that module's code, and a
params.txt must not be able to run code in the binary that reads it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import sys
from typing import Any
import warnings

import tensorflow as tf

from lingvo_pipe import errors

MAX_VALUE_CHARS = 1_000_000
MAX_ITEMS = 100_000
MAX_DEPTH = 32
MAX_INT = int(1.7e308)  # About float64's largest: float(int) never overflows.
_PACKAGE = 'lingvo_pipe'

# Bare names a value may use. Lingvo writes true/false and NoneType.
_NAMES = {'None': None, 'True': True, 'False': False, 'inf': math.inf,
          'nan': math.nan, 'true': True, 'false': False, 'NoneType': None}
# Lingvo writes dtypes without `tf.`; 'bool' and 'string' stay words unless
# the param holds a dtype (params_text.parse_value handles that case).
_BARE_DTYPES = frozenset(
    f'{kind}{bits}' for kind, sizes in (('float', (16, 32, 64)),
                                        ('int', (8, 16, 32, 64)),
                                        ('uint', (8, 16, 32, 64)),
                                        ('complex', (64, 128)))
    for bits in sizes) | {'bfloat16'}


class ParamsError(errors.LingvoPipeError, AttributeError):
  """A key, path or value that the Params tree does not accept."""


def parse(text: str) -> Any:
  """The value of `text` (see the module docstring).

  Raises:
    ParamsError: the text is not such a value, or exceeds a bound; the
      message says which.
  """
  text = text.strip()
  if len(text) > MAX_VALUE_CHARS:
    raise ParamsError(f'value of {len(text):,} characters exceeds the '
                      f'{MAX_VALUE_CHARS:,} a params value may have')
  try:
    with warnings.catch_warnings():  # "invalid escape sequence '\\s'"
      warnings.simplefilter('ignore')
      tree = ast.parse(text, mode='eval')
  except (SyntaxError, ValueError, RecursionError, MemoryError,
          OverflowError) as e:  # ValueError: an int of > 4300 digits.
    reason = e.msg if isinstance(e, SyntaxError) else str(e).split(';')[0]
    raise ParamsError(f'not a value ({reason or type(e).__name__})') from None
  return _eval(tree.body, 0)


def _eval(node: ast.AST, depth: int) -> Any:
  if depth > MAX_DEPTH:
    raise ParamsError(f'nested deeper than {MAX_DEPTH} levels')
  if isinstance(node, ast.Constant):
    return _constant(node.value)
  if isinstance(node, ast.Name):
    if node.id in _NAMES:
      return _NAMES[node.id]
    if node.id in _BARE_DTYPES:
      return tf.as_dtype(node.id)
  if isinstance(node, (ast.List, ast.Tuple, ast.Dict)):
    return _container(node, depth)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op,
                                                  (ast.USub, ast.UAdd)):
    value = _eval(node.operand, depth + 1)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return -value if isinstance(node.op, ast.USub) else value
  dotted = _dotted(node)
  if dotted.startswith('tf.') and dotted.count('.') == 1:
    try:
      return tf.as_dtype(dotted[3:])
    except TypeError:
      raise ParamsError(f'{dotted} is not a TensorFlow dtype') from None
  class_path = _class_path(node)
  if class_path:
    return resolve_class(*class_path)
  raise ParamsError(f'{_source(node)!r} is not a value that ToText writes')


def _constant(value: Any) -> Any:
  if isinstance(value, bool) or value is None or isinstance(value, str):
    return value
  if isinstance(value, int):
    if abs(value) > MAX_INT:
      raise ParamsError('integer literal of more than 308 digits (beyond '
                        'float64\'s range)')
    return value
  if isinstance(value, float):
    return value
  raise ParamsError(f'a {type(value).__name__} literal is not a params value')


def _container(node: ast.AST, depth: int) -> Any:
  items = node.keys if isinstance(node, ast.Dict) else node.elts
  if len(items) > MAX_ITEMS:
    raise ParamsError(f'{len(items):,} elements exceed the {MAX_ITEMS:,} a '
                      'params container may have')
  if isinstance(node, ast.Dict):
    if any(k is None for k in node.keys):
      raise ParamsError('"**" is not allowed in a params dict')
    out = {}
    for k, v in zip(node.keys, node.values):
      key = _eval(k, depth + 1)
      if not isinstance(key, (str, int, float, bool, type(None))):
        raise ParamsError(f'dict key {_source(k)!r} is not a str or number')
      out[key] = _eval(v, depth + 1)
    return out
  values = [_eval(e, depth + 1) for e in node.elts]
  return values if isinstance(node, ast.List) else tuple(values)


def _source(node: ast.AST) -> str:
  try:
    text = ast.unparse(node)
  except (RecursionError, ValueError):
    text = type(node).__name__
  return text if len(text) <= 80 else text[:77] + '...'


def _dotted(node: ast.AST) -> str:
  """'a.b.c' for an attribute chain of names, else ''."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return ''
  parts.append(node.id)
  return '.'.join(reversed(parts))


def _class_path(node: ast.AST) -> tuple[str, str] | None:
  """('module.path', 'Qual.Name') or ('dotted.path', '') of a `type/` form.

  `type/a.b.C` (ToText's spelling: module and class joined by '.') or
  `type/a.b/C` (Lingvo's: separated by '/').
  """
  parts = []
  while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
    parts.append(_dotted(node.right))
    node = node.left
  if _dotted(node) != 'type' or not parts or not all(parts):
    return None
  parts.reverse()
  if len(parts) == 1:
    return parts[0], ''
  if len(parts) == 2:
    return parts[0], parts[1]
  return None


def resolve_class(path: str, qualname: str = '') -> type:
  """The class `path` ('module.Class') or `qualname` in module `path`.

  Only modules that are already imported, or under lingvo_pipe, are
  searched (the module docstring says why).

  Raises:
    ParamsError: no such class, or its module would need an import from
      outside lingvo_pipe.
  """
  shown = f'type/{path}/{qualname}' if qualname else f'type/{path}'
  if qualname:
    cuts = [(path, qualname)]
  else:
    parts = path.split('.')
    cuts = [('.'.join(parts[:i]), '.'.join(parts[i:]))
            for i in range(len(parts) - 1, 0, -1)]
  for module_name, attrs in cuts:
    module = _module(module_name, shown)
    if module is None:
      continue
    obj: Any = module
    for attr in attrs.split('.'):
      # Static lookup: a module's __getattr__ (lazy loaders) may import.
      obj = inspect.getattr_static(obj, attr, None)
      if obj is None:
        raise ParamsError(f'{shown}: module {module_name} has no {attrs}')
    if not isinstance(obj, type):
      raise ParamsError(f'{shown} is a {type(obj).__name__}, not a class')
    return obj
  raise ParamsError(
      f'{shown}: no module of it is imported or under {_PACKAGE}. A params '
      'text never imports other modules (that would run their code); '
      'import the module in your program before reading the params')


def _module(name: str, shown: str) -> Any:
  """sys.modules[name], or lingvo_pipe's module `name` imported; else None."""
  if name in sys.modules:
    return sys.modules[name]  # None for a module whose import failed.
  if name != _PACKAGE and not name.startswith(_PACKAGE + '.'):
    return None
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and (name + '.').startswith(e.name + '.'):
      return None  # No such module: a shorter cut may be the module.
    raise ParamsError(f'{shown}: importing {name} failed: {e}') from None
  except Exception as e:  # pylint: disable=broad-except
    raise ParamsError(f'{shown}: importing {name} failed: '
                      f'{type(e).__name__}: {e}') from None
