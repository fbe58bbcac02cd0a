"""Tied weights: one weight that two layers of a pipeline share.

A Transformer language model reads its input embedding table [V, D] again,
transposed, as its softmax weights [D, V], and the two layers sit on the
first and the last stage. The pipeline's Params say so, and params.txt
shows it:

    p.tied_weights = [tied_weights.tie('softmax.softmax.w', 'emb.emb.emb',
                                       transpose=True)]

Both are paths below the pipeline: layer name, child layers, variable. The
owner's layer comes earlier in `p.layers`. What a tie means:

* In one process (any K) there is one variable, the owner's. The sharing
  layer's theta holds it too, read on that layer's own stage device, so its
  gradient is the sum of both uses, and a checkpoint holds it once, under
  the owner's path.
* With stage processes, the process of a sharing stage holds a *copy*,
  initialised from the owner's path and seed (the owner's layer is built
  there once to read its initial value, then dropped). Every step, each
  copy's gradient becomes the sum over all copies, both owning stages and
  every replica (`engine._tied_sums`), so the copies take the same update
  and stay bit-identical. A copy is left out of its process's checkpoint
  shard, its optimizer slots too, and out of the global gradient norm (the
  owner counts it once); a restore reads the owner's entries into it, so a
  run resumes on any K or R.
* The sharing layer's FPropMeta still counts the weight, so the partitioner
  and the memory preflight see the copy that its stage holds.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import base_layer
from lingvo_pipe.core import checkpoints
from lingvo_pipe.core import optimizer as optimizer_lib
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.core.nested_map import NestedMap


class TieError(errors.LingvoPipeError):
  """A tie to a missing layer or weight, or between two shapes."""


def tie(weight: str, owner: str, transpose: bool = False) -> Params:
  """One entry of a pipeline's `tied_weights`."""
  p = Params()
  p.Define('weight', weight, 'The shared weight, a path below the pipeline: '
           'layer name, child layers, variable (e.g. softmax.softmax.w).')
  p.Define('owner', owner, 'The weight it is, in an earlier layer (e.g. '
           'emb.emb.emb); checkpoints keep it once, under this path.')
  p.Define('transpose', transpose, 'The shared weight is the owner '
           'transposed: a softmax [D, V] tied to an embedding [V, D].')
  return p


@dataclasses.dataclass(frozen=True)
class _Tie:
  """One resolved entry: where both weights are, by layer index."""
  where: str  # '<pipeline>.tied_weights[i]', for messages.
  weight: str
  owner: str
  transpose: bool
  user_layer: int
  owner_layer: int

  def names(self) -> str:
    return f'{self.weight!r} (tied to {self.owner!r})'


def _split(path: Any) -> list[str]:
  parts = path.split('.') if isinstance(path, str) else []
  return parts if len(parts) >= 2 and all(parts) else []


def resolve(specs: Sequence[Params], names: Sequence[str],
            where: str) -> list[_Tie]:
  """Checks p.tied_weights against the layer names; refuses one line each."""
  ties, seen = [], set()
  for i, spec in enumerate(specs):
    at = f'{where}.tied_weights[{i}]'
    paths = [getattr(spec, k, None) for k in ('weight', 'owner')]
    if not all(_split(x) for x in paths):
      raise TieError(f'{at}: weight {paths[0]!r} and owner {paths[1]!r} must '
                     'each be <layer name>.<child>….<variable>, e.g. '
                     "tied_weights.tie('softmax.softmax.w', 'emb.emb.emb').")
    layers = []
    for path in paths:
      name = _split(path)[0]
      if name not in names:
        raise TieError(f'{at}: {paths[0]!r} is tied to {paths[1]!r}, but the '
                       f'pipeline has no layer {name!r}; name one of '
                       f'{", ".join(names)}.')
      layers.append(list(names).index(name))
    if layers[1] >= layers[0]:
      raise TieError(f'{at}: {paths[0]!r} is tied to {paths[1]!r} of layers['
                     f'{layers[1]}], which is not an earlier layer than '
                     f'layers[{layers[0]}]; the owner comes first in '
                     'p.layers: swap weight and owner.')
    if paths[0] in seen or paths[1] in {t.weight for t in ties}:
      raise TieError(f'{at}: {paths[0]!r} or {paths[1]!r} is already the '
                     'shared weight of another tie; tie every sharer to '
                     'the one owner.')
    seen.add(paths[0])
    ties.append(_Tie(at, paths[0], paths[1], bool(spec.transpose), *layers))
  return ties


