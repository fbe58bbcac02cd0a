"""Reading a traced stage graph for the input/weight split of its backward.

A stage's backward B computes two things: the gradient of its input (dx,
which the previous stage waits for) and the gradient of its weights (dθ,
which nothing waits for until the optimizer). Zero-bubble schedules run
them as two ops, I and W, W later. Asking one tape twice walks the chain of
activation gradients twice (I + W ≈ 1.5 B), and `tape.gradient(z, θ, dz)`
over a stack counts every weight again for each later activation that
depends on it. What W needs is only each weight's *local* part.

This module finds those parts in the graph of the stage's forward,
generically, with no help from the layers:

* **Weight-side tensors**: θ's leaves and everything computed from them
  alone (reads, casts, reshapes, constants). W recomputes these from θ;
  they cost nothing to keep.
* **Mixing ops**: the ops that read a float weight-side tensor and are not
  weight-side themselves — the ops that combine a weight with an
  activation (MatMul, Conv2D, Einsum, the bias AddV2, a norm's Mul, an
  embedding's GatherV2). I takes the gradient at their outputs (dz); W
  applies each one's registered gradient function to dz and keeps only the
  parts for its weight-side inputs, then carries those back to θ through
  the weight-side ops. Each weight's gradient is counted once.
* **Boundaries**: the tensors a later part of the graph reads from an
  earlier one, found by walking back from what that part returns. What W
  reads from the forward and from I (its `kept`) is exactly what its
  gradient functions read: a matmul's input and dz, a bias add's dz only.

An op that runs a function (While, If, a nested function call) is one op to
this reading: its gradient function computes the gradients of all its
inputs in one piece, so W re-runs that piece's whole backward to get its
weights' part (`Analysis.whole`: correct, but that piece costs 2 B). The
split never reaches into the function.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import tensorflow as tf
# The registered gradient of one op (what tf.gradients applies to each op).
from tensorflow.python.framework import ops as tf_ops

from lingvo_pipe import errors

Ref = object  # tf.Tensor.ref(): tensors as dict keys.

# Ops that run a function: their backward is one piece (module docstring).
_FUNCTION_OPS = frozenset({
    'While', 'StatelessWhile', 'If', 'StatelessIf', 'Case', 'StatelessCase',
    'PartitionedCall', 'StatefulPartitionedCall'})


class LocalGradError(errors.LingvoPipeError):
  """An op's gradient function failed when W called it for its weights."""


class BoundaryError(errors.LingvoPipeError):
  """A part of the graph waits on an earlier part by a control edge."""


@dataclasses.dataclass
class Analysis:
  """What the forward's ops are, for the split (see module docstring)."""
  weight: set[Ref]  # Weight-side tensors: recomputable from θ (and consts).
  derived: set[Ref]  # Those of them that depend on θ.
  mixing: list[tf.Operation]
  whole: list[str]  # 'Type name' of mixing ops W re-runs the backward of.


def _stateful(op: tf.Operation) -> bool:
  try:
    return op.op_def.is_stateful
  except (AttributeError, ValueError):
    return True


def analyse(forward_ops: Sequence[tf.Operation],
            theta: Iterable[tf.Tensor]) -> Analysis:
  """Classifies the forward's ops, in creation (topological) order.

  An op is weight-side when it is stateless, has no control inputs, and
  each of its inputs is weight-side (a Const, with none, is too): then W
  may recompute it from θ. Everything else (activations, random draws,
  anything that waits on a control edge, tensors from outside the forward)
  is an activation, kept as a value where a gradient reads it.
  """
  weight = {t.ref() for t in theta}
  derived = set(weight)
  mixing, whole = [], []
  for op in forward_ops:
    reads = [t.ref() in weight for t in op.inputs]
    pure = (not _stateful(op) and not op.control_inputs and
            (all(reads) if op.inputs else op.type == 'Const'))
    if pure:
      weight.update(t.ref() for t in op.outputs)
      if any(t.ref() in derived for t in op.inputs):
        derived.update(t.ref() for t in op.outputs)
    elif any(t.ref() in derived and t.dtype.is_floating for t in op.inputs):
      mixing.append(op)
      if op.type in _FUNCTION_OPS:
        whole.append(f'{op.type} {op.name}')
  return Analysis(weight, derived, mixing, whole)


