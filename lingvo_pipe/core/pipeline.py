"""The GPipe graph: pipelined forward, per-stage recomputing backward.

`Run` emits, inside the caller's graph (normally one `tf.function` training
step), the forward of every (stage k, micro-batch m) on stage k's device, and
registers a `tf.custom_gradient` whose gradient function emits the backward
of every (k, m) on stage k's device, recomputing the stage's forward from its
stored input boundary just before that backward needs it. The caller only
sees a differentiable function: `tape.gradient(loss, variables)` of an
ordinary outer `tf.GradientTape` returns the gradients accumulated over all
micro-batches.

Why each detail is there (each was a silent failure when missing):

* One tape per (stage, micro-batch), under the stage's `tf.device`, fed the
  incoming gradient (`output_gradients`). Differentiating straight through all
  stages with one tape put every backward op on the device where
  `tape.gradient` was called.
* The recompute's input is an identity that has a control dependency on the
  incoming gradient. Otherwise Grappler's common-subexpression elimination
  merges the recompute with the original forward and the activations stay
  alive for the whole step — recompute then saves no memory.
* Each device's work is chained in schedule order with control
  dependencies (forward m after forward m−1; backward m after backward m+1).
  Left to itself the dataflow executor runs micro-batches out of order, and
  peak memory grows with M instead of shrinking.
* The gradient of the *whole* output is split across micro-batches, so a
  loss that is Σ per-example / N gives exact gradients; nothing is rescaled.
* Statistics (BatchNorm's sums) are collected in the forward only, summed
  over micro-batches on the stage's device, and returned as extra outputs;
  the recompute runs with no collector, so nothing is counted twice.

Schedule (GPipe, K=3, M=4; F = forward, B = recompute + backward):

    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    stage 1: .  F0 F1 F2 F3 .  .  .  B3 B2 B1 B0 .  .
    stage 2: .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .  .
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import microbatch
from lingvo_pipe.core.fprop_context import StatsCollector

StageFn = Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]
RECOMPUTE_POLICIES = ('always', 'except_last', 'never')


@dataclasses.dataclass
class Stage:
  """One composite stage: `fprop(theta, inputs) -> outputs`, on `device`."""
  fprop: StageFn
  theta: Any
  device: str


def _Differentiable(x: tf.Tensor) -> bool:
  return x.dtype.is_floating or x.dtype.is_complex


def _Chained(x: Any, after: list[tf.Tensor]) -> Any:
  """`x` (a nest) behind identities that wait for `after`."""
  if not after:
    return tf.nest.map_structure(tf.identity, x)
  with tf.control_dependencies(after):
    return tf.nest.map_structure(tf.identity, x)


def _Float(leaves: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  return [x for x in leaves if _Differentiable(x)]


class _Clock:
  """Brackets ops with `tf.timestamp()` when a timeline is recorded."""

  def __init__(self, timeline: list[Any] | None) -> None:
    self.timeline = timeline

  def Start(self, inputs: Any) -> list[tf.Tensor]:
    """A timestamp taken once `inputs` exist; later ops wait for it."""
    if self.timeline is None:
      return []
    with tf.control_dependencies(_Float(tf.nest.flatten(inputs))):
      return [tf.timestamp()]

  def Stop(self, key: tuple[int, int, str], start: list[tf.Tensor],
           outputs: Any) -> None:
    if self.timeline is None:
      return
    with tf.control_dependencies(
        [x for x in tf.nest.flatten(outputs) if x is not None]):
      self.timeline.append((*key, start[0], tf.timestamp()))


class _Builder:
  """Emits the forward, then (on demand) the backward, of one step."""

  def __init__(self, stages: list[Stage], num_micro_batches: int,
               recompute: str, batch_dim: int) -> None:
    if recompute not in RECOMPUTE_POLICIES:
      raise ValueError(f'recompute={recompute!r}; use one of '
                       f'{RECOMPUTE_POLICIES}.')
    self.stages = stages
    self.m = num_micro_batches
    self.recompute = recompute
    self.batch_dim = batch_dim
    self.ctx = fprop_context.Current()
    self.step = tf.convert_to_tensor(self.ctx.step)
    k = len(stages)
    self.boundary: list[list[Any]] = [[None] * self.m for _ in range(k)]
    self.outputs: list[list[Any]] = [[None] * self.m for _ in range(k)]
    self.tapes: dict[tuple[int, int], tf.GradientTape] = {}
    self.clock = _Clock(self.ctx.timeline)

  def _Keeps(self, k: int) -> bool:
    """True if stage k keeps its forward activations (no recompute)."""
    last = k == len(self.stages) - 1
    return self.recompute == 'never' or (self.recompute == 'except_last' and
                                         last)

  def _Scope(self, m: int, stats: StatsCollector | None) -> Any:
    return fprop_context.Scope(
        training=True, step=self.step, micro_batch_index=m,
        num_micro_batches=self.m, batch_dim=self.batch_dim, stats=stats)

  def Forward(self, inputs: tuple[Any, ...], thetas: list[Any]
             ) -> tuple[list[Any], list[dict[str, Any]]]:
    """Emits all forwards; returns per-micro-batch outputs and stage stats."""
    micro = microbatch.Split(inputs, self.m, self.batch_dim)
    stage_stats = []
    for k, stage in enumerate(self.stages):
      totals = StatsCollector()
      after: list[tf.Tensor] = []
      for m in range(self.m):
        with tf.device(stage.device):
          x = _Chained(micro[m], after)
          self.boundary[k][m] = x
          collector = StatsCollector()
          start = self.clock.Start(x)
          with self._Scope(m, collector), tf.control_dependencies(start):
            if self._Keeps(k):
              with tf.GradientTape() as tape:
                tape.watch(_Float(tf.nest.flatten((x, thetas[k]))))
                y = stage.fprop(thetas[k], x)
              self.tapes[(k, m)] = tape
            else:
              y = stage.fprop(thetas[k], x)
          self.clock.Stop((k, m, 'F'), start, y)
          totals.Merge(collector.stats)
        self.outputs[k][m] = y
        after = tf.nest.flatten(y)
      micro = self.outputs[k]
      stage_stats.append(totals.stats)
    return self.outputs[-1], stage_stats

  def _StageBackward(self, k: int, m: int, dy: Any, thetas: list[Any],
                     after: list[tf.Tensor]) -> tuple[Any, Any]:
    """Recompute (unless kept) and backward of stage k, micro-batch m."""
    stage = self.stages[k]
    y_leaves = tf.nest.flatten(self.outputs[k][m])
    dy_leaves = tf.nest.flatten(dy)
    targets, grads = [], []
    for y, g in zip(y_leaves, dy_leaves):
      if _Differentiable(y):
        targets.append(y)
        grads.append(tf.zeros_like(y) if g is None else g)
    wait = [g for g in grads] + after
    x = self.boundary[k][m]
    if self._Keeps(k):
      tape = self.tapes.pop((k, m))
    else:
      x = _Chained(x, wait)
      start = self.clock.Start(x)
      with tf.GradientTape() as tape, tf.control_dependencies(start):
        tape.watch(_Float(tf.nest.flatten((x, thetas[k]))))
        with self._Scope(m, stats=None):
          y = stage.fprop(thetas[k], x)
      targets = [t for t in tf.nest.flatten(y) if _Differentiable(t)]
      self.clock.Stop((k, m, 'R'), start, targets)
      wait = wait + targets if self.clock.timeline is not None else wait
    x_leaves = tf.nest.flatten(x)
    x_float = [v for v in x_leaves if _Differentiable(v)]
    start = self.clock.Start(wait)
    with tf.control_dependencies(wait + start):
      dx_float, dtheta = tape.gradient(
          targets, (x_float, thetas[k]), output_gradients=grads,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    self.clock.Stop((k, m, 'B'), start, (dx_float, dtheta))
    it = iter(dx_float)
    dx = [next(it) if _Differentiable(v) else None for v in x_leaves]
    return tf.nest.pack_sequence_as(x, dx), dtheta

  def Backward(self, dys: list[Any], thetas: list[Any]
              ) -> tuple[Any, list[Any]]:
    """Emits all backwards; returns (input grads per micro-batch, theta grads)."""
    num_stages = len(self.stages)
    theta_grads: list[Any] = [None] * num_stages
    grads_in = dys
    for k in reversed(range(num_stages)):
      grads_out: list[Any] = [None] * self.m
      after: list[tf.Tensor] = []
      for m in reversed(range(self.m)):
        with tf.device(self.stages[k].device):
          dy = tf.nest.map_structure(
              lambda g: g if g is None else tf.identity(g), grads_in[m])
          dx, dtheta = self._StageBackward(k, m, dy, thetas, after)
          if theta_grads[k] is None:
            theta_grads[k] = dtheta
          else:
            theta_grads[k] = tf.nest.map_structure(tf.add, theta_grads[k],
                                                   dtheta)
        grads_out[m] = dx
        after = _Float(tf.nest.flatten((dx, theta_grads[k])))
      grads_in = grads_out
    return grads_in, theta_grads


def Run(stages: list[Stage], inputs: tuple[Any, ...], num_micro_batches: int,
        recompute: str = 'always', batch_dim: int = 0) -> Any:
  """Pipelined, differentiable forward of `stages` over `inputs`.

  Args:
    stages: The composite stages in order; stage k's outputs are stage k+1's
      inputs (a tuple of nests of tensors).
    inputs: Positional inputs of stage 0; every leaf has the batch on
      `batch_dim`.
    num_micro_batches: M; the batch must divide evenly.
    recompute: 'always' (store only stage inputs; recompute in backward),
      'except_last' (the last stage keeps its activations: its backward
      follows its forward immediately) or 'never'.
    batch_dim: The batch dimension of every leaf.

  Returns:
    The last stage's outputs for the whole batch (micro-batches concatenated).
    Statistics added by layers are summed over micro-batches and merged into
    the caller's `fprop_context` collector, if any.
  """
  builder = _Builder(stages, num_micro_batches, recompute, batch_dim)
  in_leaves = tf.nest.flatten(inputs)
  thetas = []
  for stage in stages:  # Read each stage's weights on its own device.
    with tf.device(stage.device):
      thetas.append(tf.nest.map_structure(tf.identity, stage.theta))
  theta_leaves = [tf.nest.flatten(t) for t in thetas]
  out_struct: list[Any] = []
  stats_struct: list[Any] = []

  @tf.custom_gradient
  def _Pipelined(*args: tf.Tensor) -> Any:
    xs = tf.nest.pack_sequence_as(inputs, list(args[:len(in_leaves)]))
    pos, ths = len(in_leaves), []
    for leaves, theta in zip(theta_leaves, thetas):
      ths.append(tf.nest.pack_sequence_as(theta, list(args[pos:pos +
                                                             len(leaves)])))
      pos += len(leaves)
    micro_outputs, stats = builder.Forward(xs, ths)
    with tf.device(stages[-1].device):
      out = microbatch.Concat(micro_outputs, batch_dim)
    out_struct.append(out)
    stats_struct.append(stats)
    flat_out = tf.nest.flatten(out)
    flat_stats = tf.nest.flatten(stats)

    def _Grad(*dys: tf.Tensor) -> list[tf.Tensor | None]:
      dy = tf.nest.pack_sequence_as(out, list(dys[:len(flat_out)]))
      with tf.device(stages[-1].device):
        dy = tf.nest.map_structure(
            lambda g, y: tf.zeros_like(y) if g is None else g, dy, out)
        dy_micro = microbatch.Split(dy, num_micro_batches, batch_dim)
      dx_micro, dthetas = builder.Backward(dy_micro, ths)
      with tf.device(stages[0].device):
        dx = microbatch.Concat(dx_micro, batch_dim)
      dx_leaves = [g if _Differentiable(x) else None
                   for g, x in zip(tf.nest.flatten(dx), in_leaves)]
      return dx_leaves + [g for d in dthetas for g in tf.nest.flatten(d)]

    return flat_out + flat_stats, _Grad

  flat = _Pipelined(*in_leaves, *[x for leaves in theta_leaves for x in leaves])
  n_out = len(tf.nest.flatten(out_struct[0]))
  outputs = tf.nest.pack_sequence_as(out_struct[0], flat[:n_out])
  stats = tf.nest.pack_sequence_as(stats_struct[0], flat[n_out:])
  collector = fprop_context.Current().stats
  if collector is not None:
    for stage_stats in stats:
      collector.Merge(stage_stats)
  return outputs
