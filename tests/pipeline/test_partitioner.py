"""Tests of the exact partitioner: optimality against brute force, errors."""

import itertools
import math
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline.partitioner import PartitionError


def _stage_costs(costs, bounds):
  return [math.fsum(costs[bounds[k]:bounds[k + 1]])
          for k in range(len(bounds) - 1)]


def _all_cuts(num_layers, num_stages):
  for inner in itertools.combinations(range(1, num_layers), num_stages - 1):
    yield [0, *inner, num_layers]


def _check_valid(bounds, num_layers, num_stages):
  assert len(bounds) == num_stages + 1
  assert bounds[0] == 0 and bounds[-1] == num_layers
  assert all(a < b for a, b in zip(bounds, bounds[1:]))


def _random_costs(rng, num_layers, kind):
  if kind == 'int':
    return [rng.choice([0, rng.randint(0, 9)]) for _ in range(num_layers)]
  if kind == 'dyadic':  # Floats whose sums are exact.
    return [rng.randint(0, 64) / 8 for _ in range(num_layers)]
  return [rng.choice([0.0, rng.random(), 1e3 * rng.random()])
          for _ in range(num_layers)]


@pytest.mark.parametrize('kind', ['int', 'dyadic'])
def test_exact_optimum_and_tie_break_match_brute_force(kind):
  rng = random.Random(kind)
  for _ in range(150):
    num_layers = rng.randint(1, 12)
    num_stages = rng.randint(1, num_layers)
    costs = _random_costs(rng, num_layers, kind)
    bounds = partitioner.partition(costs, num_stages)
    _check_valid(bounds, num_layers, num_stages)
    # Brute force: least max, then least Σ squares among the optimal cuts.
    best = min((max(s), sum(x * x for x in s))
               for s in (_stage_costs(costs, b)
                         for b in _all_cuts(num_layers, num_stages)))
    got = _stage_costs(costs, bounds)
    assert (max(got), sum(x * x for x in got)) == best, (costs, num_stages)


def test_optimum_with_real_floats_matches_brute_force():
  rng = random.Random(1)
  for _ in range(150):
    num_layers = rng.randint(1, 11)
    num_stages = rng.randint(1, num_layers)
    costs = _random_costs(rng, num_layers, 'float')
    bounds = partitioner.partition(costs, num_stages)
    _check_valid(bounds, num_layers, num_stages)
    best = min(max(_stage_costs(costs, b))
               for b in _all_cuts(num_layers, num_stages))
    assert max(_stage_costs(costs, bounds)) == pytest.approx(best, rel=1e-12)


def test_balanced_among_optimal_cuts():
  # Greedy filling to T*=10 would give [10], [1]*9, [1]: stage costs 10, 9, 1.
  costs = [10] + [1] * 10
  assert partitioner.partition(costs, 3) == [0, 1, 6, 11]


def test_one_stage_and_one_layer_per_stage():
  costs = [3.0, 1.0, 4.0, 1.0, 5.0]
  assert partitioner.partition(costs, 1) == [0, 5]
  assert partitioner.partition(costs, 5) == [0, 1, 2, 3, 4, 5]


def test_all_zero_costs_cut_by_layer_count():
  assert partitioner.partition([0] * 10, 4) == [0, 2, 5, 7, 10]
  for num_layers in range(1, 30):
    for num_stages in range(1, num_layers + 1):
      bounds = partitioner.partition([0.0] * num_layers, num_stages)
      _check_valid(bounds, num_layers, num_stages)
      sizes = [b - a for a, b in zip(bounds, bounds[1:])]
      assert max(sizes) - min(sizes) <= 1


def test_zero_cost_layers_are_spread_by_count():
  # All cuts cost 5 at most and Σ squares 25; the layer counts break the tie.
  assert partitioner.partition([0, 0, 0, 5, 0, 0], 3) == [0, 2, 4, 6]


def _min_max_dp(costs, num_stages):
  """Reference O(K L²) DP on exact integers."""
  num_layers = len(costs)
  prefix = [0] + list(itertools.accumulate(costs))
  inf = float('inf')
  best = [inf] * (num_layers + 1)
  best[0] = 0
  for _ in range(num_stages):
    best = [inf] + [min((max(best[i], prefix[j] - prefix[i])
                         for i in range(j)), default=inf)
                    for j in range(1, num_layers + 1)]
  return best[num_layers]


def test_matches_reference_dp_on_medium_case():
  rng = random.Random(2)
  costs = [rng.randint(0, 1000) for _ in range(80)]
  for num_stages in (2, 7, 13, 80):
    bounds = partitioner.partition(costs, num_stages)
    _check_valid(bounds, 80, num_stages)
    assert max(_stage_costs(costs, bounds)) == _min_max_dp(costs, num_stages)


