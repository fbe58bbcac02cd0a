"""Stage-boundary transfers between stage processes, in a loop or not.

A SEND or RECV action moves one stage boundary of one micro-batch between
two processes over TF's collective runtime (`collective.py`). TF matches a
collective by (group, instance key, frame, iteration): inside a
`tf.while_loop` a send would match only a recv in an identically named
frame at the same iteration, and the two processes build different loops
(each emits its own stages). So each transfer runs in a function call of
its own (`_noinline`), whose body TF runs at the root frame, and its
instance key is a tensor that carries the micro-batch index: the transfer
of (direction, stage, leaf, micro-batch) has the same key in any loop
iteration, or outside any loop, of either process.

Instance keys of transfers are [2³⁰, 2³¹) (the other collectives' digests
are below): 2³⁰ + ((stage · 2 + direction) · MAX_LEAVES + leaf) · 2¹² + m,
so two transfers never share a key, and nothing needs a collision check.

    token = send(peers, y, to_task=1, direction='F', stage=1, index=m)
    x = recv(peers, spec, from_task=0, direction='F', stage=1, index=m,
             after=[previous_action_outputs])

`after` orders the recv: its call takes those tensors as inputs and waits
on them, so it is posted once the device's previous action has finished
(as data: Grappler dropped such control edges in the outer graph).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from lingvo_pipe.pipeline import collective
from lingvo_pipe.pipeline import dependency

__all__ = ['MAX_LEAVES', 'MAX_MICRO_BATCHES', 'recv', 'send']

_BASE = 1 << 30
_INDEX_BITS = 12
MAX_MICRO_BATCHES = 1 << _INDEX_BITS  # Per replica and step.
MAX_LEAVES = 256  # Tensors in one boundary.
_DIRECTIONS = ('F', 'B')  # F: activations forward; B: gradients backward.
_CALLS: dict[tuple[Any, ...], Any] = {}


def _instance(direction: str, stage: int, leaf: int) -> int:
  """The base instance key of one leaf of a boundary (+ m per micro-batch)."""
  slot = (stage * 2 + _DIRECTIONS.index(direction)) * MAX_LEAVES + leaf
  if leaf >= MAX_LEAVES or slot >= 1 << (30 - _INDEX_BITS):
    raise collective.CollectiveError(
        f'Stage {stage}\'s boundary has {leaf + 1} tensors (at most '
        f'{MAX_LEAVES}) or the pipeline more than '
        f'{(1 << (30 - _INDEX_BITS)) // (2 * MAX_LEAVES)} stages; pack the '
        'boundary into fewer tensors.')
  return _BASE + (slot << _INDEX_BITS)


def _describe(direction: str, stage: int, leaf: int, src: int,
              dst: int) -> str:
  what = 'activations into' if direction == 'F' else 'gradients out of'
  return (f'transfer of {what} stage {stage} (leaf {leaf}) from task {src} '
          f'to task {dst}')


def _register(peers: collective.Peers, direction: str, stage: int,
              leaves: Sequence[int], src: int, dst: int,
              index: Any) -> tuple[int, list[int]]:
  group = peers.group_of((src, dst))
  bases = []
  for leaf in leaves:
    base = _instance(direction, stage, leaf)
    use = index if isinstance(index, int) else ('tensor', id(index))
    peers.register(group, base, _describe(direction, stage, leaf, src, dst),
                   (src, dst), use)
    bases.append(base)
  return group, bases


def _index(index: Any) -> tf.Tensor:
  if isinstance(index, int):
    if not 0 <= index < MAX_MICRO_BATCHES:
      raise collective.CollectiveError(
          f'Micro-batch {index} is out of range: a step runs at most '
          f'{MAX_MICRO_BATCHES} micro-batches per replica.')
    return dependency.index(index)
  return tf.cast(index, tf.int32)


def send(peers: collective.Peers, value: Any, to_task: int, direction: str,
         stage: int, index: Any) -> tf.Tensor | None:
  """Sends the nest `value` (None leaves skipped); returns a token that
  exists once `to_task` has received it (None eagerly). Nothing should wait
  on the token but the step's end: a send completes only once its receiver
  posts the recv."""
  xs = [tf.convert_to_tensor(x) for x in tf.nest.flatten(value)
        if x is not None]
  if not xs:
    return None
  key = (direction, stage)
  wires = tuple(collective.wire_dtype(x.dtype, key) for x in xs)
  group, bases = _register(peers, direction, stage, range(len(xs)),
                           peers.task, to_task, index)
  fn = _call(('send', peers.device, group, tuple(bases), wires,
              peers.op_timeout()), _make_send)
  with tf.device(peers.device):
    token = fn(_index(index), *[tf.cast(x, w) if x.dtype != w else x
                                for x, w in zip(xs, wires)])
  dependency.independent([token])
  return token


def recv(peers: collective.Peers, spec: Any, from_task: int, direction: str,
         stage: int, index: Any, after: Sequence[tf.Tensor] = ()) -> Any:
  """Receives what `from_task` sent for (direction, stage, index), as the
  nest `spec` (full static shapes; None where the sender had None), posted
  once every tensor of `after` exists."""
  specs = tf.nest.flatten(spec)
  present = [s for s in specs if s is not None]
  key = (direction, stage)
  for leaf, s in enumerate(present):
    if not tf.TensorShape(s.shape).is_fully_defined():
      raise collective.CollectiveError(
          f'Stage {stage}\'s boundary (leaf {leaf}) has shape {s.shape}, '
          'which is not fully defined; stage processes exchange tensors of '
          'static shapes.')
  if not present:
    return tf.nest.pack_sequence_as(spec, specs)
  shapes = tuple(tuple(tf.TensorShape(s.shape).as_list()) for s in present)
  dtypes = tuple(tf.as_dtype(s.dtype) for s in present)
  wires = tuple(collective.wire_dtype(d, key) for d in dtypes)
  group, bases = _register(peers, direction, stage, range(len(present)),
                           from_task, peers.task, index)
  fn = _call(('recv', peers.device, group, tuple(bases), shapes, wires,
              peers.op_timeout()), _make_recv)
  with tf.device(peers.device):
    got = fn(_index(index), *[t for t in after if t is not None])
  if not isinstance(got, (list, tuple)):
    got = [got]
  dependency.independent(got)
  it = iter(tf.cast(g, d) if g.dtype != d else g for g, d in zip(got, dtypes))
  return tf.nest.pack_sequence_as(
      spec, [None if s is None else next(it) for s in specs])


def _call(key: tuple[Any, ...], make: Any) -> Any:
  if key not in _CALLS:
    _CALLS[key] = tf.function(make(*key[1:]), autograph=False,
                              experimental_attributes={'_noinline': True})
  return _CALLS[key]


def _make_send(device: str, group: int, bases: tuple[int, ...],
               wires: tuple[tf.DType, ...], timeout: float) -> Any:
  del wires  # Part of the cache key: the inputs arrive cast.

  def _send(index: tf.Tensor, *xs: tf.Tensor) -> tf.Tensor:
    with tf.device(device):
      ops = [tf.raw_ops.CollectiveBcastSendV2(
          input=x, group_size=2, group_key=group,
          instance_key=base + index, timeout_seconds=timeout,
          name=f'lp_send_g{group}_i{base}') for x, base in zip(xs, bases)]
      with tf.control_dependencies(ops):
        return tf.constant(True)
  return _send


def _make_recv(device: str, group: int, bases: tuple[int, ...],
               shapes: tuple[tuple[int, ...], ...],
               wires: tuple[tf.DType, ...], timeout: float) -> Any:

  def _recv(index: tf.Tensor, *after: tf.Tensor) -> list[tf.Tensor]:
    with tf.device(device), tf.control_dependencies(after):
      got = [tf.raw_ops.CollectiveBcastRecvV2(
          group_size=2, group_key=group, instance_key=base + index,
          shape=list(shape), T=wire, timeout_seconds=timeout,
          name=f'lp_recv_g{group}_i{base}')
             for base, shape, wire in zip(bases, shapes, wires)]
    # Each output waits for every recv: Grappler prunes a called function's
    # unused outputs, and a pruned recv leaves its sender waiting forever.
    with tf.device(device), tf.control_dependencies(got):
      return [tf.identity(g) for g in got]
  return _recv
