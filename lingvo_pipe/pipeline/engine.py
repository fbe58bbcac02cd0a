"""The GPipe graph: pipelined forward, per-stage recomputing backward.

`run` emits, inside the caller's graph (normally one `tf.function` training
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
* Each device's work is chained in schedule order (forward m after forward
  m−1; backward m after backward m+1). Left to itself the dataflow executor
  runs micro-batches out of order, and peak memory grows with M instead of
  shrinking. The chain is a *data* dependency (the previous op's outputs are
  inputs of the next call, ordered by a control dependency inside it): TF
  drops control dependencies on the call of an inlined `tf.function`, which
  silently restored the out-of-order peak, and on TF worker processes a
  control-dependency chain outside the calls kept stage k+1 from starting
  before stage k had finished all its forwards (no overlap at all).
* Each stage's forward and its recompute + backward are `tf.function`s
  traced once and called per micro-batch, so tracing costs O(K), not
  O(K·M). (Stages that keep their activations — recompute 'never', or the
  last stage with 'except_last' — need the forward's tape, so they are
  emitted inline.)
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
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.core.fprop_context import StatsCollector

StageFn = Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]
RECOMPUTE_POLICIES = ('always', 'except_last', 'never')


@dataclasses.dataclass
class Stage:
  """One composite stage: `fprop(theta, inputs) -> outputs`, on `device`."""
  fprop: StageFn
  theta: Any
  device: str


def _differentiable(x: tf.Tensor) -> bool:
  return x.dtype.is_floating or x.dtype.is_complex


def _float(leaves: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  return [x for x in leaves if x is not None and _differentiable(x)]


def _chained(x: Any, after: Sequence[tf.Tensor]) -> Any:
  """`x` (a nest) behind identities that wait for `after`."""
  with tf.control_dependencies(list(after)):
    return tf.nest.map_structure(tf.identity, x)


def _index(m: int) -> tf.Tensor:
  """Micro-batch index m as a tensor that Grappler will not constant-fold.

  A constant argument makes Grappler specialise the called stage function
  per value — M optimised copies of every stage body, which made the first
  call of a K=1, M=8 Transformer step take ~20 s instead of ~1 s.
  """
  return tf.compat.v1.placeholder_with_default(tf.constant(m, tf.int32), [])


def _unordered(outputs: Sequence[tf.Tensor]) -> None:
  """Exempts the ops producing `outputs` from tf.function's ordering.

  With a timeline the stage bodies hold `tf.timestamp()`, a stateful op, so
  their calls become stateful, and tf.function's automatic control
  dependencies chain every stateful op in program order — all stages in one
  sequence, no overlap. The calls are already ordered by data; mark them
  independent instead.
  """
  if not outputs or tf.executing_eagerly():
    return
  manager = getattr(outputs[0].graph, 'experimental_acd_manager', None)
  if manager is not None:
    for op in {t.op for t in outputs}:
      manager.run_independently(op)


def _stamp(after: Sequence[tf.Tensor]) -> tf.Tensor:
  """`tf.timestamp()` taken once `after` exist."""
  with tf.control_dependencies(list(after)):
    return tf.timestamp()


class _StageOps:
  """The ops of one stage: traced forward and recompute+backward bodies."""

  def __init__(self, builder: '_Builder', stage: Stage) -> None:
    self.b = builder
    self.stage = stage
    # Eagerly (debugging, tests) the bodies run op by op: tracing them per
    # call would only add time.
    wrap = ((lambda f: f) if tf.executing_eagerly() else
            (lambda f: tf.function(f, autograph=False, experimental_attributes={'_noinline': True})))
    self.forward = wrap(self._forward)
    self.backward = wrap(self._backward)

  def _forward(self, theta: Any, x: Any, after: list[tf.Tensor],
               m: tf.Tensor, step: tf.Tensor
              ) -> tuple[Any, dict[str, Any], list[tf.Tensor]]:
    with tf.device(self.stage.device):
      return self._forward_on_device(theta, _chained(x, after), m, step)

  def _backward(self, theta: Any, x: Any, dys: list[tf.Tensor],
                after: list[tf.Tensor], m: tf.Tensor, step: tf.Tensor,
                acc: Any) -> tuple[list[tf.Tensor], Any, list[tf.Tensor]]:
    # A called function's ops do not inherit the caller's device scope: left
    # unpinned they ran on the client, serialising remote stages.
    with tf.device(self.stage.device):
      return self._backward_on_device(theta, x, dys, after, m, step, acc)

  def _forward_on_device(self, theta: Any, x: Any, m: tf.Tensor,
                         step: tf.Tensor
                        ) -> tuple[Any, dict[str, Any], list[tf.Tensor]]:
    times = [_stamp(_float(tf.nest.flatten(x)))] if self.b.timed else []
    collector = StatsCollector()
    with self.b.scope(m, collector, step), tf.control_dependencies(times):
      y = self.stage.fprop(theta, x)
    if self.b.timed:
      times.append(_stamp(_float(tf.nest.flatten(y))))
    return y, collector.stats, times

  def _backward_on_device(self, theta: Any, x: Any, dys: list[tf.Tensor],
                          after: list[tf.Tensor], m: tf.Tensor,
                          step: tf.Tensor, acc: Any
                         ) -> tuple[list[tf.Tensor], Any, list[tf.Tensor]]:
    """dx, and `acc` + this micro-batch's theta gradient: accumulating in
    the traced body keeps the outer graph from growing by one add per
    variable and micro-batch (2,000 ops at M=64 for 32 variables)."""
    # The recompute waits for the incoming gradient (else Grappler merges it
    # with the forward) and for this device's previous backward (order).
    x = _chained(x, list(dys) + list(after))
    times = [_stamp(_float(tf.nest.flatten(x)))] if self.b.timed else []
    with tf.GradientTape() as tape, tf.control_dependencies(times):
      x_float = _float(tf.nest.flatten(x))
      tape.watch([x_float, theta])
      with self.b.scope(m, None, step):
        y = self.stage.fprop(theta, x)
    targets = _float(tf.nest.flatten(y))
    if self.b.timed:
      times.append(_stamp(targets))
    with tf.control_dependencies(times[1:]):
      dx, dtheta = tape.gradient(
          targets, (x_float, theta), output_gradients=list(dys),
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if self.b.timed:
      times.append(_stamp(tf.nest.flatten((dx, dtheta))))
    return dx, tf.nest.map_structure(tf.add, acc, dtheta), times


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
    ctx = fprop_context.current()
    self.step = tf.compat.v1.placeholder_with_default(
        tf.cast(ctx.step, tf.int64), [])  # Not folded: see _index.
    self.timeline = ctx.timeline
    self.timed = ctx.timeline is not None
    self.ops = [_StageOps(self, stage) for stage in stages]
    k = len(stages)
    self.boundary: list[list[Any]] = [[None] * self.m for _ in range(k)]
    self.outputs: list[list[Any]] = [[None] * self.m for _ in range(k)]
    self.tapes: dict[tuple[int, int], tf.GradientTape] = {}

  def keeps(self, k: int) -> bool:
    """True if stage k keeps its forward activations (no recompute)."""
    last = k == len(self.stages) - 1
    return self.recompute == 'never' or (self.recompute == 'except_last' and
                                         last)

  def scope(self, m: Any, stats: StatsCollector | None, step: Any) -> Any:
    return fprop_context.scope(
        training=True, step=step, micro_batch_index=m,
        num_micro_batches=self.m, batch_dim=self.batch_dim, stats=stats)

  def _record(self, k: int, m: int, kinds: str,
              times: list[tf.Tensor]) -> None:
    if self.timed:
      for i, kind in enumerate(kinds):
        self.timeline.append((k, m, kind, times[i], times[i + 1]))

  def _kept_forward(self, k: int, m: int, theta: Any, x: Any) -> Any:
    """Inline forward under a tape that the backward will reuse."""
    times = [_stamp(_float(tf.nest.flatten(x)))] if self.timed else []
    collector = StatsCollector()
    with tf.GradientTape() as tape, tf.control_dependencies(times):
      tape.watch(_float(tf.nest.flatten((x, theta))))
      with self.scope(m, collector, self.step):
        y = self.stages[k].fprop(theta, x)
    self.tapes[(k, m)] = tape
    if self.timed:
      times.append(_stamp(_float(tf.nest.flatten(y))))
    return y, collector.stats, times

  def forward(self, inputs: tuple[Any, ...], thetas: list[Any]
             ) -> tuple[list[Any], list[dict[str, Any]]]:
    """Emits all forwards; returns per-micro-batch outputs and stage stats."""
    with tf.device(self.stages[0].device):  # Not on the client.
      micro = microbatch.split(inputs, self.m, self.batch_dim)
    stage_stats = []
    for k, stage in enumerate(self.stages):
      totals = StatsCollector()
      after: list[tf.Tensor] = []
      for m in range(self.m):
        with tf.device(stage.device):
          # Forward m after forward m−1 on this device.
          if self.keeps(k):  # Inline ops: a control dependency orders them.
            x = self.boundary[k][m] = _chained(micro[m], after)
            y, stats, times = self._kept_forward(k, m, thetas[k], x)
          else:  # A call: the order is a data input (see the module doc).
            x = self.boundary[k][m] = _chained(micro[m], [])
            y, stats, times = self.ops[k].forward(
                thetas[k], x, after or [tf.zeros([])], _index(m), self.step)
            _unordered(times)
          self._record(k, m, 'F', times)
          totals.merge(stats)
        self.outputs[k][m] = y
        after = _float(tf.nest.flatten(y))
      micro = self.outputs[k]
      stage_stats.append(totals.stats)
    return self.outputs[-1], stage_stats

  def _stage_backward(self, k: int, m: int, dy: Any, theta: Any,
                      after: list[tf.Tensor], acc: Any) -> tuple[Any, Any]:
    """Recompute (unless kept) and backward of stage k, micro-batch m.

    Returns dx and `acc` (None: nothing yet) + the theta gradient.
    """
    targets, grads = [], []
    for y, g in zip(tf.nest.flatten(self.outputs[k][m]), tf.nest.flatten(dy)):
      if _differentiable(y):
        targets.append(y)
        grads.append(tf.zeros_like(y) if g is None else g)
    x = self.boundary[k][m]
    if self.keeps(k):
      wait = grads + after
      times = [_stamp(wait)] if self.timed else []
      with tf.control_dependencies(wait + times):
        dx_float, dtheta = self.tapes.pop((k, m)).gradient(
            targets, (_float(tf.nest.flatten(x)), theta),
            output_gradients=grads,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      if self.timed:
        times.append(_stamp(tf.nest.flatten((dx_float, dtheta))))
      self._record(k, m, 'B', times)
      if acc is not None:
        dtheta = tf.nest.map_structure(tf.add, acc, dtheta)
    else:
      # (`after` and `acc` are never empty/None, so the body is traced
      # once, not twice.)
      if acc is None:
        acc = tf.nest.map_structure(tf.zeros_like, theta)
      dx_float, dtheta, times = self.ops[k].backward(
          theta, x, grads, after or [tf.zeros([])], _index(m), self.step,
          acc)
      _unordered(times)
      self._record(k, m, 'RB', times)
    it = iter(dx_float)
    dx = [next(it) if _differentiable(v) else None
          for v in tf.nest.flatten(x)]
    return tf.nest.pack_sequence_as(x, dx), dtheta

  def backward(self, dys: list[Any], thetas: list[Any]
              ) -> tuple[Any, list[Any]]:
    """Emits all backwards; returns (input grads per micro-batch, theta grads)."""
    num_stages = len(self.stages)
    theta_grads: list[Any] = [None] * num_stages
    grads_in = dys
    for k in reversed(range(num_stages)):
      grads_out: list[Any] = [None] * self.m
      after: list[tf.Tensor] = []
      for m in reversed(range(self.m)):  # Backward m after backward m+1.
        with tf.device(self.stages[k].device):
          dy = tf.nest.map_structure(
              lambda g: g if g is None else tf.identity(g), grads_in[m])
          dx, theta_grads[k] = self._stage_backward(k, m, dy, thetas[k],
                                                    after, theta_grads[k])
        grads_out[m] = dx
        after = _float(tf.nest.flatten((dx, theta_grads[k])))
      grads_in = grads_out
    return grads_in, theta_grads


@tf.autograph.experimental.do_not_convert  # Graph code already; see below.
def run(stages: list[Stage], inputs: tuple[Any, ...], num_micro_batches: int,
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

  AutoGraph is kept out (users' `tf.function`s convert by default): the
  pipeline is explicit graph code, and converting it and every layer under
  it only slows tracing and, in one run, broke on a converted constructor.

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
  def _pipelined(*args: tf.Tensor) -> Any:
    xs = tf.nest.pack_sequence_as(inputs, list(args[:len(in_leaves)]))
    pos, ths = len(in_leaves), []
    for leaves, theta in zip(theta_leaves, thetas):
      ths.append(tf.nest.pack_sequence_as(theta, list(args[pos:pos +
                                                             len(leaves)])))
      pos += len(leaves)
    micro_outputs, stats = builder.forward(xs, ths)
    with tf.device(stages[-1].device):
      out = microbatch.concat(micro_outputs, batch_dim)
    out_struct.append(out)
    stats_struct.append(stats)
    flat_out = tf.nest.flatten(out)
    flat_stats = tf.nest.flatten(stats)

    def _grad(*dys: tf.Tensor) -> list[tf.Tensor | None]:
      dy = tf.nest.pack_sequence_as(out, list(dys[:len(flat_out)]))
      with tf.device(stages[-1].device):
        dy = tf.nest.map_structure(
            lambda g, y: tf.zeros_like(y) if g is None else g, dy, out)
        dy_micro = microbatch.split(dy, num_micro_batches, batch_dim)
      dx_micro, dthetas = builder.backward(dy_micro, ths)
      with tf.device(stages[0].device):
        dx = microbatch.concat(dx_micro, batch_dim)
      dx_leaves = [g if _differentiable(x) else None
                   for g, x in zip(tf.nest.flatten(dx), in_leaves)]
      return dx_leaves + [g for d in dthetas for g in tf.nest.flatten(d)]

    return flat_out + flat_stats, _grad

  flat = _pipelined(*in_leaves, *[x for leaves in theta_leaves for x in leaves])
  n_out = len(tf.nest.flatten(out_struct[0]))
  outputs = tf.nest.pack_sequence_as(out_struct[0], flat[:n_out])
  stats = tf.nest.pack_sequence_as(stats_struct[0], flat[n_out:])
  collector = fprop_context.current().stats
  if collector is not None:
    for stage_stats in stats:
      collector.merge(stage_stats)
  return outputs