def _fits(costs, num_stages, limit):
  """Whether ≤ num_stages stages of cost ≤ limit cover the layers (greedy)."""
  stages, current = 1, 0
  for c in costs:
    if c > limit:
      return False
    if current + c > limit:
      stages, current = stages + 1, 0
    current += c
  return stages <= num_stages


@pytest.mark.parametrize('shape', ['random', 'one_giant_layer', 'mostly_zero'])
def test_large_case_is_optimal(shape):
  rng = random.Random(shape)
  costs = {
      'random': [rng.randint(1, 10**6) for _ in range(1000)],
      'one_giant_layer': [1000] + [1] * 999,
      'mostly_zero': [rng.randint(1, 100) for _ in range(10)] + [0] * 990,
  }[shape]
  bounds = partitioner.partition(costs, 64)
  _check_valid(bounds, 1000, 64)
  worst = max(_stage_costs(costs, bounds))
  # Certificate of optimality: no cut has every stage ≤ worst - 1.
  assert _fits(costs, 64, worst) and not _fits(costs, 64, worst - 1)


@pytest.mark.parametrize('costs, num_stages, message', [
    ([], 1, 'costs is empty'),
    ([1, 2], 0, 'num_stages must be ≥ 1, got 0'),
    ([1, 2], 2.0, 'num_stages must be an int'),
    ([1, 2, 3, 4, 5], 7,
     '7 stages but only 5 layers: use num_stages ≤ 5, or split layers'),
    ([1, -2.5, 3], 2, 'costs[1] = -2.5 (layer 1) must be finite and ≥ 0'),
    ([1, 2, float('nan')], 2, 'costs[2] = nan (layer 2)'),
    ([float('inf'), 2], 2, 'costs[0] = inf (layer 0)'),
    ([1, 'x'], 1, "costs[1] = 'x' is not a number"),
])
def test_partition_errors(costs, num_stages, message):
  with pytest.raises(PartitionError) as e:
    partitioner.partition(costs, num_stages)
  assert message in str(e.value)
  assert isinstance(e.value, ValueError)


def test_check_split_points():
  assert partitioner.check_split_points([2, 5], 8, 3) == [0, 2, 5, 8]
  assert partitioner.check_split_points([], 4, 1) == [0, 4]


@pytest.mark.parametrize('points, message', [
    ([2], 'has 1 entries but num_stages=3 needs 2'),
    ([5, 2], 'split_points[1] = 2 ≤ split_points[0] = 5'),
    ([3, 3], 'strictly increasing'),
    ([0, 4], 'split_points[0] = 0 is outside (0, 8)'),
    ([2, 8], 'split_points[1] = 8 is outside (0, 8)'),
    ([2.5, 4], 'split_points[0] = 2.5 is not an int'),
])
def test_check_split_points_errors(points, message):
  with pytest.raises(PartitionError) as e:
    partitioner.check_split_points(points, 8, 3)
  assert message in str(e.value)
  assert 'e.g.' in str(e.value) or 'between 1 and 7' in str(e.value)


def test_check_boundaries():
  assert partitioner.check_boundaries([0, 1, 3], 3) == [0, 1, 3]
  for bad in ([1, 3], [0, 2], [0, 2, 2, 3], [0]):
    with pytest.raises(PartitionError):
      partitioner.check_boundaries(bad, 3)


def test_report_numbers():
  costs = [1, 2, 3, 4, 5]
  rep = partitioner.make_report(costs, [0, 3, 5], list('abcde'))
  assert rep.num_stages == 2 and rep.total_cost == 15
  s0, s1 = rep.stages
  assert (s0.first_layer, s0.last_layer, s0.num_layers) == (0, 2, 3)
  assert (s0.first_name, s0.last_name, s1.first_name) == ('a', 'c', 'd')
  assert (s0.cost, s1.cost) == (6, 9)
  assert (s0.share, s1.share) == (pytest.approx(0.4), pytest.approx(0.6))
  assert rep.imbalance == pytest.approx(9 / 7.5)
  for m in (1, 4, 8):
    assert rep.bubble_fraction(m) == pytest.approx(1 / (m + 1))


def test_report_text():
  rep = partitioner.make_report([1, 2, 3, 4, 5], [0, 3, 5], list('abcde'))
  text = rep.to_text(num_micro_batches=8)
  lines = text.splitlines()
  assert lines[0].split() == ['stage', 'layers', 'names', '#layers', 'cost',
                              'share']
  assert lines[1].split() == ['0', '0-2', 'a', '…', 'c', '3', '6', 'FLOP',
                              '40.0%']
  assert lines[2].split() == ['1', '3-4', 'd', '…', 'e', '2', '9', 'FLOP',
                              '60.0%']
  assert len({len(line) for line in lines[:3]}) == 1  # Aligned columns.
  assert 'imbalance (max/mean stage cost): 1.200' in text
  assert 'M=8: 11.1%' in text
  assert 'bubble' not in rep.to_text()


