"""NestedMap: a dict with attribute access that `tf.nest` understands.

Thetas, batches and stage activations are trees of tensors. A plain dict
works with `tf.nest` but reads badly (`theta['fc']['w']`); a NestedMap reads
like the layer tree it mirrors (`theta.fc.w`) and, being a dict subclass,
flattens and packs with `tf.nest` (keys in sorted order), so it can cross
`tf.function`, `tf.custom_gradient` and pipeline-stage boundaries unchanged.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Iterator

import tensorflow as tf


class NestedMap(dict):
  """A dict whose string keys are also attributes.

  >>> m = NestedMap(w=1, child=NestedMap(b=2))
  >>> m.child.b
  2
  >>> sorted(m.FlattenItems())
  [('child.b', 2), ('w', 1)]
  """

  _RESERVED = frozenset(dir(dict))  # Plus NestedMap's own; see below.

  def __init__(self, *args: Any, **kwargs: Any) -> None:
    super().__init__(*args, **kwargs)
    for key in self:
      self._CheckKey(key)

  @classmethod
  def _CheckKey(cls, key: Any) -> None:
    if not isinstance(key, str) or not key.isidentifier():
      raise ValueError(f'NestedMap keys must be identifiers, got {key!r}.')
    if key in cls._RESERVED:
      raise ValueError(
          f'NestedMap key {key!r} shadows a NestedMap (dict) method; '
          'rename it.')

  def __setitem__(self, key: str, value: Any) -> None:
    self._CheckKey(key)
    super().__setitem__(key, value)

  def __getattr__(self, name: str) -> Any:
    try:
      return self[name]
    except KeyError:
      if name.startswith('__'):  # Protocol probes (hasattr), not typos:
        raise AttributeError(name) from None  # tracing makes thousands.
      close = difflib.get_close_matches(name, list(self.keys()), n=3)
      hint = f' Did you mean {", ".join(close)}?' if close else ''
      raise AttributeError(
          f'NestedMap has no key {name!r} (keys: {sorted(self.keys())}).'
          f'{hint}') from None

  def __setattr__(self, name: str, value: Any) -> None:
    self[name] = value

  def __delattr__(self, name: str) -> None:
    try:
      del self[name]
    except KeyError:
      raise AttributeError(name) from None

  def copy(self) -> 'NestedMap':  # Shallow, keeps the type.
    return NestedMap(self)

  def DeepCopy(self) -> 'NestedMap':
    """Copies every nested NestedMap/list; leaves are shared."""
    return tf.nest.map_structure(lambda x: x, self)

  def Flatten(self) -> list[Any]:
    """Leaves in `tf.nest` order."""
    return tf.nest.flatten(self)

  def FlattenItems(self) -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs, e.g. ('child.w', v) or ('layers[1].b', v)."""
    return list(_items(self, ''))

  def Pack(self, leaves: list[Any]) -> 'NestedMap':
    """The same structure with `leaves` (in `Flatten` order) as leaves."""
    return tf.nest.pack_sequence_as(self, leaves)

  def Transform(self, fn: Callable[[Any], Any]) -> 'NestedMap':
    """Applies `fn` to every leaf."""
    return tf.nest.map_structure(fn, self)

  def Get(self, path: str, default: Any = None) -> Any:
    """The value at dotted `path` ('a.b', 'layers[1].b'), else `default`."""
    try:
      return self.GetItem(path)
    except KeyError:
      return default

  def Has(self, path: str) -> bool:
    """Whether dotted `path` names an entry."""
    try:
      self.GetItem(path)
      return True
    except KeyError:
      return False

  def Set(self, path: str, value: Any) -> 'NestedMap':
    """Sets dotted `path` to `value`, creating NestedMaps on the way, as
    Lingvo's `Set`: 'a.b.c', or with list items 'a[0].b' (a list is created
    if missing; an index may be at most the list's length, which appends).
    Returns self.

    Raises:
      ValueError: a part of the path holds a non-dict value, or an index is
        past the end of its list.
    """
    node: Any = self
    parts = path.split('.')
    for depth, part in enumerate(parts):
      m = re.fullmatch(r'([^\[\]]+)(?:\[(\d+)\])?', part)
      key, index = (m.group(1), m.group(2)) if m else (part, None)
      NestedMap._CheckKey(key)
      last = depth == len(parts) - 1
      if index is None:
        if last:
          node[key] = value
          break
        node = node.setdefault(key, NestedMap())
      else:
        items = node.setdefault(key, [])
        i = int(index)
        if not isinstance(items, list) or i > len(items):
          size = len(items) if isinstance(items, list) else 'not a list'
          raise ValueError(f'NestedMap.Set({path!r}): {part} is past the end '
                           f'of {key!r} ({size}); set the items before it.')
        if i == len(items):
          items.append(None if last else NestedMap())
        if last:
          items[i] = value
          break
        if items[i] is None:
          items[i] = NestedMap()
        node = items[i]
      if not isinstance(node, dict):
        raise ValueError(
            f'NestedMap.Set({path!r}): {".".join(parts[:depth + 1])!r} holds '
            f'a {type(node).__name__}, not a NestedMap; set a path whose '
            'parts are all maps.')
    return self

  def TransformWithKey(self, fn: Callable[[str, Any], Any]) -> 'NestedMap':
    """Applies `fn(path, leaf)` to every leaf (paths as in FlattenItems)."""
    leaves = [fn(path, leaf) for path, leaf in self.FlattenItems()]
    return self.Pack(leaves)

  def IsCompatible(self, other: 'NestedMap') -> bool:
    """Whether `other` has the same paths, so that Pack/Flatten swap them."""
    return ([k for k, _ in self.FlattenItems()] ==
            [k for k, _ in NestedMap(other).FlattenItems()])

  @staticmethod
  def FromNestedDict(x: Any) -> Any:
    """`x` with every dict in it (nested in dicts, lists, tuples) a
    NestedMap."""
    if isinstance(x, dict):
      return NestedMap({k: NestedMap.FromNestedDict(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
      return type(x)(NestedMap.FromNestedDict(v) for v in x)
    return x

  def Filter(self, fn: Callable[[Any], bool]) -> 'NestedMap':
    """A copy with only the leaves where `fn(leaf)` holds (see FilterKeyVal)."""
    return self.FilterKeyVal(lambda _, value: fn(value))

  def FilterKeyVal(self, fn: Callable[[str, Any], bool]) -> 'NestedMap':
    """A copy with only the leaves where `fn(path, leaf)` holds.

    Paths are `FlattenItems`'. A map or list that loses all its entries to
    the filter is dropped too; one that was empty already is kept (Lingvo's
    rule).
    """
    kept = _filter(self, '', fn)
    return NestedMap() if kept is _DELETED else kept

  def Union(self, other: dict) -> 'NestedMap':
    """A new map with the entries of both; nested maps merge, and where both
    hold a leaf (or list) at the same path, `other`'s wins."""
    out = NestedMap(self)
    for key, value in other.items():
      mine = out.get(key)
      if isinstance(mine, dict) and isinstance(value, dict):
        out[key] = NestedMap(mine).Union(value)
      else:
        out[key] = value
    return out

  def GetItem(self, path: str) -> Any:
    """The leaf or subtree at a `FlattenItems` path: 'fc.w', 'layers[1].b'.

    Raises:
      KeyError: no such path; the message names the missing part.
    """
    node: Any = self
    for token in re.findall(r'[^.\[\]]+|\[\d+\]', path):
      if token.startswith('['):
        index = int(token[1:-1])
        if not isinstance(node, (list, tuple)) or index >= len(node):
          size = len(node) if isinstance(node, (list, tuple)) else 'n/a'
          raise KeyError(f'{path!r}: {token} is not an index of this '
                         f'{type(node).__name__} (length {size}).')
        node = node[index]
      elif isinstance(node, dict) and token in node:
        node = node[token]
      else:
        keys = sorted(node) if isinstance(node, dict) else []
        close = difflib.get_close_matches(token, keys, n=3)
        hint = f' Did you mean {", ".join(close)}?' if close else ''
        raise KeyError(f'{path!r}: no key {token!r} (keys: {keys}).{hint}')
    return node


# Keys that a method would shadow: m.Flatten must stay the method.
NestedMap._RESERVED = frozenset(dir(NestedMap))  # pylint: disable=W0212


_DELETED = object()  # FilterKeyVal: this entry, and so maybe its parent, goes.


def _filter(node: Any, path: str, fn: Callable[[str, Any], bool]) -> Any:
  """FilterKeyVal's recursion: the filtered copy of `node`, or _DELETED."""
  if isinstance(node, dict):
    out, deleted = NestedMap() if isinstance(node, NestedMap) else {}, False
    for key in sorted(node):
      kept = _filter(node[key], f'{path}.{key}' if path else key, fn)
      if kept is _DELETED:
        deleted = True
      else:
        out[key] = kept
  elif isinstance(node, (list, tuple)):
    items, deleted = [], False
    for i, item in enumerate(node):
      kept = _filter(item, f'{path}[{i}]', fn)
      if kept is _DELETED:
        deleted = True
      else:
        items.append(kept)
    if hasattr(node, '_fields') and len(items) == len(node):
      out = node._make(items)  # A namedtuple keeps its type if whole.
    else:
      out = tuple(items) if isinstance(node, tuple) else items
  else:
    return node if fn(path, node) else _DELETED
  return _DELETED if deleted and not out else out


def _items(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
  if isinstance(node, dict):
    for key in sorted(node):
      yield from _items(node[key], f'{prefix}.{key}' if prefix else key)
  elif isinstance(node, (list, tuple)):
    for i, item in enumerate(node):
      yield from _items(item, f'{prefix}[{i}]')
  else:
    yield prefix, node
