"""I and W: a stage's backward split into its input and weight gradients.

Zero-bubble schedules (Qi et al., 2024) run a stage's backward as two ops:
I computes dx, which the previous stage waits for; W computes dθ later, in
a slot that would otherwise be idle. For that to pay, I + W must cost what
the fused backward B costs, and W must be able to run after other
micro-batches' ops — across `tf.while_loop` iterations, through
TensorArrays — so what I leaves for W (`kept`) is a flat list of plain
tensors, never a tape.

How (`split_graph.py` says why each piece is there, `split_trace.py` how
the graph is cut):

    trace once per stage and signature, as one graph:
      forward    y = fprop(θ, x[, side])          (statistics collected)
      I part     dx, dz = ∂y/∂(x, z) · dy          z: outputs of mixing ops
      W part     dθ = Σ_op local ∂z/∂w · dz, carried back to θ
    cut that graph into functions that read only what they need:
      forward(θ, x, side, m, step)         → y, stats, saved
      input_grad(θ, x, side, dy, m, step)  → dx, kept     (recomputes)
      recompute(θ, x, side, m, step)       → saved        (I's R)
      input_grad_saved(θ, saved, dy)       → dx, kept     (after forward)
      weight_grad(θ, kept[, acc])          → acc + dθ

`saved` is what a kept forward leaves for its I (what a tape would hold, as
values); `kept` is what W reads: each mixing op's gradient inputs (a
matmul's input activation and dz; a bias add's dz only). With recompute,
I's forward collects no statistics (its function holds none of their ops).
Dropout masks are those of the forward: the same ops on the same
(step, micro-batch) inputs. Eagerly, the functions still run traced: the
split reads the graph. `Traced.kept_bytes` / `saved_bytes` are the memory
per micro-batch between I and W / F and I; `layer_bytes` gives them per
layer from Params, for the memory model.

Where it does not split: an op that runs a function (cond, while loop,
nested tf.function) is taken whole, W re-running its backward for the
weights' part (`Traced.whole`); if an op's gradient cannot be taken apart
at all, the stage is not split (`Traced.reason`): I computes dθ with dx,
kept holds dθ and W adds it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import split_trace
from lingvo_pipe.pipeline.split_trace import Traced, num_bytes
from lingvo_pipe.pipeline.dependency import chained
from lingvo_pipe.pipeline.stage import Stage

__all__ = ['SplitError', 'SplitStage', 'Traced', 'layer_bytes', 'num_bytes']

Scope = Callable[[Any, StatsCollector | None, Any], Any]


class SplitError(errors.LingvoPipeError):
  """A call this stage's split cannot serve; the message names the fix."""


def _spec(t: Any) -> tf.TensorSpec:
  if isinstance(t, tf.TensorSpec):
    return t
  t = tf.convert_to_tensor(t)
  return tf.TensorSpec(t.shape, t.dtype)


