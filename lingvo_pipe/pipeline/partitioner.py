"""Cutting a sequence of layers into K pipeline stages of balanced cost.

A GPipe step runs at the pace of its slowest stage: with K stages and M
micro-batches every clock tick lasts as long as the most expensive stage, so
the step time is (M + K - 1) × max_k cost_k. The quantity to minimise is
therefore the *maximum* stage cost, and a greedy "fill each stage up to
total/K" cut can miss the optimum by a whole layer. `partition` returns the
exact optimum T* over all contiguous cuts, and among the many cuts that reach
T* it picks a balanced one, because the other stages' costs still matter:
they set memory per device and they are the slack that absorbs cost
estimation errors.

How: T* is the least T for which greedy packing of stages ≤ T needs at most
K stages; bisecting T over the bit patterns of floats finds it exactly in
≤ 64 greedy passes. A DP over stages then picks, among the cuts with every
stage ≤ T*, the one with the least Σ stage_cost², then the least
Σ stage_layers², then the earliest start of the last stage (then of the one
before, and so on). All-zero costs therefore cut by layer count (10 layers
into 4 stages: 2, 3, 2, 3). Cost: O(K L log L); L=1000, K=64 takes ~0.1 s.

Every stage cost is computed as a difference of one prefix-sum array, in every
comparison, so float rounding cannot make the two passes disagree.

>>> partition([1, 2, 3, 4, 5], 2)
[0, 3, 5]
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
import struct
from typing import Sequence

import numpy as np

from lingvo_pipe import errors

__all__ = [
    'PartitionError', 'PartitionReport', 'StageSummary', 'check_boundaries',
    'bubble_fraction', 'check_split_points', 'format_quantity', 'format_table',
    'make_report', 'partition',
]


class PartitionError(errors.LingvoPipeError):
  """Costs, stage counts or boundaries that cannot define a partition."""


# ---- Validation -------------------------------------------------------------
def _check_counts(num_layers: int, num_stages: int) -> None:
  if isinstance(num_stages, bool) or not isinstance(num_stages,
                                                    numbers.Integral):
    raise PartitionError(f'num_stages must be an int, got {num_stages!r}.')
  if num_stages < 1:
    raise PartitionError(f'num_stages must be ≥ 1, got {num_stages}: use '
                         'num_stages=1 to run without a pipeline.')
  if num_stages > num_layers:
    raise PartitionError(
        f'{num_stages} stages but only {num_layers} layers: use num_stages ≤ '
        f'{num_layers}, or split layers into smaller ones.')


def _check_costs(costs: Sequence[float]) -> np.ndarray:
  if len(costs) == 0:
    raise PartitionError('costs is empty: give one cost per layer (e.g. '
                         'FPropMeta flops); a pipeline needs ≥ 1 layer.')
  values = []
  for i, c in enumerate(costs):
    try:
      value = float(c)
    except (TypeError, ValueError) as e:
      raise PartitionError(f'costs[{i}] = {c!r} is not a number.') from e
    if math.isnan(value) or math.isinf(value) or value < 0:
      raise PartitionError(
          f'costs[{i}] = {value} (layer {i}) must be finite and ≥ 0: fix that '
          "layer's cost estimate (e.g. its FPropMeta flops); 0 is allowed.")
    values.append(value)
  return np.asarray(values, dtype=np.float64)


def check_boundaries(boundaries: Sequence[int], num_layers: int) -> list[int]:
  """Validates full boundaries [0, b1, ..., L] and returns them as ints.

  Raises:
    PartitionError: not starting at 0, not ending at `num_layers`, not ints,
      or a stage that would be empty.
  """
  b = list(boundaries)
  if len(b) < 2 or b[0] != 0 or b[-1] != num_layers:
    raise PartitionError(
        f'boundaries {b} must start at 0 and end at num_layers={num_layers} '
        '(stage k is layers [b[k], b[k+1])), e.g. [0, '
        f'{num_layers // 2 or 1}, {num_layers}].')
  for k, x in enumerate(b):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
      raise PartitionError(f'boundaries[{k}] = {x!r} is not an int layer '
                           'index.')
    if k and x <= b[k - 1]:
      raise PartitionError(
          f'boundaries {b} must be strictly increasing (every stage '
          f'non-empty), but boundaries[{k}] = {x} ≤ boundaries[{k - 1}] = '
          f'{b[k - 1]}.')
  return [int(x) for x in b]


def check_split_points(split_points: Sequence[int], num_layers: int,
                       num_stages: int) -> list[int]:
  """Validates user-given interior boundaries; returns the full boundaries.

  Args:
    split_points: K-1 strictly increasing layer indices in (0, L); stage k
      starts at layer split_points[k-1].
    num_layers: L.
    num_stages: K.

  Returns:
    [0, *split_points, L].

  Raises:
    PartitionError: naming the offending entry and how to fix it.
  """
  _check_counts(num_layers, num_stages)
  points = list(split_points)
  example = [round(k * num_layers / num_stages) for k in range(1, num_stages)]
  if len(points) != num_stages - 1:
    raise PartitionError(
        f'split_points {points} has {len(points)} entries but num_stages='
        f'{num_stages} needs {num_stages - 1} (the first layer of each stage '
        f'after the first), e.g. {example}.')
  for i, x in enumerate(points):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
      raise PartitionError(f'split_points[{i}] = {x!r} is not an int layer '
                           f'index; e.g. split_points={example}.')
    if not 0 < x < num_layers:
      raise PartitionError(
          f'split_points[{i}] = {x} is outside (0, {num_layers}): each is the '
          f'index of a stage\'s first layer, between 1 and {num_layers - 1}.')
    if i and x <= points[i - 1]:
      raise PartitionError(
          f'split_points must be strictly increasing (every stage non-empty), '
          f'but split_points[{i}] = {x} ≤ split_points[{i - 1}] = '
          f'{points[i - 1]}; e.g. split_points={example}.')
  return [0] + [int(x) for x in points] + [num_layers]


# ---- The exact partition ----------------------------------------------------
def partition(costs: Sequence[float], num_stages: int) -> list[int]:
  """The contiguous K-way cut with the least maximum stage cost.

  Args:
    costs: per-layer cost (flops, seconds, ...), finite and ≥ 0.
    num_stages: K, 1 ≤ K ≤ len(costs).

  Returns:
    K+1 boundaries [0, b1, ..., L]; stage k is layers [b[k], b[k+1]), every
    stage non-empty. Ties are broken as the module docstring says.

  Raises:
    PartitionError: empty or invalid costs, or an impossible num_stages.
  """
  values = _check_costs(costs)
  num_layers = len(values)
  _check_counts(num_layers, num_stages)
  if not values.any():  # All zero: every cut is optimal; balance layer counts.
    return [k * num_layers // num_stages for k in range(num_stages + 1)]
  prefix = np.concatenate([[0.0], np.cumsum(values)])
  prefix_list = prefix.tolist()
  limit = _min_max_cost(prefix_list, num_stages)
  # Stage k's last boundary b[k] must lie in [low[k], high[k]] for any cut
  # with every stage ≤ limit (and every stage non-empty).
  left = _greedy_left(prefix_list, limit, num_stages)
  right = _greedy_right(prefix_list, limit, num_stages)
  low = [max(k, right[k]) for k in range(num_stages + 1)]
  high = [min(left[k], num_layers - num_stages + k)
          for k in range(num_stages + 1)]
  return _balanced_cut(prefix, limit, low, high)


def _greedy_left(prefix: list[float], limit: float,
                 num_stages: int) -> list[int]:
  """left[k]: the farthest layer that k stages of cost ≤ limit cover from 0.

  A stage [i, j) fits iff prefix[j] - prefix[i] ≤ limit; bisect gives a
  first guess that the loops correct for rounding, so the test applied is
  exactly that difference. left[k] stops growing if a layer alone > limit.
  """
  num_layers = len(prefix) - 1
  left, i = [0], 0
  for _ in range(num_stages):
    j = bisect.bisect_right(prefix, prefix[i] + limit, lo=i) - 1
    while j < num_layers and prefix[j + 1] - prefix[i] <= limit:
      j += 1
    while j > i and prefix[j] - prefix[i] > limit:
      j -= 1
    left.append(j)
    i = j
  return left


def _greedy_right(prefix: list[float], limit: float,
                  num_stages: int) -> list[int]:
  """right[k]: the first layer from which K-k stages ≤ limit cover the rest."""
  right, j = [len(prefix) - 1], len(prefix) - 1
  for _ in range(num_stages):
    i = bisect.bisect_left(prefix, prefix[j] - limit, hi=j)
    while i > 0 and prefix[j] - prefix[i - 1] <= limit:
      i -= 1
    while i < j and prefix[j] - prefix[i] > limit:
      i += 1
    right.append(i)
    j = i
  return right[::-1]


def _min_max_cost(prefix: list[float], num_stages: int) -> float:
  """T*: the least float T such that K stages of cost ≤ T cover all layers.

  Feasibility is monotone in T and non-negative floats are ordered like their
  bit patterns, so bisecting over the bits finds T* exactly (≤ 64 greedy
  checks) without listing the O(L²) candidate stage costs.
  """
  num_layers = len(prefix) - 1
  lo, hi = 0, _float_bits(prefix[-1] - prefix[0])  # hi is always feasible.
  while lo < hi:
    mid = (lo + hi) // 2
    if _greedy_left(prefix, _bits_float(mid), num_stages)[-1] == num_layers:
      hi = mid
    else:
      lo = mid + 1
  return _bits_float(hi)


def _float_bits(x: float) -> int:
  return int(struct.unpack('<q', struct.pack('<d', x))[0])


def _bits_float(b: int) -> float:
  return float(struct.unpack('<d', struct.pack('<q', b))[0])


def _balanced_cut(prefix: np.ndarray, limit: float, low: list[int],
                  high: list[int]) -> list[int]:
  """Among cuts with every stage ≤ limit, the most balanced one.

  Minimises (Σ stage_cost², Σ stage_layers²) lexicographically by a DP over
  stages: cost[j] is the best value for layers [0, j) in k stages, only for j
  in [low[k], high[k]] (elsewhere no optimal cut passes).
  """
  num_stages = len(low) - 1
  j = np.arange(low[1], high[1] + 1)
  cost, count = np.full(len(prefix), np.inf), np.full(len(prefix), np.inf)
  cost[j], count[j] = (prefix[j] - prefix[0])**2, j.astype(np.float64)**2
  choices = []
  for k in range(2, num_stages + 1):
    cost, count, choice = _relax(prefix, limit, cost, count,
                                 (low[k], high[k]), (low[k - 1], high[k - 1]))
    choices.append(choice)
  if not np.isfinite(cost[-1]):
    # Only float rounding could break the DP's monotone-argmin premise; the
    # lowest boundaries still form a cut that reaches the optimum.
    return list(low)
  bounds = [len(prefix) - 1]
  for choice in reversed(choices):
    bounds.append(int(choice[bounds[-1]]))
  return [0] + bounds[::-1]


def _relax(prefix: np.ndarray, limit: float, cost: np.ndarray,
           count: np.ndarray, ends: tuple[int, int], starts: tuple[int, int]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One DP stage: for each end j in `ends`, the best start i in `starts`.

  A last stage [i, j) adds (its cost², its layers²). Squares of interval sums
  satisfy the quadrangle inequality, so the best i is non-decreasing in j:
  solve the middle j of a range, then recurse on each half with the matching
  half of the candidate starts (divide and conquer, O(L log L)). All the
  sub-problems of one recursion level are solved together in numpy.
  """
  new_cost, new_count = np.full(len(prefix), np.inf), np.full(
      len(prefix), np.inf)
  choice = np.zeros(len(prefix), dtype=np.int64)
  j_lo, j_hi = np.array([ends[0]]), np.array([ends[1]])
  i_lo, i_hi = np.array([starts[0]]), np.array([starts[1]])
  while len(j_lo):
    mid = (j_lo + j_hi) // 2
    n = np.maximum(np.minimum(i_hi, mid - 1) - i_lo + 1, 0)
    seg = np.repeat(np.arange(len(mid)), n)
    i = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n - i_lo, n)
    span = prefix[mid[seg]] - prefix[i]
    c = np.where(span <= limit, cost[i] + span * span, np.inf)
    m = count[i] + (mid[seg] - i)**2
    if len(i):
      order = np.lexsort((i, m, c, seg))  # By segment, then c, m, i.
      first = order[np.minimum(
          np.searchsorted(seg[order], np.arange(len(mid))), len(i) - 1)]
      ok, best = (n > 0) & np.isfinite(c[first]), i[first]
    else:  # Nothing to scan (only possible after a rounding upset).
      first, ok, best = n, n > 0, n
    new_cost[mid[ok]], new_count[mid[ok]] = c[first[ok]], m[first[ok]]
    choice[mid[ok]] = best[ok]
    # Children: [j_lo, mid-1] with starts ≤ best; [mid+1, j_hi] with ≥ best.
    left, right = j_lo < mid, mid < j_hi
    j_lo, j_hi, i_lo, i_hi = (
        np.concatenate([j_lo[left], mid[right] + 1]),
        np.concatenate([mid[left] - 1, j_hi[right]]),
        np.concatenate([i_lo[left], np.where(ok, best, i_lo)[right]]),
        np.concatenate([np.where(ok, best, i_hi)[left], i_hi[right]]))
  return new_cost, new_count, choice


