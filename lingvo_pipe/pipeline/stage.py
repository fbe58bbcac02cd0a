"""One stage of a step: what its actions compute, and what it holds.

`Stage` is what the engine is given: a composite stage's `fprop`, weights
and device. For one step, `StageBodies` traces what each action computes —
F, and R+B fused; with a split backward (`split_backward.py`) F, R+I, I
and W — once, and calls it per micro-batch; `StageState` is the
stage's part of the step: the values its actions made (saved inputs,
outputs, input gradients, tapes) by (family, micro-batch), its accumulated
gradients and its statistics. The executor (`executor.py`) asks it to run
one action at a time; a loop gives each stage a fresh `StageState` whose
missing values come from the loop's carried state.

Details, each a silent failure when missing:

* A micro-batch that recomputes runs F and R+B as `tf.function`s traced
  once and called per micro-batch, so tracing costs O(stages), not
  O(stages × M). One that keeps its activations (no R) runs F inline under
  a tape that its B reuses.
* Order on a device is a data dependency: the previous action's outputs
  are an input of the next call (`after`), waited on inside it
  (`dependency.chained`); R's input waits for the incoming gradient.
* A called function's ops do not inherit the caller's device scope: left
  unpinned they ran on the client, so every body pins itself.
* Gradients of theta accumulate inside the traced backward (`acc` in,
  `acc + dtheta` out): the outer graph does not grow by one add per
  variable and micro-batch.
* Statistics (BatchNorm's sums) are collected in F only; R runs with no
  collector, so nothing is counted twice.
* Bodies are called, not inlined, when one process runs every stage
  (`_noinline`): inlined, a K=2 step of 12 Transformer layers took 60 s
  instead of 8 s to start at M=32 (a copy of F and R+B per micro-batch).
  A stage process (one stage per process) inlines them: a call hands over
  its outputs only once all exist and crosses inter-op threads, and there
  the copies cost less than the calls (docs/benchmarks.md).

Timing is a wrapper: `Clock` brackets a piece of an action with
`tf.timestamp()` when a timeline is recorded and is the identity otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import dependency

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
  inline: bool = False  # TF inlines each call of its bodies (StageBodies).


def differentiable(x: Any) -> bool:
  return x is not None and hasattr(x, 'dtype') and (x.dtype.is_floating or
                                                    x.dtype.is_complex)


def float_leaves(nest: Any) -> list[tf.Tensor]:
  return [x for x in tf.nest.flatten(nest) if differentiable(x)]


def leaves(nest: Any) -> list[tf.Tensor]:
  return [t for t in tf.nest.flatten(nest) if t is not None]


def pack(structure: Any, tensors: Sequence[Any]) -> Any:
  """Inverse of `leaves`: `structure` with its non-None leaves replaced."""
  it = iter(tensors)
  return tf.nest.pack_sequence_as(
      structure, [None if t is None else next(it)
                  for t in tf.nest.flatten(structure)])


class Clock:
  """Stamps the start and end of each piece of an action, if `on`."""

  def __init__(self, on: bool, device: str | None = None,
               in_body: bool = False) -> None:
    self.on = on
    self.device = device
    self.in_body = in_body

  def on_device(self, device: str, in_body: bool = False) -> 'Clock':
    """This clock, stamping on `device` (a called function's ops do not
    inherit the caller's device); `in_body`: inside a traced stage body."""
    return Clock(self.on, device, in_body)

  def __call__(self, fn: Callable[..., Any], inputs: Sequence[tf.Tensor],
               outputs: Callable[[Any], Sequence[tf.Tensor]],
               gate: Any = None) -> tuple[Any, list[tf.Tensor]]:
    """Runs `fn()`, or `fn(gate)` if `gate` (a nest) is given; returns its
    result and [start, end] stamps (or []).

    `fn`'s ops wait for the start stamp by a control edge, which TF drops
    on the call of a function it inlines (the split bodies call traced
    functions), so such a call could start before its stamp. It reads
    `gate` instead, which waits for the stamp by data (identities behind
    it). The end stamp's side of the same trap is `_stamp`'s."""
    if not self.on:
      return (fn() if gate is None else fn(gate)), []
    start = self._stamp(list(inputs))
    with tf.control_dependencies([start]):
      result = (fn() if gate is None else
                fn(dependency.chained(gate, [start])))
    return result, [start, self._stamp(list(outputs(result)))]

  def _stamp(self, after: list[tf.Tensor]) -> tf.Tensor:
    """`tf.timestamp()` once every tensor in `after` exists: by a control
    edge in a traced body (one more call there is one more hand-off
    between inter-op threads), by data in the outer graph
    (`dependency.made_after`: Grappler dropped control edges there)."""
    if self.in_body and not tf.executing_eagerly():
      with tf.device(self.device), tf.control_dependencies(
          dependency.computed(after)):
        return tf.timestamp()
    return dependency.made_after(self.device, after, tf.timestamp)


class StageBodies:
  """F and R+B of one stage, each traced once and called per micro-batch;
  kept F and B run inline (the tape cannot cross a call)."""

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
    # call would only add time.
    wrap = ((lambda f: f) if tf.executing_eagerly() else (
        lambda f: tf.function(f, autograph=False) if stage.inline else
        tf.function(f, autograph=False,
                    experimental_attributes={'_noinline': True})))
    self.forward = wrap(self._forward)
    self.backward = wrap(self._backward)
    # A split backward (zero-bubble schedules): I and W.
    self.split_forward = wrap(self._split_forward)
    self.split_backward = wrap(self._split_backward)
    self.input_grad = wrap(self._input_grad)
    self.weight_grad = wrap(self._weight_grad)

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
      x = dependency.chained(x, after)
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
      # it with the forward) and for this device's previous action.
      x = dependency.chained(x, list(dys) + list(after))
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

  @functools.cached_property
  def split(self) -> Any:
    """The stage's forward, I and W (`split_backward.SplitStage`), traced
    on first use."""
    # pylint: disable-next=import-outside-toplevel (it imports this module)
    from lingvo_pipe.pipeline import split_backward
    return split_backward.SplitStage(self.stage, self.scope)

  def _split_forward(self, theta: Any, x: Any, side: Any,
                     after: list[tf.Tensor], m: tf.Tensor, step: tf.Tensor
                    ) -> tuple[Any, dict[str, Any], list[tf.Tensor],
                               list[tf.Tensor]]:
    """F of a split micro-batch that keeps its activations: outputs,
    statistics, saved (what its I reads: plain values, which can cross
    loop iterations as no tape can), stamps."""
    with tf.device(self.stage.device):
      x = dependency.chained(x, after)
      (y, stats, saved), times = self.body_clock(
          lambda x: self.split.forward(theta, x, side, m, step),
          float_leaves(x) or list(after), lambda r: float_leaves(r[0]), x)
      return y, stats, saved, times

  def _split_backward(self, theta: Any, x: Any, side: Any,
                      dys: list[tf.Tensor], after: list[tf.Tensor],
                      m: tf.Tensor, step: tf.Tensor
                     ) -> tuple[list[tf.Tensor], list[tf.Tensor],
                                list[tf.Tensor]]:
    """R+I: dx (float leaves of x), kept (what W reads), stamps (R, then
    I). R rebuilds only what I reads, and collects no statistics."""
    with tf.device(self.stage.device):
      x = dependency.chained(x, list(dys) + list(after))
      saved, r_times = self.body_clock(
          lambda x: self.split.recompute(theta, x, side, m, step),
          float_leaves(x) or list(dys), list, x)
      (dx, kept), i_times = self.body_clock(
          lambda g: self.split.input_grad_saved(theta, x, side, *g),
          r_times[1:] or saved, lambda r: r[0] + r[1], (saved, dys))
      return dx, kept, r_times + i_times

  def _input_grad(self, theta: Any, saved: list[tf.Tensor],
                  dys: list[tf.Tensor], after: list[tf.Tensor]
                 ) -> tuple[list[tf.Tensor], list[tf.Tensor],
                            list[tf.Tensor]]:
    """I from what a split F saved: dx, kept, stamps."""
    with tf.device(self.stage.device):
      wait = list(dys) + list(after)
      saved = dependency.chained(saved, wait)
      (dx, kept), times = self.body_clock(
          lambda g: self.split.input_grad_saved(theta, None, None, *g),
          wait, lambda r: r[0] + r[1], (saved, dys))
      return dx, kept, times

  def _weight_grad(self, theta: Any, kept: list[tf.Tensor],
                   after: list[tf.Tensor], acc: Any
                  ) -> tuple[Any, list[tf.Tensor]]:
    """W: acc + dθ from what I kept, stamps."""
    with tf.device(self.stage.device):
      kept = dependency.chained(kept, after)
      return self.body_clock(
          lambda kept: self.split.weight_grad(theta, kept, acc),
          kept or list(after), tf.nest.flatten, kept)

  def input_structure(self, saved: list[tf.Tensor]) -> Any:
    """The stage input's structure (TensorSpec leaves) of the split
    that saved `saved`: where I's dx leaves go."""
    return self.split.traced_for(saved, 'saved_specs').structures['x']

  def kept_forward(self, theta: Any, x: Any, side: Any, after: list[tf.Tensor],
                   m: Any, step: Any
                  ) -> tuple[Any, Any, dict[str, Any], list[tf.Tensor],
                             tf.GradientTape]:
    """F of a stage that keeps its activations: inline, under a tape.

    Returns the (ordered) input its backward differentiates by, outputs,
    statistics, stamps and the tape.
    """
    with tf.device(self.stage.device):
      x = dependency.chained(x, after)
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


@dataclasses.dataclass
class StageState:
  """A stage's part of one step: what its actions made, and its sums.

  `values` holds the stage's keyed values, (family, micro-batch) → value
  (`actions.py` names the families). A value it lacks is asked of
  `resolve(family, m)`: in a loop body, the loop's carried state; after a
  loop, the arrays the loop wrote.
  """
  bodies: StageBodies
  theta: Any
  values: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict)
  acc: Any = None  # Σ dθ over the micro-batches done; None before any.
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)
  resolve: Callable[[str, int], Any] | None = None

  @property
  def device(self) -> str:
    return self.bodies.stage.device

  def get(self, family: str, m: int) -> Any:
    if (family, m) not in self.values:
      if self.resolve is None:
        raise KeyError((family, m))
      self.values[(family, m)] = self.resolve(family, m)
    return self.values[(family, m)]

  def fork(self, resolve: Callable[[str, int], Any], acc: Any,
           stats: dict[str, Any]) -> 'StageState':
    """A fresh state of the same stage (a loop body's), carrying `acc`
    and `stats`, its values resolved by `resolve`."""
    return StageState(self.bodies, self.theta, {}, acc, dict(stats), resolve)

  def merge_stats(self, stats: dict[str, Any]) -> None:
    with tf.device(self.device):
      collector = StatsCollector(self.stats)
      collector.merge(stats)
      self.stats = collector.stats

  def first_acc(self) -> Any:
    """The accumulator before the first backward: zeros (hidden from
    constant folding: `dependency.opaque`)."""
    if self.acc is not None:
      return self.acc
    with tf.device(self.device):
      return tf.nest.map_structure(
          lambda t: dependency.opaque(tf.zeros_like(t)), self.theta)
