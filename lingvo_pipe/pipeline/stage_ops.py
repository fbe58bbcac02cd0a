"""The ops of one stage: forward (F), and recompute + backward (R, B).

The engine (`engine.py`) emits these, one per (op, micro-batch), in the
order a schedule gives; this module says what one op computes. Each detail
below was a silent failure when missing:

* A micro-batch that recomputes runs F and R+B as `tf.function`s traced
  once and called per micro-batch, so tracing costs O(stages), not
  O(stages × M). One that keeps its activations (no R: the policy, or an R
  that would directly follow its F) runs inline under a tape that its B
  reuses: the backward needs the forward's tape.
* Order on a device is a *data* dependency: the previous op's outputs are an
  input of the next call (`after`), used as a control dependency inside it.
  TF drops control dependencies on the call of an inlined function, which let
  the executor run micro-batches out of order (peak memory ∝ M), and on TF
  worker processes a control-dependency chain outside the calls kept stage
  k+1 from starting before stage k had finished.
* R's input is an identity that waits for the incoming gradient. Otherwise
  Grappler's common-subexpression elimination merges the recompute with the
  forward and the activations stay alive for the whole step.
* A called function's ops do not inherit the caller's device scope: left
  unpinned they ran on the client, so every body pins itself.
* Gradients of theta are accumulated inside the traced backward (`acc` in,
  `acc + dtheta` out): the outer graph then does not grow by one add per
  variable and micro-batch.
* Statistics (BatchNorm's sums) are collected in F only; R runs with no
  collector, so nothing is counted twice.

Timing is a wrapper: `Clock` brackets a piece of an op with `tf.timestamp()`
when a timeline is recorded and is the identity otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import collective

StageFn = Callable[..., tuple[Any, ...]]


@dataclasses.dataclass
class Stage:
  """One composite stage: `fprop(theta, inputs[, side]) -> outputs`.

  `inputs` is a tuple of nests whose leaves carry the batch; `side` (the
  labels of the stage that computes the loss) is passed only to that
  stage, is never differentiated and never crosses a stage boundary.
  """
  fprop: StageFn
  theta: Any
  device: str
  inline: bool = False  # TF inlines each call of its bodies (StageOps).


def differentiable(x: Any) -> bool:
  return x is not None and hasattr(x, 'dtype') and (x.dtype.is_floating or
                                                    x.dtype.is_complex)


def float_leaves(nest: Any) -> list[tf.Tensor]:
  return [x for x in tf.nest.flatten(nest) if differentiable(x)]


def chained(x: Any, after: Sequence[tf.Tensor]) -> Any:
  """`x` (a nest) behind identities that wait for `after`."""
  with tf.control_dependencies(list(after)):
    return tf.nest.map_structure(
        lambda t: t if t is None else tf.identity(t), x)


class Clock:
  """Stamps the start and end of each piece of an op, if `on`."""

  def __init__(self, on: bool, device: str | None = None,
               in_body: bool = False) -> None:
    self.on = on
    self.device = device
    self.in_body = in_body

  def on_device(self, device: str, in_body: bool = False) -> 'Clock':
    """This clock, stamping on `device` (a called function's ops do not
    inherit the caller's device); `in_body`: inside a traced stage body."""
    return Clock(self.on, device, in_body)

  def __call__(self, fn: Callable[[], Any], inputs: Sequence[tf.Tensor],
               outputs: Callable[[Any], Sequence[tf.Tensor]]
              ) -> tuple[Any, list[tf.Tensor]]:
    """Runs `fn()`; returns its result and [start, end] stamps (or [])."""
    if not self.on:
      return fn(), []
    start = self._stamp(list(inputs))
    with tf.control_dependencies([start]):
      result = fn()
    return result, [start, self._stamp(list(outputs(result)))]

  def _stamp(self, after: list[tf.Tensor]) -> tf.Tensor:
    """`tf.timestamp()` once every tensor in `after` exists.

    In a traced stage body a control edge does it: an extra function call
    there is one more hand-off between inter-op threads, and with one core
    per stage process each hand-off waits for a scheduler slice; as nested
    calls the stamps slowed a recorded 1F1B step (K=2, M=16) by ~25%. In
    the outer graph each stamp waits by data (collective.made_after says
    why).
    """
    if self.in_body and not tf.executing_eagerly():
      with tf.device(self.device), tf.control_dependencies(after):
        return tf.timestamp()
    return collective.made_after(self.device, after, tf.timestamp)


class StageOps:
  """F and R+B of one stage, each a traced body called per micro-batch."""

  def __init__(self, stage: Stage, scope: Callable[..., Any],
               clock: Clock) -> None:
    """Args:
      stage: the stage.
      scope: (m, stats, step) → the fprop_context of one micro-batch.
      clock: the timing wrapper.
    """
    self.stage = stage
    self.scope = scope
    self.clock = clock.on_device(stage.device)  # Inline ops.
    self.body_clock = clock.on_device(stage.device, in_body=True)
    # Eagerly (debugging, tests) the bodies run op by op: tracing them per
    # call would only add time. Traced, each body is traced once however
    # many calls. '_noinline' keeps each call a call, so the graph TF
    # optimises stays O(stages) in size: inlined, a K=2 step of 12 ×
    # Transformer layer took 60 s instead of 8 s to start at M=32 (a copy of
    # F and of R+B per micro-batch). But a
    # call hands over its outputs only once all of them exist (dx waits for
    # the weight gradients), and each call crosses inter-op threads: on
    # stage processes, one core each, inlined bodies made K=2 steps 4–7%
    # (GPipe) and 3–14% (1F1B) faster (16 × FC 512, M=8 and 16).
    wrap = ((lambda f: f) if tf.executing_eagerly() else (
        lambda f: tf.function(f, autograph=False) if stage.inline else
        tf.function(f, autograph=False,
                    experimental_attributes={'_noinline': True})))
    self.forward = wrap(self._forward)
    self.backward = wrap(self._backward)

  def _run(self, theta: Any, x: Any, side: Any, m: Any, step: Any,
           stats: StatsCollector | None) -> Any:
    with self.scope(m, stats, step):
      if side is None:
        return self.stage.fprop(theta, x)
      return self.stage.fprop(theta, x, side)

  def _forward(self, theta: Any, x: Any, side: Any, after: list[tf.Tensor],
               m: tf.Tensor, step: tf.Tensor
              ) -> tuple[Any, dict[str, Any], list[tf.Tensor]]:
    """F of a recomputing stage: outputs, statistics, stamps."""
    with tf.device(self.stage.device):
      x = chained(x, after)
      collector = StatsCollector()
      y, times = self.body_clock(
          lambda: self._run(theta, x, side, m, step, collector),
          float_leaves(x) or list(after), float_leaves)
      return y, collector.stats, times

  def _backward(self, theta: Any, x: Any, side: Any, dys: list[tf.Tensor],
                after: list[tf.Tensor], m: tf.Tensor, step: tf.Tensor,
                acc: Any) -> tuple[list[tf.Tensor], Any, list[tf.Tensor]]:
    """R+B: dx (float leaves of x), acc + dtheta, stamps (R, then B)."""
    with tf.device(self.stage.device):
      # The recompute waits for the incoming gradient (else Grappler merges
      # it with the forward) and for this device's previous op (order).
      x = chained(x, list(dys) + list(after))
      x_float = float_leaves(x)

      def _recompute():
        with tf.GradientTape() as tape:
          tape.watch([x_float, theta])
          y = self._run(theta, x, side, m, step, None)
        return tape, float_leaves(y)

      (tape, targets), r_times = self.body_clock(
          _recompute, x_float or list(dys), lambda r: r[1])
      (dx, dtheta), b_times = self.body_clock(
          lambda: tape.gradient(
              targets, (x_float, theta), output_gradients=list(dys),
              unconnected_gradients=tf.UnconnectedGradients.ZERO),
          r_times[1:] or targets, tf.nest.flatten)
      return dx, tf.nest.map_structure(tf.add, acc, dtheta), r_times + b_times

  def kept_forward(self, theta: Any, x: Any, side: Any, after: list[tf.Tensor],
                   m: Any, step: Any
                  ) -> tuple[Any, Any, dict[str, Any], list[tf.Tensor],
                             tf.GradientTape]:
    """F of a stage that keeps its activations: inline, under a tape.

    Returns the (ordered) input its backward differentiates by, outputs,
    statistics, stamps and the tape.
    """
    with tf.device(self.stage.device):
      x = chained(x, after)
      collector = StatsCollector()

      def _forward():
        with tf.GradientTape() as tape:
          tape.watch(float_leaves((x, theta)))
          y = self._run(theta, x, side, m, step, collector)
        return tape, y

      (tape, y), times = self.clock(_forward, float_leaves(x) or list(after),
                                    lambda r: float_leaves(r[1]))
      return x, y, collector.stats, times, tape

  def kept_backward(self, tape: tf.GradientTape, theta: Any, x: Any, y: Any,
                    dys: list[tf.Tensor], after: list[tf.Tensor], acc: Any
                   ) -> tuple[list[tf.Tensor], Any, list[tf.Tensor]]:
    """B from the forward's tape: dx, acc + dtheta (acc may be None)."""
    with tf.device(self.stage.device):
      wait = list(dys) + list(after)
      with tf.control_dependencies(wait):
        (dx, dtheta), times = self.clock(
            lambda: tape.gradient(
                float_leaves(y), (float_leaves(x), theta),
                output_gradients=list(dys),
                unconnected_gradients=tf.UnconnectedGradients.ZERO),
            wait, tf.nest.flatten)
      if acc is not None:
        dtheta = tf.nest.map_structure(tf.add, acc, dtheta)
      return dx, dtheta, times