# ---- Reporting --------------------------------------------------------------
_BINARY = ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB')
_SI = ('', 'k', 'M', 'G', 'T', 'P', 'E')
_TIME = ((1.0, 's'), (1e-3, 'ms'), (1e-6, 'µs'), (1e-9, 'ns'))


def format_quantity(value: float, unit: str) -> str:
  """A human-readable amount: 1.2 GFLOP, 3.5 MiB, 12 ms, 2.1 k<unit>.

  Args:
    value: the amount.
    unit: 'flops', 'bytes', 'seconds' (or 's'); anything else gets SI
      prefixes in front of it.
  """
  if unit in ('seconds', 's'):
    for scale, name in _TIME:
      if abs(value) >= scale * 0.9995 or name == 'ns':
        return f'{value / scale:.3g} {name}' if value else '0 s'
  base, names = ((1024.0, _BINARY) if unit == 'bytes' else
                 (1000.0, [p + ('FLOP' if unit == 'flops' else unit)
                           for p in _SI]))
  index = 0
  while abs(value) >= 999.5 and index < len(names) - 1:
    value, index = value / base, index + 1
  return f'{value:.3g} {names[index]}'


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                 align: str) -> str:
  """Aligned text columns; align[i] is 'l' or 'r' for column i."""
  widths = [max(len(str(r[i])) for r in [header, *rows])
            for i in range(len(header))]
  lines = []
  for row in [header, *rows]:
    cells = [str(c).ljust(w) if a == 'l' else str(c).rjust(w)
             for c, w, a in zip(row, widths, align)]
    lines.append('  '.join(cells).rstrip())
  return '\n'.join(lines)


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
  """GPipe's idle share (K-1)/(M+K-1) for equal stages (no transfers)."""
  for name, value in (('num_stages', num_stages),
                      ('num_micro_batches', num_micro_batches)):
    if isinstance(value, bool) or not isinstance(
        value, numbers.Integral) or value < 1:
      raise PartitionError(f'{name} must be an int ≥ 1, got {value!r}.')
  return (num_stages - 1) / (num_micro_batches + num_stages - 1)