def test_report_second_costs_column():
  """Profiled seconds beside FPropMeta flops: same cut, second imbalance."""
  rep = partitioner.make_report([1e9, 2e9, 3e9, 4e9, 5e9], [0, 3, 5],
                                list('abcde'),
                                second_costs=[1e-3, 1e-3, 1e-3, 1e-3, 8e-3])
  assert [s.cost for s in rep.second.stages] == pytest.approx([3e-3, 9e-3])
  assert rep.second.boundaries == rep.boundaries
  assert rep.second.imbalance == pytest.approx(1.5)
  lines = rep.to_text().splitlines()
  assert lines[0].split() == ['stage', 'layers', 'names', '#layers', 'cost',
                              'share', 'time', 'time', 'share']
  assert lines[1].split()[-3:] == ['3', 'ms', '25.0%']
  assert lines[2].split()[-3:] == ['9', 'ms', '75.0%']
  assert 'imbalance by time (max/mean): 1.500' in rep.to_text()
  assert partitioner.make_report([1, 2], [0, 1, 2]).second is None
  with pytest.raises(PartitionError, match='second_costs has 1 entries'):
    partitioner.make_report([1, 2], [0, 1, 2], second_costs=[1])
  with pytest.raises(PartitionError, match='costs\\[0\\] = -1.0'):
    partitioner.make_report([1, 2], [0, 1, 2], second_costs=[-1, 1])


def test_report_all_zero_and_errors():
  rep = partitioner.make_report([0, 0, 0, 0], [0, 2, 4])
  assert rep.imbalance == 1.0 and [s.share for s in rep.stages] == [0.5, 0.5]
  with pytest.raises(PartitionError, match='layer_names has 2 entries'):
    partitioner.make_report([1, 2, 3], [0, 1, 3], ['a', 'b'])
  with pytest.raises(PartitionError, match='num_micro_batches must be'):
    rep.bubble_fraction(0)


@pytest.mark.parametrize('value, unit, text', [
    (1.2e9, 'flops', '1.2 GFLOP'),
    (6, 'flops', '6 FLOP'),
    (999.7, 'flops', '1 kFLOP'),
    (1.5 * 2**20, 'bytes', '1.5 MiB'),
    (512, 'bytes', '512 B'),
    (0.012, 'seconds', '12 ms'),
    (3e-7, 's', '300 ns'),
    (2.5, 'seconds', '2.5 s'),
    (0, 'seconds', '0 s'),
    (2100, 'cost', '2.1 kcost'),
])
def test_format_quantity(value, unit, text):
  assert partitioner.format_quantity(value, unit) == text


# ---- tools/partition_report.py, run as a user would -------------------------
_TOOL = pathlib.Path(__file__).parents[2] / 'tools' / 'partition_report.py'


def _run_tool(*flags):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  return subprocess.run([sys.executable, str(_TOOL), *flags], env=env,
                        capture_output=True, text=True, timeout=120)


def test_tool_prints_partition_and_simulation():
  out = _run_tool('--costs=1,2,3,4,5', '--num_stages=2',
                  '--num_micro_batches=8')
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0] == 'boundaries: [0, 3, 5]'
  assert lines[2].split()[:3] == ['0', '0-2', '3']
  assert lines[3].split()[:3] == ['1', '3-4', '2']
  assert 'M=8: 11.1%' in out.stdout
  assert 'step time:' in out.stdout and 'speed-up' in out.stdout


def test_tool_reports_user_errors():
  out = _run_tool('--costs=1,2,3,4,5', '--num_stages=7')
  assert out.returncode != 0
  assert '7 stages but only 5 layers' in out.stderr


def test_balancing_fallback_still_reaches_the_optimum(monkeypatch):
  # If float rounding ever broke the balancing DP (all its values infinite),
  # partition falls back to the lowest feasible boundaries; they must still
  # reach T*.
  def _broken(prefix, limit, cost, count, ends, starts):
    del limit, cost, count, ends, starts
    size = len(prefix)
    return (np.full(size, np.inf), np.full(size, np.inf),
            np.zeros(size, dtype=np.int64))

  rng = random.Random(3)
  costs = [rng.randint(0, 50) for _ in range(40)]
  want = max(_stage_costs(costs, partitioner.partition(costs, 6)))
  monkeypatch.setattr(partitioner, '_relax', _broken)
  bounds = partitioner.partition(costs, 6)
  _check_valid(bounds, 40, 6)
  assert max(_stage_costs(costs, bounds)) == want
