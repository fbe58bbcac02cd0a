"""Cutting a mini-batch into micro-batches and gluing outputs back.

Activations crossing a stage boundary may be any nest of tensors (a
Transformer's (x, paddings), a skip tensor carried past several layers);
every leaf must carry the batch on `batch_dim`. The split is a plain slice,
so example i of the mini-batch is example i mod n of micro-batch i // n
(n = N / M), the order the dropout masks and the loss rely on.

A None leaf (Lingvo's `NestedMap(vec=x, paddings=None)`) is no tensor: it
carries no batch and has no gradient, and a `tf.custom_gradient` cannot take
it as an argument. `hide_none` turns each None into an empty structure,
which `tf.nest` flattens to nothing, so the engine never sees it;
`show_none` gives the layers their None back.
"""

from __future__ import annotations

import collections
from typing import Any

import tensorflow as tf

from lingvo_pipe import errors


class MicroBatchError(errors.LingvoPipeError):
  """The batch cannot be split as asked; the message names the fix."""


def batch_size(inputs: Any, batch_dim: int, where: str) -> int | tf.Tensor:
  """The common batch size of every leaf of `inputs` (static if known)."""
  leaves = [x for x in tf.nest.flatten(inputs) if x is not None]
  if not leaves:
    raise MicroBatchError(f'{where}: the pipeline got no input tensors.')
  sizes = set()
  for i, leaf in enumerate(leaves):
    shape = tf.TensorShape(getattr(leaf, 'shape', []))  # numpy too
    if shape.rank is not None and shape.rank <= batch_dim:
      raise MicroBatchError(
          f'{where}: input leaf {i} has shape {shape}, which has no '
          f'batch dimension {batch_dim}. Every tensor that crosses a '
          'pipeline boundary must carry the batch; set p.batch_dim or '
          'broadcast the tensor over the batch.')
    sizes.add(shape[batch_dim] if shape.rank is not None else None)
  static = {s for s in sizes if s is not None}
  if len(static) > 1:
    raise MicroBatchError(
        f'{where}: input leaves disagree on the batch size along dim '
        f'{batch_dim}: {sorted(static)}.')
  if static and None not in sizes:
    return static.pop()
  return tf.shape(leaves[0])[batch_dim]


# Where a None leaf was: a structure with no leaves (see the docstring).
_NoneLeaf = collections.namedtuple('_NoneLeaf', [])


def hide_none(nest: Any) -> Any:
  """`nest` with every None leaf replaced by a structure with no leaves."""
  return tf.nest.map_structure(lambda x: _NoneLeaf() if x is None else x,
                               nest)


def show_none(nest: Any) -> Any:
  """Inverse of `hide_none`: the None leaves back in place."""
  if isinstance(nest, _NoneLeaf):
    return None
  if isinstance(nest, dict):  # NestedMap too: rebuilt as tf.nest does.
    return type(nest)((k, show_none(v)) for k, v in nest.items())
  if isinstance(nest, tuple) and hasattr(type(nest), '_fields'):
    return type(nest)(*(show_none(v) for v in nest))
  if isinstance(nest, (list, tuple)):
    return type(nest)(show_none(v) for v in nest)
  return nest


def num_micro_batches(batch_size: int | tf.Tensor, num_micro_batches: int,
                      micro_batch_size: int | None, where: str) -> int:
  """M from the params, checked against the batch size N."""
  if micro_batch_size is not None:
    if not isinstance(micro_batch_size, int) or isinstance(
        micro_batch_size, bool) or micro_batch_size < 1:
      raise MicroBatchError(
          f'{where}: micro_batch_size must be ≥ 1 (an int, or None to use '
          f'num_micro_batches), got {micro_batch_size!r}.')
    if not isinstance(batch_size, int):
      raise MicroBatchError(
          f'{where}: micro_batch_size={micro_batch_size} needs a static batch '
          'size; set num_micro_batches instead.')
    if batch_size % micro_batch_size:
      raise MicroBatchError(
          f'{where}: batch size {batch_size} is not a multiple of '
          f'micro_batch_size={micro_batch_size}; use a batch size that is, '
          'or set num_micro_batches.')
    m = batch_size // micro_batch_size
    if num_micro_batches not in (1, m):
      raise MicroBatchError(
          f'{where}: micro_batch_size={micro_batch_size} gives '
          f'num_micro_batches={m} for batch size {batch_size}, but '
          f'num_micro_batches={num_micro_batches} is set too; set only one.')
    return m
  m = num_micro_batches
  if m < 1:
    raise MicroBatchError(f'{where}: num_micro_batches must be ≥ 1, got {m}.')
  if isinstance(batch_size, int):
    if m > batch_size:
      raise MicroBatchError(
          f'{where}: num_micro_batches={m} exceeds the batch size '
          f'{batch_size}; use num_micro_batches ≤ {batch_size}.')
    if batch_size % m:
      divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
      near = min(divisors, key=lambda d: abs(d - m))
      raise MicroBatchError(
          f'{where}: batch size {batch_size} is not divisible by '
          f'num_micro_batches={m}; use e.g. num_micro_batches={near} or a '
          f'batch size that is a multiple of {m}.')
  return m