def zeros(t: tf.Tensor) -> tf.Tensor:
  """Zeros like `t` without reading it (a read would have to be kept)."""
  if t.shape.is_fully_defined():
    return tf.zeros(t.shape, t.dtype)
  return tf.zeros_like(t)


def local_weight_grads(op: tf.Operation, dz: dict[int, tf.Tensor],
                       derived: set[Ref]) -> list[tuple[tf.Tensor, tf.Tensor]]:
  """(θ-derived input, its gradient) through `op` alone, given the
  gradients `dz` at its outputs (by output index)."""
  out = [dz[i] if i in dz else zeros(t) if t.dtype.is_floating else None
         for i, t in enumerate(op.outputs)]
  try:
    grad_fn = tf_ops.get_gradient_function(op)
    if grad_fn is None:
      return []
    with tf.name_scope(f'{op.name}_wgrad'):
      grads = grad_fn(op, *out)
  except Exception as e:  # pylint: disable=broad-except
    # A gradient function that cannot run a second time, on its own: the
    # stage falls back to the fused backward (split_trace.trace).
    raise LocalGradError(f'{op.type} {op.name}: {e}') from e
  if not isinstance(grads, (list, tuple)):
    grads = [grads]
  return [(t, g) for t, g in zip(op.inputs, grads)
          if g is not None and t.ref() in derived and t.dtype.is_floating]


def walk(fetches: Sequence[tf.Tensor], inner: Callable[[tf.Operation], bool],
         weight: set[Ref], fed: set[Ref]
        ) -> tuple[list[tf.Tensor], set[tf.Operation]]:
  """What `fetches` need: the tensors they read from outside, and the ops
  between.

  The walk goes back through the ops `inner` accepts and through
  weight-side ops (recomputed from θ, so never kept), and stops at `fed`
  tensors (a function's own inputs: θ, the gradients, the accumulators).
  Outside tensors come in creation order.

  Raises:
    BoundaryError: an op on the way waits on an outside op by a control
      edge (a value can be passed on; an edge to an op that did not run
      cannot).
  """
  found: dict[Ref, tf.Tensor] = {}
  body: set[tf.Operation] = set()
  stack: list[tf.Operation] = []

  def _reach(t: tf.Tensor) -> None:
    ref = t.ref()
    if ref in fed:
      return
    if inner(t.op) or ref in weight:
      stack.append(t.op)
    else:
      found[ref] = t

  for t in fetches:
    _reach(t)
  while stack:
    op = stack.pop()
    if op in body:
      continue
    body.add(op)
    for t in op.inputs:
      _reach(t)
    for c in op.control_inputs:
      if not inner(c):
        raise BoundaryError(f'{op.name} waits on {c.name} by a control edge')
      stack.append(c)
  return sorted(found.values(), key=_order), body


# Ops whose output is their input's buffer under another shape.
_VIEWS = frozenset({'Identity', 'Reshape', 'Squeeze', 'ExpandDims'})


def distinct(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """`tensors` less those that are a view of an earlier one's buffer (a
  matmul's [B·T, D] gradient and the bias add's [B, T, D] are one)."""
  roots: set[Ref] = set()
  out = []
  for t in tensors:
    root = t
    while root.op.type in _VIEWS and root.op.inputs:
      root = root.op.inputs[0]
    if root.ref() not in roots:
      roots.add(root.ref())
      out.append(t)
  return out


def _order(t: tf.Tensor) -> tuple[int, int]:
  return (t.op._id, t.value_index)  # pylint: disable=protected-access