def _below(path: str) -> str:
  """A tie path below its layer: its key in the layer's theta."""
  return '.'.join(_split(path)[1:])


def _layer_and_var(pipeline_path: str, path: str) -> tuple[str, str]:
  parts = _split(path)
  return f'{pipeline_path}.{".".join(parts[:-1])}', parts[-1]


class TiedWeights:
  """The ties of one pipeline in this process: its variables and copies."""

  def __init__(self, ties: list[_Tie], pipeline_path: str) -> None:
    self.ties = ties
    self._path = pipeline_path
    self.variables: dict[str, tf.Variable] = {}  # Owner path → this one.
    self.copies: dict[str, tf.Variable] = {}  # Not owned here, nor saved.
    self._full = {t.weight: '/'.join(_layer_and_var(pipeline_path, t.weight))
                  for t in ties}
    self._full.update({t.owner: '/'.join(_layer_and_var(pipeline_path,
                                                         t.owner))
                       for t in ties})
    self._made: set[str] = set()

  @property
  def path(self) -> str:
    """The pipeline's path."""
    return self._path

  def creator(self, probe: Callable[[int], base_layer.BaseLayer]
             ) -> base_layer.VariableCreator:
    """For `base_layer.sharing_variables` while the pipeline builds its
    layers; `probe(i)` builds layer i standalone (for a copy's value)."""
    owners = {self._full[t.owner]: t for t in self.ties}
    users = {self._full[t.weight]: t for t in self.ties}

    def create(layer: Any, name: str, wp: Params,
               make: Callable[[], tf.Variable]) -> tuple[tf.Variable, bool]:
      full = f'{layer.path}/{name}'
      if full in owners:
        self._made.add(full)
        self.variables[owners[full].owner] = var = make()
        return var, True
      if full not in users:
        return make(), True
      t = users[full]
      self._made.add(full)
      if t.owner not in self.variables:  # The owner runs elsewhere.
        self.variables[t.owner] = self.copies[t.owner] = self._copy(t,
                                                                    probe)
      var = self.variables[t.owner]
      _check_shape(t, [int(d) for d in wp.shape], wp.dtype or
                   layer.params.dtype, var)
      return var, False
    return create

  def _copy(self, t: _Tie, probe: Callable[[int], base_layer.BaseLayer]
           ) -> tf.Variable:
    """The owner's variable as its own layer makes it (path, seed, init)."""
    with base_layer.sharing_variables(None):
      layer = probe(t.owner_layer)
    path, name = _layer_and_var(self._path, t.owner)
    for sub in layer.Walk():
      if sub.path == path and name in sub.vars:
        return sub.vars[name]
    raise TieError(f'{t.where}: {t.names()}: the owner names no variable '
                   f'of layer {path} (which has '
                   f'{_variables_of(layer, path)}); fix the path.')

  def check_built(self, is_local: Callable[[int], bool],
                  layers: Sequence[base_layer.BaseLayer]) -> None:
    """Refuses a tie whose weight or owner names no variable."""
    for t in self.ties:
      for path, i in ((t.weight, t.user_layer), (t.owner, t.owner_layer)):
        if is_local(i) and self._full[path] not in self._made:
          layer_path, _ = _layer_and_var(self._path, path)
          raise TieError(f'{t.where}: {t.names()}: {path!r} names no '
                         f'variable of layer {layer_path} (which has '
                         f'{_variables_of(layers[i], layer_path)}); fix '
                         'the path.')

  def view(self, i: int, theta: NestedMap) -> NestedMap:
    """Layer i's theta as it reads it: transposed ties transposed."""
    keys = {_below(t.weight) for t in self.ties
            if t.user_layer == i and t.transpose}
    if not keys:
      return theta
    return NestedMap(theta).TransformWithKey(
        lambda k, v: tf.transpose(v) if k in keys else v)

  def leaves(self, first_layer: int, thetas: Sequence[NestedMap]
            ) -> list[tuple[int, str]]:
    """(index in tf.nest.flatten(thetas), owner path) of each tied weight
    in the thetas of layers first_layer, first_layer + 1, … ."""
    where = {f'{t.owner_layer}:{_below(t.owner)}': t.owner for t in self.ties}
    where.update({f'{t.user_layer}:{_below(t.weight)}': t.owner
                  for t in self.ties})
    marked = [NestedMap(th).TransformWithKey(lambda k, _, i=i: f'{i}:{k}')
              for i, th in enumerate(thetas, start=first_layer)]
    return [(j, where[key]) for j, key in enumerate(tf.nest.flatten(marked))
            if key in where]

  def owning_layers(self, owner: str) -> list[int]:
    return sorted({t.owner_layer for t in self.ties if t.owner == owner} |
                  {t.user_layer for t in self.ties if t.owner == owner})