def split(inputs: Any, num_micro_batches: int, batch_dim: int) -> list[Any]:
  """[N, ...] leaves → a list of M nests of [N/M, ...] leaves.

  One slice op per micro-batch, not one Split with M outputs: the engine
  orders micro-batch m+1 behind m with an identity that waits on m's
  outputs, and Grappler, removing that identity, moved its wait onto the
  identity's input; with one Split shared by every micro-batch that made a
  cycle (Split waits for F0, F0 reads Split) and Grappler gave up
  optimising the step ("couldn't be sorted in topological order").
  """
  if num_micro_batches == 1:
    return [inputs]
  return [one(inputs, num_micro_batches, batch_dim, m)
          for m in range(num_micro_batches)]


def one(inputs: Any, num_micro_batches: int, batch_dim: int, m: int) -> Any:
  """Micro-batch m of `split(inputs, ...)`: one slice op per leaf."""
  if num_micro_batches == 1:
    return inputs
  parts = []
  for x in tf.nest.flatten(inputs):
    if x is None:
      parts.append(None)
      continue
    x = tf.convert_to_tensor(x)
    n = x.shape[batch_dim]  # Static if known: the slice keeps it.
    size = (n // num_micro_batches if n is not None else
            tf.shape(x)[batch_dim] // num_micro_batches)
    begin = [0] * x.shape.rank
    begin[batch_dim] = m * size
    extent = [-1] * x.shape.rank
    extent[batch_dim] = size
    parts.append(tf.slice(x, tf.stack(begin), tf.stack(extent)) if
                 n is None else tf.slice(x, begin, extent))
  return tf.nest.pack_sequence_as(inputs, parts)


def stack(inputs: Any, num_micro_batches: int, batch_dim: int) -> Any:
  """[..., N, ...] leaves → [M, ..., N/M, ...]: row m is micro-batch m of
  `split` (a reshape and a transpose, for a loop to index)."""

  def _stack(x: Any) -> Any:
    if x is None:
      return None
    x = tf.convert_to_tensor(x)
    shape = tf.shape(x)
    split_shape = tf.concat([shape[:batch_dim], [num_micro_batches, -1],
                             shape[batch_dim + 1:]], 0)
    rank = x.shape.rank
    perm = [batch_dim] + [i for i in range(rank + 1) if i != batch_dim]
    stacked = tf.transpose(tf.reshape(x, split_shape), perm)
    # The shape `one` gives a micro-batch (a loop carries values read from
    # here beside values sliced by `one`, and their shapes must agree).
    micro = x.shape.as_list()
    n = micro[batch_dim]
    micro[batch_dim] = None if n is None else n // num_micro_batches
    stacked.set_shape([num_micro_batches] + micro)
    return stacked
  return tf.nest.map_structure(_stack, inputs)


def unstack(stacked: Any, batch_dim: int) -> Any:
  """Inverse of `stack`: [M, ..., n, ...] leaves → [..., M·n, ...]."""

  def _unstack(x: Any) -> Any:
    if x is None:
      return None
    rank = x.shape.rank
    perm = [i + 1 for i in range(batch_dim)] + [0] + list(
        range(batch_dim + 1, rank))
    moved = tf.transpose(x, perm)
    shape = tf.shape(moved)
    merged = tf.concat([shape[:batch_dim], [-1], shape[batch_dim + 2:]], 0)
    return tf.reshape(moved, merged)
  return tf.nest.map_structure(_unstack, stacked)


def concat(micro_outputs: list[Any], batch_dim: int) -> Any:
  """Inverse of `split`: a list of M nests → one nest of [N, ...] leaves."""
  if len(micro_outputs) == 1:
    return micro_outputs[0]
  flat = [tf.nest.flatten(o) for o in micro_outputs]
  check_batched(micro_outputs[0], batch_dim)
  # None leaves (the gradient of an integer input, say) stay None.
  joined = [None if parts[0] is None else tf.concat(list(parts), batch_dim)
            for parts in zip(*flat)]
  return tf.nest.pack_sequence_as(micro_outputs[0], joined)


def check_batched(micro_output: Any, batch_dim: int) -> None:
  """Raises unless every leaf of one micro-batch's output has `batch_dim`."""
  for i, leaf in enumerate(tf.nest.flatten(micro_output)):
    if leaf is not None and leaf.shape.rank is not None and (
        leaf.shape.rank <= batch_dim):
      what = 'is a scalar' if leaf.shape.rank == 0 else (
          f'has shape {leaf.shape}, no batch dimension {batch_dim}')
      raise MicroBatchError(
          f'Pipeline output leaf {i} {what}, so micro-batch outputs cannot '
          'be concatenated. Keep the batch dimension in the last stage (e.g. '
          'return per-example losses and reduce them outside the pipeline).')


class MicroBatches:
  """The micro-batches of a nest, sliced when asked: emitting actions one
  by one slices the ones it reads, and a loop indexes the whole nest
  stacked (so neither costs a slice per micro-batch it does not read)."""

  def __init__(self, whole: Any, num_micro_batches: int, batch_dim: int,
               device: str) -> None:
    self.whole = whole
    self.num = num_micro_batches
    self.batch_dim = batch_dim
    self.device = device
    self._parts: dict[int, Any] = {}

  def __len__(self) -> int:
    return self.num

  def __getitem__(self, m: int) -> Any:
    if m not in self._parts:
      with tf.device(self.device):
        self._parts[m] = one(self.whole, self.num, self.batch_dim, m)
    return self._parts[m]

  def stacked(self) -> Any:
    """[M, ..., N/M, ...] per leaf: row m is micro-batch m."""
    with tf.device(self.device):
      return stack(self.whole, self.num, self.batch_dim)