@dataclasses.dataclass(frozen=True)
class StageSummary:
  """One stage of a partition: which layers, and what they cost."""
  index: int
  first_layer: int
  last_layer: int  # Inclusive.
  first_name: str | None
  last_name: str | None
  cost: float
  share: float  # Of the total cost, in [0, 1].

  @property
  def num_layers(self) -> int:
    return self.last_layer - self.first_layer + 1


@dataclasses.dataclass(frozen=True)
class PartitionReport:
  """What a partition does: per-stage layers, costs, imbalance, bubble.

  >>> r = make_report([1, 2, 3, 4, 5], [0, 3, 5])
  >>> [s.cost for s in r.stages], r.imbalance
  ([6.0, 9.0], 1.2)
  """
  boundaries: tuple[int, ...]
  stages: tuple[StageSummary, ...]
  total_cost: float
  cost_unit: str
  # The same cut by other per-layer costs (e.g. profiled seconds beside
  # FPropMeta flops): `to_text` shows it in two more columns.
  second: PartitionReport | None = None

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def imbalance(self) -> float:
    """max / mean stage cost: 1.0 is perfect; the step time scales with it."""
    if self.total_cost == 0:
      return 1.0
    return max(s.cost for s in self.stages) * self.num_stages / self.total_cost

  def bubble_fraction(self, num_micro_batches: int,
                      num_chunks: int = 1) -> float:
    """(K-1)/(M+K-1): the idle share of a GPipe step with equal stages;
    with v = `num_chunks` stages per device (interleaved, K = #stages ÷ v
    devices), (K-1)/(v·M+K-1): the bubble shrinks by about v."""
    k = self.num_stages // num_chunks
    return bubble_fraction(k, num_micro_batches * num_chunks) if (
        num_chunks > 1) else bubble_fraction(k, num_micro_batches)

  def to_text(self, num_micro_batches: int | None = None,
              num_chunks: int = 1) -> str:
    """An aligned table, one row per stage, then imbalance and bubble."""
    named = any(s.first_name is not None for s in self.stages)
    second = self.second
    label = '' if second is None else (
        'time' if second.cost_unit in ('seconds', 's') else second.cost_unit)
    header = ['stage', 'layers'] + (['names'] if named else []) + [
        '#layers', 'cost', 'share'] + ([label, f'{label} share']
                                       if second else [])
    rows = []
    for k, s in enumerate(self.stages):
      span = (f'{s.first_layer}' if s.num_layers == 1 else
              f'{s.first_layer}-{s.last_layer}')
      names = ([f'{s.first_name}' if s.num_layers == 1 else
                f'{s.first_name} … {s.last_name}'] if named else [])
      more = [] if second is None else [
          format_quantity(second.stages[k].cost, second.cost_unit),
          f'{100 * second.stages[k].share:.1f}%']
      rows.append([str(k), span] + names + [
          str(s.num_layers), format_quantity(s.cost, self.cost_unit),
          f'{100 * s.share:.1f}%'] + more)
    align = 'rl' + ('l' if named else '') + 'rrr' + ('rr' if second else '')
    lines = [format_table(header, rows, align),
             f'total cost: {format_quantity(self.total_cost, self.cost_unit)}'
             f' over {self.boundaries[-1]} layers in {self.num_stages} stages',
             f'imbalance (max/mean stage cost): {self.imbalance:.3f} '
             '(1.000 is perfect)']
    if second is not None:
      lines.append(f'imbalance by {label} (max/mean): {second.imbalance:.3f}')
    if num_micro_batches is not None:
      k, m, v = self.num_stages // num_chunks, num_micro_batches, num_chunks
      formula = '(K-1)/(M+K-1)' if v == 1 else '(K-1)/(v·M+K-1)'
      lines.append(f'bubble {formula} with K={k}, M={m}'
                   f'{f", v={v}" if v > 1 else ""}: '
                   f'{100 * self.bubble_fraction(m, v):.1f}%')
    return '\n'.join(lines)


