"""What a layer may know about the call it is in, besides theta and inputs.

`FProp` is stateless: it reads only theta and its inputs. Three facts about
the *call* still matter to some layers, and they are passed here rather than
through every signature:

* `training` — BatchNorm normalises by batch statistics, Dropout drops.
* `step`, `batch_axis`, `first_example`, `global_batch_size` — Dropout
  derives its mask from the step, the layer path and each example's index
  in the global batch (the mini-batch of every data-parallel replica), so the
  recompute pass of the pipeline draws exactly the forward pass's mask, and
  the mask of an example does not depend on how the batch was cut into
  micro-batches or replicas. `batch_axis` is the axis that holds the batch
  (1 for time-major [T, B, ...] activations); `first_example` is the global
  index of this call's first example; `global_batch_size` is None when this
  call sees the whole batch. `micro_batch_index` and `num_micro_batches`
  say which micro-batch of how many this is.
* `timeline` — if a list, the pipeline appends one
  `(stage, micro_batch, kind, start, end)` record per forward ('F'),
  recompute ('R') and backward ('B'), with `tf.timestamp()` tensors that the
  caller returns from its step function (see `lingvo_pipe.pipeline.timeline`).
* `stats` — a collector for sufficient statistics (BatchNorm's count, sum,
  sum of squares). Layers add to it; the pipeline sums it over micro-batches
  and the task folds it into moving averages once per step. A recompute pass
  runs with no collector, so nothing is counted twice.

The engine and the trainer open contexts; layers only read `current()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import tensorflow as tf

from lingvo_pipe.core.nested_map import NestedMap


class StatsCollector:
  """Sums named trees of tensors added by layers during one or more FProps."""

  def __init__(self, stats: dict[str, NestedMap] | None = None) -> None:
    self._stats: dict[str, NestedMap] = dict(stats or {})

  def add(self, path: str, stats: NestedMap) -> None:
    if path in self._stats:
      stats = tf.nest.map_structure(tf.add, self._stats[path], stats)
    self._stats[path] = stats

  def merge(self, other: dict[str, NestedMap]) -> None:
    for path, stats in other.items():
      self.add(path, stats)

  @property
  def stats(self) -> dict[str, NestedMap]:
    return dict(self._stats)


@dataclasses.dataclass(frozen=True)
class FPropContext:
  """The facts about one FProp call (see the module docstring)."""
  training: bool = False
  step: Any = 0
  micro_batch_index: Any = 0
  num_micro_batches: int = 1
  batch_axis: int = 0
  first_example: Any = 0
  global_batch_size: Any = None
  stats: StatsCollector | None = None
  timeline: list[Any] | None = None


_LOCAL = threading.local()


def current() -> FPropContext:
  """The innermost open context; an inference context if none is open."""
  stack = getattr(_LOCAL, 'stack', None)
  return stack[-1] if stack else FPropContext()


@contextlib.contextmanager
def scope(**overrides: Any) -> Iterator[FPropContext]:
  """Opens a context that changes some fields of the current one."""
  ctx = dataclasses.replace(current(), **overrides)
  stack = getattr(_LOCAL, 'stack', None)
  if stack is None:
    stack = _LOCAL.stack = []
  stack.append(ctx)
  try:
    yield ctx
  finally:
    stack.pop()