class SplitStage:
  """The kept forward, I and W of one stage; traced on first use.

  >>> from lingvo_pipe.core import fprop_context
  >>> w = tf.eye(3)
  >>> stage = Stage(lambda th, x: (tf.tanh(tf.matmul(x[0], th)),), w,
  ...               '/device:CPU:0')
  >>> split = SplitStage(stage, lambda m, stats, step: fprop_context.scope(
  ...     training=True, step=step, micro_batch_index=m, stats=stats))
  >>> x, dy = (tf.ones([2, 3]),), [tf.ones([2, 3])]
  >>> dx, kept = split.input_grad(w, x, None, dy, m=0, step=0)
  >>> [t.shape.as_list() for t in kept]  # x (dW = xᵀ·dz), and dz.
  [[2, 3], [2, 3]]
  >>> split.weight_grad(w, kept).shape
  TensorShape([3, 3])
  """

  def __init__(self, stage: Stage, scope: Scope) -> None:
    """Args:
      stage: the stage (`fprop(theta, inputs[, side])`).
      scope: (m, stats, step) → the fprop_context of one micro-batch.
    """
    self.stage = stage
    self.scope = scope
    self._traces: dict[Any, Traced] = {}

  def trace(self, theta: Any, x: Any, side: Any = None) -> Traced:
    """The split for this signature (leaves: tensors or TensorSpecs);
    traced once and cached. Its `kept_bytes` and `saved_bytes` are the
    memory per micro-batch in flight."""
    specs = ([_spec(t) for t in tf.nest.flatten(theta)] +
             [_spec(t) for t in tf.nest.flatten(x) if t is not None] +
             [_spec(t) for t in _leaves(side)] +
             [tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int64)])
    structure = tf.nest.map_structure(
        lambda t: t is None, (theta, x, side))
    key = (tuple(specs), repr(structure))
    if key not in self._traces:
      self._traces[key] = split_trace.trace(
          self.stage, self.scope, (theta, x, side), specs)
    return self._traces[key]

  def forward(self, theta: Any, x: Any, side: Any, m: Any, step: Any
             ) -> tuple[Any, dict[str, Any], list[tf.Tensor]]:
    """F that keeps what its I needs: outputs, statistics, saved."""
    traced = self.trace(theta, x, side)
    out = traced.forward(*_args(theta, x, side, m, step))
    y, stats = traced.structures['y'], traced.structures['stats']
    n_y, n_stats = len(tf.nest.flatten(y)), len(tf.nest.flatten(stats))
    return (tf.nest.pack_sequence_as(y, out[:n_y]),
            tf.nest.pack_sequence_as(stats, out[n_y:n_y + n_stats]),
            out[n_y + n_stats:])

  def input_grad(self, theta: Any, x: Any, side: Any, dys: list[tf.Tensor],
                 m: Any, step: Any) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """I with recompute: dx (x's float leaves), kept."""
    traced = self.trace(theta, x, side)
    if not tf.executing_eagerly():
      # The recompute waits for the incoming gradient, or Grappler merges
      # it with the forward and the activations stay alive (dependency.py).
      x = chained(x, list(dys))
    out = traced.input_grad(*_args(theta, x, side, m, step), *dys)
    return out[:traced.num_dx], out[traced.num_dx:]

  def recompute(self, theta: Any, x: Any, side: Any, m: Any, step: Any
               ) -> list[tf.Tensor]:
    """The forward again, keeping only what I needs: saved."""
    traced = self.trace(theta, x, side)
    return traced.recompute(*_args(theta, x, side, m, step))

  def input_grad_saved(self, theta: Any, x: Any, side: Any,
                       saved: list[tf.Tensor], dys: list[tf.Tensor]
                      ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """I after `forward`: dx, kept. x and side pick the trace (tensors or
    specs: I reads only saved); None: the trace whose saved `saved` is."""
    traced = (self.trace(theta, x, side) if x is not None else
              self.traced_for(saved, 'saved_specs'))
    out = traced.input_grad_saved(*tf.nest.flatten(theta), *saved, *dys)
    return out[:traced.num_dx], out[traced.num_dx:]

  def weight_grad(self, theta: Any, kept: list[tf.Tensor], acc: Any = None,
                  x: Any = None, side: Any = None) -> Any:
    """W: acc + dθ (dθ if acc is None), structured like theta. x and side
    pick the trace when this stage was traced for several signatures."""
    traced = (self.trace(theta, x, side) if x is not None else
              self.traced_for(kept, 'kept_specs'))
    flat_theta = tf.nest.flatten(theta)
    if acc is None:
      out = traced.weight_grad_first(*flat_theta, *kept)
    else:
      out = traced.weight_grad(*flat_theta, *kept, *tf.nest.flatten(acc))
    return tf.nest.pack_sequence_as(theta, out)

  def traced_for(self, values: list[tf.Tensor], specs: str) -> Traced:
    """The one trace whose `specs` ('saved_specs', 'kept_specs') `values`
    match: what a step's I and W read carries no x to pick it by."""
    found = [t for t in self._traces.values()
             if len(getattr(t, specs)) == len(values) and all(
                 s.is_compatible_with(v)
                 for s, v in zip(getattr(t, specs), values))]
    if len(found) != 1:
      raise SplitError(f'{len(found)} of the {len(self._traces)} signatures '
                       'traced for this stage match these values: pass x '
                       '(and side) to pick one.')
    return found[0]


def layer_bytes(params: Any, input_specs: Sequence[Any]) -> tuple[int, int]:
  """(kept, saved) bytes of one layer per micro-batch, from Params alone.

  For the memory model: the layer is built in a graph of its own (its
  variables are never allocated) and its split traced on specs. A stage's
  kept bytes are the sum of its layers' (each weight's op belongs to one
  layer); summed saved bytes count each tensor between two layers twice
  (the one's output, the other's input), an upper bound.

  Args:
    params: the layer's Params.
    input_specs: one TensorSpec (or nest of them) per positional input, at
      the micro-batch's shape.
  """
  with tf.Graph().as_default():
    layer = params.Instantiate()
    theta = tf.nest.map_structure(lambda v: tf.TensorSpec(v.shape, v.dtype),
                                  layer.theta)

    def _fprop(th: Any, x: tuple[Any, ...]) -> tuple[Any, ...]:
      out = layer.FProp(th, *x)
      return out if isinstance(out, tuple) else (out,)

    stage = Stage(_fprop, theta, '')
    traced = SplitStage(stage, _training).trace(theta, tuple(input_specs))
  return traced.kept_bytes, traced.saved_bytes


def _training(m: Any, stats: StatsCollector | None, step: Any) -> Any:
  return fprop_context.scope(training=True, step=step, micro_batch_index=m,
                             stats=stats)


def _leaves(side: Any) -> list[Any]:
  return [] if side is None else tf.nest.flatten(side)


def _args(theta: Any, x: Any, side: Any, m: Any, step: Any
         ) -> list[tf.Tensor]:
  return (tf.nest.flatten(theta) +
          [t for t in tf.nest.flatten(x) if t is not None] +
          _leaves(side) +
          [tf.cast(m, tf.int32), tf.cast(step, tf.int64)])
