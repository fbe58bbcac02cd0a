"""A function cut out of a traced graph, between any of its tensors.

The split backward traces a stage's forward, I and W once, as one graph,
and runs pieces of it: the forward alone, I from the forward's saved
values, W from I's kept ones. Each piece is a function whose inputs are
tensors in the middle of that graph. `WrappedFunction.prune` does this,
but copies the piece op by op in Python (~1 ms per op: 14 s for the five
pieces of four small Transformer layers). Here the piece's ops are
selected by a walk (`split_graph.walk`) and imported as a GraphDef, in
C++, with the cut tensors mapped to the new function's arguments.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from lingvo_pipe import errors
from lingvo_pipe.pipeline import split_graph


class CutError(errors.LingvoPipeError):
  """A piece needs a tensor that is neither fed nor computable."""


def cut(graph: Any, feeds: Sequence[tf.Tensor], fetches: Sequence[tf.Tensor],
        name: str, whole: graph_pb2.GraphDef | None = None
       ) -> Callable[..., list[tf.Tensor]]:
  """The function feeds → fetches (flat lists) of a wrap_function graph.

  Args:
    graph: the FuncGraph that holds every tensor below.
    feeds: the new function's arguments.
    fetches: its results (a fetch may be a feed).
    name: for the new function's graph.
    whole: `graph.as_graph_def()`, if the caller has it already.

  Raises:
    CutError: a fetch depends on a placeholder that is not fed.
  """
  fed = {t.ref() for t in feeds}
  captured = {internal.ref(): external
              for external, internal in graph.captures}
  outside, body = split_graph.walk(
      fetches, lambda op: op.type != 'Placeholder', set(), fed)
  missing = [t.name for t in outside if t.ref() not in captured]
  if missing:
    raise CutError(f'{name}: {missing} are neither fed nor computable')
  sub = graph_pb2.GraphDef()
  whole = whole or graph.as_graph_def()
  sub.versions.CopyFrom(whole.versions)
  sub.library.CopyFrom(whole.library)
  names = {op.name for op in body}
  for node in whole.node:
    if node.name in names:
      copy = sub.node.add()
      copy.CopyFrom(node)
      if '_class' in copy.attr:  # Colocation with ops left outside.
        del copy.attr['_class']
  read = {t.ref() for op in body for t in op.inputs}  # Not pass-throughs.
  used = [i for i, t in enumerate(feeds) if t.ref() in read]
  position = {t.ref(): i for i, t in enumerate(feeds)}
  computed = [t.name for t in fetches if t.ref() not in fed]

  def _piece(*args: tf.Tensor) -> list[tf.Tensor]:
    input_map = {feeds[i].name: args[i] for i in used}
    input_map.update({t.name: captured[t.ref()] for t in outside})
    results = iter(tf.graph_util.import_graph_def(
        sub, input_map=input_map, return_elements=computed,
        name='cut') if computed else [])
    return [args[position[t.ref()]] if t.ref() in fed else next(results)
            for t in fetches]

  specs = [tf.TensorSpec(t.shape, t.dtype) for t in feeds]
  fn = tf.compat.v1.wrap_function(_piece, specs, name=name)
  return lambda *args: list(fn(*args)) if fetches else []
