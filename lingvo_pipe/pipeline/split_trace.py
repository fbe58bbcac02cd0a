"""Traces one stage's forward, I and W as one graph, and cuts it up.

`split_backward.py` says what the pieces are for; `split_graph.py` how the
graph is read; `graph_cut.py` how a piece becomes a function of tensors in
the middle of the graph — which is what makes `saved` and `kept` plain
values that any later op (another loop iteration, another function) can
read. Each piece is cut the first time it runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import tensorflow as tf

from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import graph_cut
from lingvo_pipe.pipeline import split_graph
from lingvo_pipe.pipeline.stage import Stage, differentiable, float_leaves


def num_bytes(specs: list[tf.TensorSpec]) -> int:
  """Bytes of tensors of these specs (unknown dimensions count as 1)."""
  return sum(tf.TensorShape([d or 1 for d in s.shape]).num_elements() *
             s.dtype.size for s in specs)


def _specs(tensors: list[tf.Tensor]) -> list[tf.TensorSpec]:
  return [tf.TensorSpec(t.shape, t.dtype) for t in tensors]


@dataclasses.dataclass
class _Graph:
  """The traced tensors, by part (filled in while tracing)."""
  wrapped: Any = None  # The wrap_function holding the graph.
  inputs: list[tf.Tensor] = dataclasses.field(default_factory=list)
  x: list[tf.Tensor] = dataclasses.field(default_factory=list)
  theta: list[tf.Tensor] = dataclasses.field(default_factory=list)
  y: list[tf.Tensor] = dataclasses.field(default_factory=list)
  stats: list[tf.Tensor] = dataclasses.field(default_factory=list)
  dys: list[tf.Tensor] = dataclasses.field(default_factory=list)
  dx: list[tf.Tensor] = dataclasses.field(default_factory=list)
  dtheta: list[tf.Tensor] = dataclasses.field(default_factory=list)
  acc: list[tf.Tensor] = dataclasses.field(default_factory=list)
  summed: list[tf.Tensor] = dataclasses.field(default_factory=list)
  analysis: split_graph.Analysis | None = None
  parts: dict[str, set[tf.Operation]] = dataclasses.field(
      default_factory=dict)
  structures: dict[str, Any] = dataclasses.field(default_factory=dict)
  reason: str = ''


class Traced:
  """One stage's split, traced for one input signature.

  Each piece takes and returns flat lists of tensors:
    forward(θ, x, side, m, step) → y, stats, saved
    recompute(θ, x, side, m, step) → saved
    input_grad(θ, x, side, m, step, dy) → dx, kept
    input_grad_saved(θ, saved, dy) → dx, kept
    weight_grad(θ, kept, acc) → acc + dθ;  weight_grad_first(θ, kept) → dθ
  (x: its non-None leaves; dx: its float leaves; dy: y's float leaves).
  """

  def __init__(self, g: _Graph, kept: list[tf.Tensor],
               saved: list[tf.Tensor]) -> None:
    self._g, self._kept, self._saved = g, kept, saved
    self.structures = g.structures  # 'y', 'stats', 'theta', 'x' (specs).
    self.num_dx = len(g.dx)
    self.kept_specs = _specs(kept)
    self.saved_specs = _specs(saved)
    # Memory: views of one buffer (a reshape of another kept tensor) count
    # once.
    self._kept_buffers = _specs(split_graph.distinct(kept))
    self._saved_buffers = _specs(split_graph.distinct(saved))
    self.reason = g.reason  # Why I computes dθ too (kept holds it); ''.
    # Ops whose whole backward W re-runs (split_graph.Analysis.whole).
    self.whole = list(g.analysis.whole) if not g.reason else []

  @property
  def split(self) -> bool:
    return not self.reason

  @property
  def kept_bytes(self) -> int:
    """Bytes I leaves for W, per micro-batch."""
    return num_bytes(self._kept_buffers)

  @property
  def saved_bytes(self) -> int:
    """Bytes a kept forward leaves for its I, per micro-batch."""
    return num_bytes(self._saved_buffers)

  @functools.cached_property
  def _graph_def(self) -> Any:
    return self._g.wrapped.graph.as_graph_def()

  def _cut(self, feeds: list[tf.Tensor], fetches: list[tf.Tensor],
           name: str) -> Callable[..., list[tf.Tensor]]:
    return graph_cut.cut(self._g.wrapped.graph, feeds, fetches, name,
                         self._graph_def)

  @functools.cached_property
  def forward(self) -> Callable[..., list[tf.Tensor]]:
    g = self._g
    return self._cut(g.inputs, g.y + g.stats + self._saved, 'forward')

  @functools.cached_property
  def recompute(self) -> Callable[..., list[tf.Tensor]]:
    """The forward again, for I only: saved (no outputs, no statistics)."""
    g = self._g
    return self._cut(g.inputs, self._saved, 'recompute')

  @functools.cached_property
  def input_grad(self) -> Callable[..., list[tf.Tensor]]:
    g = self._g
    return self._cut(g.inputs + g.dys, g.dx + self._kept, 'input_grad')

  @functools.cached_property
  def input_grad_saved(self) -> Callable[..., list[tf.Tensor]]:
    g = self._g
    return self._cut(g.theta + self._saved + g.dys, g.dx + self._kept,
                     'input_grad_saved')

  @functools.cached_property
  def weight_grad(self) -> Callable[..., list[tf.Tensor]]:
    g = self._g
    return self._cut(g.theta + self._kept + g.acc, g.summed, 'weight_grad')

  @functools.cached_property
  def weight_grad_first(self) -> Callable[..., list[tf.Tensor]]:
    """W with no accumulator: dθ."""
    g = self._g
    return self._cut(g.theta + self._kept, g.dtheta, 'weight_grad_first')


def _ops_since(graph: tf.Graph, first: int) -> list[tf.Operation]:
  return graph.get_operations()[first:]


def _trace_forward(stage: Stage, scope: Callable[..., Any], g: _Graph,
                   theta: Any, x: Any, side: Any, m: tf.Tensor,
                   step: tf.Tensor) -> list[tf.Tensor]:
  """Runs the stage's forward; returns the float outputs."""
  graph = tf.compat.v1.get_default_graph()
  first = len(graph.get_operations())
  collector = StatsCollector()
  with scope(m, collector, step):
    y = stage.fprop(theta, x) if side is None else stage.fprop(theta, x, side)
  g.parts['F'] = set(_ops_since(graph, first))
  g.structures.update(y=y, stats=collector.stats)
  g.y = list(tf.nest.flatten(y))
  g.stats = tf.nest.flatten(collector.stats)
  g.analysis = split_graph.analyse(_ops_since(graph, first), g.theta)
  return float_leaves(y)


def _trace_input_grad(g: _Graph, y_float: list[tf.Tensor]
                     ) -> dict[tf.Operation, dict[int, tf.Tensor]]:
  """dx and the gradients at the mixing ops' outputs (dz, by op)."""
  graph = tf.compat.v1.get_default_graph()
  first = len(graph.get_operations())
  g.dys = [tf.compat.v1.placeholder(t.dtype, t.shape, name='dy')
           for t in y_float]
  x_float = [t for t in g.x if differentiable(t)]
  outs = [(op, i, t) for op in g.analysis.mixing
          for i, t in enumerate(op.outputs) if t.dtype.is_floating
          ] if not g.reason else []
  sources = x_float + [t for _, _, t in outs]
  if g.reason:  # Fused: dθ here, with dx.
    sources += g.theta
  grads = tf.gradients(y_float, sources, grad_ys=g.dys) if y_float else [
      None] * len(sources)
  g.dx = [split_graph.zeros(t) if d is None else d
          for t, d in zip(x_float, grads[:len(x_float)])]
  dz: dict[tf.Operation, dict[int, tf.Tensor]] = {}
  for (op, i, _), d in zip(outs, grads[len(x_float):]):
    if d is not None:
      dz.setdefault(op, {})[i] = d
  if g.reason:  # For W to add.
    g.dtheta = [split_graph.zeros(t) if d is None else tf.convert_to_tensor(d)
                for t, d in zip(g.theta, grads[len(sources) - len(g.theta):])]
  g.parts['I'] = set(_ops_since(graph, first))
  return dz


def _trace_weight_grad(g: _Graph,
                       dz: dict[tf.Operation, dict[int, tf.Tensor]]) -> None:
  """dθ: each mixing op's local gradient, carried back to θ."""
  graph = tf.compat.v1.get_default_graph()
  first = len(graph.get_operations())
  if not g.reason:
    by_tensor: dict[Any, list[Any]] = {}
    for op, grads in dz.items():
      for w, dw in split_graph.local_weight_grads(op, grads,
                                                  g.analysis.derived):
        by_tensor.setdefault(w.ref(), [w]).append(tf.convert_to_tensor(dw))
    ws = [v[0] for v in by_tensor.values()]
    dws = [v[1] if len(v) == 2 else tf.add_n(v[1:])
           for v in by_tensor.values()]
    grads = tf.gradients(ws, g.theta, grad_ys=dws) if ws else [None] * len(
        g.theta)
    g.dtheta = [split_graph.zeros(t) if d is None else tf.convert_to_tensor(d)
                for t, d in zip(g.theta, grads)]
  g.acc = [tf.compat.v1.placeholder(t.dtype, t.shape, name='acc')
           for t in g.theta]
  g.summed = [a + d for a, d in zip(g.acc, g.dtheta)]
  g.parts['W'] = set(_ops_since(graph, first))


def _pack(structure: Any, leaves: list[tf.Tensor]) -> Any:
  """`structure`'s None leaves stay None; the others come from `leaves`."""
  flat = tf.nest.flatten(structure)
  it = iter(leaves)
  return tf.nest.pack_sequence_as(
      structure, [None if t is None else next(it) for t in flat])


def _trace_graph(stage: Stage, scope: Callable[..., Any], structures: tuple,
                 specs: list[tf.TensorSpec], fused: str) -> _Graph:
  """The graph of forward + I + W (`fused`: why not to split)."""
  theta, x, side = structures
  n_theta = len(tf.nest.flatten(theta))
  n_x = len([t for t in tf.nest.flatten(x) if t is not None])
  g = _Graph(reason=fused)

  def _fn(*flat: tf.Tensor) -> None:
    g.inputs = list(flat)
    g.theta = list(flat[:n_theta])
    g.x = list(flat[n_theta:n_theta + n_x])
    side_leaves = list(flat[n_theta + n_x:-2])
    with tf.device(stage.device):
      y_float = _trace_forward(
          stage, scope, g, tf.nest.pack_sequence_as(theta, g.theta),
          _pack(x, g.x), None if side is None else tf.nest.pack_sequence_as(
              side, side_leaves), flat[-2], flat[-1])
      dz = _trace_input_grad(g, y_float)
      _trace_weight_grad(g, dz)

  g.wrapped = tf.compat.v1.wrap_function(_fn, specs)
  g.structures['theta'] = theta
  g.structures['x'] = _pack(x, [tf.TensorSpec(t.shape, t.dtype) for t in g.x])
  return g


def trace(stage: Stage, scope: Callable[..., Any], structures: tuple,
          specs: list[tf.TensorSpec]) -> Traced:
  """Traces the split of `stage` for one signature.

  Args:
    stage: the stage.
    scope: (m, stats, step) → the fprop_context of one micro-batch.
    structures: (theta, x, side) as nests (leaves: anything; x's None
      leaves are no inputs).
    specs: θ's leaves, x's non-None leaves, side's leaves, then m (int32)
      and step (int64).
  """
  try:
    g = _trace_graph(stage, scope, structures, specs, '')
    kept, saved = _boundaries(g)
  except (split_graph.BoundaryError, split_graph.LocalGradError) as e:
    # Not split: I computes dθ with dx (B's cost), W only adds it.
    g = _trace_graph(stage, scope, structures, specs, str(e))
    kept, saved = _boundaries(g)
  return Traced(g, kept, saved)


def _boundaries(g: _Graph) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
  """kept (what W reads from the forward and I) and saved (what I reads
  from the forward, plus kept's part of the forward)."""
  weight = g.analysis.weight
  kept, _ = split_graph.walk(g.summed, g.parts['W'].__contains__, weight,
                                {t.ref() for t in g.theta + g.acc})
  from_i = [t for t in kept if t.op in g.parts['I']]
  from_f = [t for t in kept if t.op not in g.parts['I']]
  saved, _ = split_graph.walk(g.dx + from_i, g.parts['I'].__contains__,
                                 weight, {t.ref() for t in g.theta + g.dys})
  seen = {t.ref() for t in saved}
  saved += [t for t in from_f if t.ref() not in seen]
  return kept, saved
