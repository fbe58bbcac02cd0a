"""FromText's parser: applies `path : value` lines to a Params tree.

`Params.FromText` is the one door for text into a tree (the trainer's
--model_params_override, the params.txt of a logdir), so it must turn any
text into either a changed tree or a ParamsError that names the line. The
value rule lives in `params_text`; this module resolves each line's path and
handles the two lines that build structure rather than set a value:
`x : list(len=N)` (resize a list of Params) and `x.cls : type/...` /
`x : Params()` (build Params where there was None).
"""

from __future__ import annotations

import re
from typing import Any

from lingvo_pipe.core import hyperparams
from lingvo_pipe.core import params_literal
from lingvo_pipe.core import params_text
from lingvo_pipe.core.params_text import ParamsError

_LIST_HEADER = re.compile(r'^(list|tuple)\(len=(\d{1,9})\)$')


def apply_text(params: hyperparams.Params, text: str) -> None:
  """Applies the lines of `text` to `params`: see `Params.FromText`."""
  if not isinstance(text, str):
    raise ParamsError(f'FromText needs a str, got {type(text).__name__}.')
  for raw in params_text.split_lines(text):
    line = raw.strip()
    if not line or line.startswith('#'):
      continue
    if ':' not in line:
      raise ParamsError(f'Malformed params line {_short(line)!r}: expected '
                        '"path : value", e.g. "task.train.learning_rate : '
                        '0.1".')
    path, text_value = (s.strip() for s in line.split(':', 1))
    try:
      _set_from_text(params, path, text_value)
    except ParamsError:
      raise
    except (RecursionError, MemoryError, OverflowError, IndexError,
            KeyError, TypeError, ValueError) as e:  # A last resort.
      raise ParamsError(
          f'Cannot apply params line {_short(line)!r}: '
          f'{type(e).__name__}: {_short(str(e))}.') from None


def _short(text: str) -> str:
  return hyperparams._short(text)  # pylint: disable=protected-access


def _set_from_text(root: hyperparams.Params, path: str,
                   text_value: str) -> None:
  """One `path : value` line."""
  # pylint: disable=protected-access
  if path.endswith('.cls'):
    _set_class_from_text(root, path[:-len('.cls')], text_value)
    return
  parent, key, index = root._Walk(path, create=True)
  old, default = _old_and_default(parent, key, index)
  if text_value == hyperparams.BARE_PARAMS:
    if isinstance(old, hyperparams.Params):
      return  # Already Params: the lines that follow set its keys.
    _check_declared(parent, key, index, path, hyperparams.Params(),
                    text_value)
    if old is not None or default is not None:
      raise ParamsError(f'Param {path!r}: {hyperparams.BARE_PARAMS} cannot '
                        f'replace its {type(old).__name__} value {old!r}.')
    parent._SetIndexed(key, [] if index is None else [index],
                       hyperparams._OpenParams())
    return
  head = _LIST_HEADER.match(text_value)
  if head:
    _check_declared(parent, key, index, path, [], text_value)
    _set_list_from_header(parent, path, key, index, head, old, default)
    return
  suffix = '' if index is None else f'[{index}]'
  parent.Set(**{key + suffix: params_text.parse_value(
      text_value, old, path, default, _declared_type(parent, key, index))})


def _declared_type(node: hyperparams.Params, key: str,
                   index: int | None) -> Any:
  """`Define`'s value_type of key (None for a list element: any)."""
  if index is not None:
    return None
  return node._params[key].value_type  # pylint: disable=protected-access


def _check_declared(node: hyperparams.Params, key: str, index: int | None,
                    path: str, built: Any, text_value: str) -> None:
  """Refuses a line that would build a Params or list (`built`, an empty
  one) where Define declared another type (`random_seed : list(len=2)`)."""
  value_type = _declared_type(node, key, index)
  if value_type is not None and not params_text.holds(value_type, built):
    what = params_text.describe(value_type)
    raise ParamsError(f'Param {path!r}: {text_value} would make it a '
                      f'{type(built).__name__}, but it holds {what} or None; '
                      f'give {what}.')


def _old_and_default(node: hyperparams.Params, key: str,
                     index: int | None) -> tuple[Any, Any]:
  """The value at key[index] and its default (a list element's: itself)."""
  param = node._params[key]  # pylint: disable=protected-access
  if index is None:
    return param.value, param.default
  element = param.value[index]
  return element, element


def _set_list_from_header(node: hyperparams.Params, path: str, key: str,
                          index: int | None, head: re.Match, old: Any,
                          default: Any) -> None:
  """`x : list(len=N)`: resizes list x (new elements None) to N."""
  size, kind = int(head.group(2)), head.group(1)
  if size > params_literal.MAX_ITEMS:
    raise ParamsError(f'{path} : {head.group(0)}: {size:,} elements exceed '
                      f'the {params_literal.MAX_ITEMS:,} a params list may '
                      'have.')
  if not (isinstance(old, (list, tuple)) or old is None and (
      default is None)) or index is not None:
    raise ParamsError(f'Param {path!r}: {head.group(0)} cannot replace its '
                      f'{type(old).__name__} value {old!r}.')
  items = list(old) if isinstance(old, (list, tuple)) else []
  new = (items + [None] * size)[:size]
  setattr(node, key, tuple(new) if kind == 'tuple' else new)


def _set_class_from_text(root: hyperparams.Params, owner_path: str,
                         text_value: str) -> None:
  """`x.cls : type/...`: (re)builds x from the class's own Params()."""
  new_cls = params_text.parse_value(text_value, type, f'{owner_path}.cls')
  parent, key, index = root._Walk(owner_path, create=True)  # pylint: disable=protected-access
  owner, default = _old_and_default(parent, key, index)
  if (isinstance(owner, hyperparams.InstantiableParams) and
      owner.cls is new_cls):
    return
  _check_declared(parent, key, index, f'{owner_path}.cls',
                  hyperparams.Params(), text_value)
  if not (isinstance(owner, hyperparams.Params) or
          owner is None and default is None):
    raise ParamsError(f'{owner_path}.cls : {text_value}: {owner_path} holds '
                      f'a {type(owner).__name__} ({owner!r}), not Params.')
  try:
    new = new_cls.Params()  # type: ignore[union-attr]
  except Exception as e:  # pylint: disable=broad-except
    raise ParamsError(f'{owner_path}.cls : {text_value}: {new_cls!r} has no '
                      f'working Params() classmethod ({type(e).__name__}), '
                      'so it cannot be a params class.') from None
  if not isinstance(new, hyperparams.Params):
    raise ParamsError(f'{owner_path}.cls : {text_value}: its Params() '
                      f'returned a {type(new).__name__}, not Params.')
  suffix = '' if index is None else f'[{index}]'
  parent.Set(**{key + suffix: new})