def make_report(costs: Sequence[float], boundaries: Sequence[int],
                layer_names: Sequence[str] | None = None,
                cost_unit: str = 'flops',
                second_costs: Sequence[float] | None = None,
                second_cost_unit: str = 'seconds') -> PartitionReport:
  """Summarises the partition `boundaries` of layers with `costs`.

  Args:
    costs: per-layer costs, as given to `partition`.
    boundaries: [0, b1, ..., L], e.g. from `partition` or
      `check_split_points`.
    layer_names: optional, one per layer (shown in the table).
    cost_unit: 'flops', 'seconds', 'bytes' or any unit name (for display).
    second_costs: optional per-layer costs by another estimate (e.g.
      profiled seconds beside FPropMeta flops): the same cut by them becomes
      `report.second`, shown in two more columns; the cut is not changed.
    second_cost_unit: the unit of `second_costs`.

  Raises:
    PartitionError: invalid costs, boundaries, names or second costs.
  """
  values = _check_costs(costs)
  bounds = check_boundaries(boundaries, len(values))
  for what, given in (('layer_names', layer_names),
                      ('second_costs', second_costs)):
    if given is not None and len(given) != len(values):
      raise PartitionError(
          f'{what} has {len(given)} entries but costs has {len(values)}: '
          f'give one per layer, or {what}=None.')
  total = math.fsum(values)
  stages = []
  for k in range(len(bounds) - 1):
    first, last = bounds[k], bounds[k + 1] - 1
    cost = math.fsum(values[first:last + 1])
    stages.append(StageSummary(
        index=k, first_layer=first, last_layer=last,
        first_name=None if layer_names is None else str(layer_names[first]),
        last_name=None if layer_names is None else str(layer_names[last]),
        cost=cost, share=cost / total if total else 1 / (len(bounds) - 1)))
  second = (None if second_costs is None else
            make_report(second_costs, bounds, layer_names, second_cost_unit))
  return PartitionReport(tuple(bounds), tuple(stages), total, cost_unit,
                         second)