def _check_shape(t: _Tie, shape: list[int], dtype: tf.DType,
                 var: tf.Variable) -> None:
  owner = var.shape.as_list()
  want = owner[::-1] if t.transpose else owner
  if shape != want or tf.as_dtype(dtype) != var.dtype:
    seen = f' (transposed: {want})' if t.transpose else ''
    raise TieError(f'{t.where}: {t.weight!r} is {tf.as_dtype(dtype).name} '
                   f'{shape} but {t.owner!r} is {var.dtype.name} {owner}'
                   f'{seen}; tie weights of one shape and dtype (transpose='
                   'True for [D, V] and [V, D]).')


def _variables_of(layer: base_layer.BaseLayer, path: str) -> list[str]:
  for sub in layer.Walk():
    if sub.path == path:
      return sorted(sub.vars)
  return []


# ---- Around the trainer -----------------------------------------------------
def _all(task: Any) -> list[TiedWeights]:
  return [t for layer in task.Walk()
          if isinstance(t := getattr(layer, 'tied', None), TiedWeights)]


def copies_in(task: Any) -> list[tf.Variable]:
  """The variables of `task` that are copies of another process's weight."""
  return [v for ties in _all(task) for v in ties.copies.values()]


def _tracked(segments: Iterable[str], leaf: Any) -> tf.Module:
  """Modules tracking `leaf` under the checkpoint path `segments` (a child
  list's 'layers[3]' is tracked as 'layers_3')."""
  node = leaf
  for seg in reversed(list(segments)):
    parent = tf.Module()
    parent._track_trackable(  # pylint: disable=protected-access
        node, name=re.sub(r'\[(\d+)\]$', r'_\1', seg))
    node = parent
  return node


def restore_copies(path: str, task: Any, optimizer: Any,
                   task_key: str = 'task') -> None:
  """Reads the owner's weight and slots of checkpoint `path` into each copy.

  The checkpoint is the trainer's (`task` tracked as `task_key`, the
  optimizer as 'optimizer'); whole or stage shards, the owner's entries are
  in one of its files.
  """
  for ties in _all(task):
    for owner, var in ties.copies.items():
      layer_path, name = _layer_and_var(ties.path, owner)
      segments = layer_path.split('.')[1:] + [name]  # Below the task.
      if not any(_restored(prefix, segments, task_key, var, optimizer)
                 for prefix in checkpoints.files_of(path)):
        raise checkpoints.CheckpointError(
            f'{path} holds no {owner!r} for the tied weight this process '
            'copies; resume from a checkpoint of this model (with the same '
            'tied_weights).')


def _restored(prefix: str, segments: list[str], task_key: str,
              var: tf.Variable, optimizer: Any) -> bool:
  slots_node = tf.Module()
  slots_node._slots = {  # pylint: disable=protected-access
      optimizer_lib.slot_key(var): dict(optimizer.slots(var))}
  mirror = tf.train.Checkpoint(**{task_key: _tracked(segments, var),
                                  'optimizer': slots_node})
  status = mirror.restore(prefix)
  status.expect_partial()
  try:
    status.assert_existing_objects_matched()
  except AssertionError:
    return False
  return True
