"""Simulator tests: bubble, step time and memory against hand derivations."""

import random

import pytest

from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline.simulator import SimulationError, StageCost


@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_equal_stages_bubble_is_analytic(recompute):
  for k in range(1, 7):
    for m in (1, 2, 3, 4, 8, 13, 32):
      r = simulator.simulate([StageCost(forward=1.0)] * k, m, recompute)
      assert r.bubble_fraction == pytest.approx((k - 1) / (m + k - 1),
                                                abs=1e-12)
      assert r.analytic_bubble_fraction == pytest.approx(
          (k - 1) / (m + k - 1), abs=1e-12)


@pytest.mark.parametrize('f, b, r', [(1.0, 2.0, 1.0), (0.5, 1.25, 0.75)])
def test_equal_stages_step_time(f, b, r):
  for k in range(1, 6):
    for m in (1, 3, 8):
      result = simulator.simulate(
          [StageCost(forward=f, backward=b, recompute=r)] * k, m, 'always')
      assert result.step_time == (m + k - 1) * f + (m + k - 1) * (r + b)


def _flow_shop(times, m, transfer):
  """Identical jobs through stages in order: Σ t + (M-1) max t + hops."""
  return sum(times) + (m - 1) * max(times) + (len(times) - 1) * transfer


def test_gpipe_step_time_matches_flow_shop_formula():
  # GPipe's step is two flow shops: forwards through stages 0..K-1, then
  # (recompute + backward) through stages K-1..0.
  rng = random.Random(0)
  for _ in range(40):
    k, m = rng.randint(1, 5), rng.randint(1, 9)
    recompute = rng.choice(['always', 'except_last', 'never'])
    transfer = rng.randint(0, 4) / 8
    stages = [StageCost(forward=rng.randint(1, 16) / 4,
                        backward=rng.randint(1, 32) / 4,
                        recompute=rng.randint(1, 16) / 4) for _ in range(k)]
    r_on = [recompute == 'always' or (recompute == 'except_last' and
                                      i < k - 1) for i in range(k)]
    expected = (
        _flow_shop([s.forward for s in stages], m, transfer) +
        _flow_shop([s.backward + (s.recompute if on else 0)
                    for s, on in zip(stages, r_on)], m, transfer))
    result = simulator.simulate(stages, m, recompute, transfer_time=transfer)
    assert result.step_time == expected


def test_step_time_follows_the_slowest_stage():
  stages = [StageCost(1.0), StageCost(3.0), StageCost(1.0)]
  steps = [simulator.simulate(stages, m).step_time for m in range(1, 10)]
  # Each extra micro-batch costs the slowest stage's F + R + B = 3 + 3 + 6.
  assert all(b - a == 12.0 for a, b in zip(steps, steps[1:]))
  r = simulator.simulate(stages, 8)
  assert r.idle[1] < r.idle[0] and r.idle[1] < r.idle[2]
  assert r.busy == (32.0, 96.0, 32.0)


def test_single_stage_has_no_bubble():
  for m in (1, 4):
    for schedule in ('gpipe', '1f1b'):
      r = simulator.simulate([StageCost(2.0)], m, schedule=schedule,
                             transfer_time=5.0)
      assert r.bubble_fraction == 0.0 and r.idle == (0.0,)
      assert r.step_time == m * (2.0 + 2.0 + 4.0)
      assert r.speedup_vs_single_device == 1.0


def test_speedup_is_k_times_busy_share():
  stages = [StageCost(1.0), StageCost(2.0), StageCost(1.5)]
  r = simulator.simulate(stages, 6, 'never', transfer_time=0.5)
  single = 6 * sum(s.forward + s.backward for s in stages)
  assert r.speedup_vs_single_device == pytest.approx(single / r.step_time)
  assert r.speedup_vs_single_device == pytest.approx(
      3 * (1 - r.bubble_fraction))


def test_events_cover_every_op_with_its_duration():
  stages = [StageCost(1.0, backward=5.0, recompute=0.5), StageCost(2.0)]
  r = simulator.simulate(stages, 3, 'except_last')
  assert len(r.events) == 3 * 3 + 3 * 2
  want = {'F': [1.0, 2.0], 'B': [5.0, 4.0], 'R': [0.5, None]}
  for e in r.events:
    assert e.end - e.start == want[e.kind][e.stage]
  assert [e.start for e in r.events] == sorted(e.start for e in r.events)


_MEM = StageCost(1.0, boundary_bytes=1.0, activation_bytes=10.0)


@pytest.mark.parametrize('recompute, schedule, peaks', [
    # GPipe, K=2, M=4: all 4 inputs are alive when the first backward runs;
    # with recompute, plus one micro-batch's rebuilt activations.
    ('always', 'gpipe', (4 * 1 + 10, 4 * 1 + 10)),
    ('never', 'gpipe', (4 * 11, 4 * 11)),
    ('except_last', 'gpipe', (4 * 1 + 10, 4 * 11)),
    # 1F1B: stage 0 holds 2 micro-batches (warm-up 1 + 1), stage 1 holds 1.
    ('always', '1f1b', (2 * 1 + 10, 1 + 10)),
    ('never', '1f1b', (2 * 11, 11)),
    # 'needed' keeps the forwards whose R would follow at once: same peaks.
    ('needed', 'gpipe', (4 * 1 + 10, 4 * 1 + 10)),
    ('needed', '1f1b', (2 * 1 + 10, 1 + 10)),
])
def test_peak_memory_hand_computed(recompute, schedule, peaks):
  r = simulator.simulate([_MEM, _MEM], 4, recompute, schedule)
  assert r.peak_activation_bytes == peaks


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
@pytest.mark.parametrize('k, m', [(1, 1), (2, 8), (3, 4), (4, 16)])
def test_needed_is_faster_than_always_at_the_same_peak(schedule, k, m):
  stages = [_MEM] * k
  always = simulator.simulate(stages, m, 'always', schedule)
  needed = simulator.simulate(stages, m, 'needed', schedule)
  assert needed.peak_activation_bytes == always.peak_activation_bytes
  # The skipped Rs (1 time unit each, as F) that lay on the critical path:
  # GPipe's last stage's, and in 1F1B those that the steady state waits on.
  skipped = sum(e.kind == 'R' for e in always.events) - sum(
      e.kind == 'R' for e in needed.events)
  assert skipped == (k if schedule == 'gpipe' else m)
  saved = always.step_time - needed.step_time
  assert saved == (1 if schedule == 'gpipe' or k == 1 else 2)


@pytest.mark.parametrize('k, m', [(2, 8), (3, 4), (4, 16), (4, 3), (5, 10)])
def test_one_f_one_b_bounds_memory_by_k(k, m):
  stages = [_MEM] * k
  gpipe = simulator.simulate(stages, m, 'never', 'gpipe')
  ofob = simulator.simulate(stages, m, 'never', '1f1b')
  assert gpipe.peak_activation_bytes[0] == m * 11
  assert ofob.peak_activation_bytes[0] == min(k, m) * 11
  # Same bubble as GPipe for equal stages (PipeDream-Flush).
  assert ofob.step_time == gpipe.step_time


def test_to_text():
  stages = [StageCost(1e-3, activation_bytes=2**24, param_bytes=2**20),
            StageCost(2e-3)]
  text = simulator.simulate(stages, 4).to_text()
  lines = text.splitlines()
  assert lines[1].split()[:4] == ['stage', 'forward', 'backward', 'recompute']
  assert lines[2].split()[:4] == ['0', '1', 'ms', '2']
  assert '16 MiB' in lines[2] and '1 MiB' in lines[2]
  assert lines[4].startswith('step time: ')
  assert 'analytic (K-1)/(M+K-1)' in text and '20.0% analytic' in text
  assert 'predicted speed-up vs one device:' in text


def test_stage_costs_from_layers():
  got = simulator.stage_costs_from_layers(
      layer_flops=[2, 4, 6, 8], layer_out_bytes=[10, 20, 30, 40],
      layer_param_bytes=[1, 2, 3, 4], input_bytes=8, boundaries=[0, 2, 4],
      num_micro_batches=2, flops_per_second=2.0, backward_ratio=3.0)
  assert got == [
      StageCost(forward=1.5, backward=4.5, recompute=1.5, boundary_bytes=4.0,
                activation_bytes=15.0, param_bytes=3.0),
      StageCost(forward=3.5, backward=10.5, recompute=3.5, boundary_bytes=10.0,
                activation_bytes=35.0, param_bytes=7.0)]


def test_stage_cost_defaults_and_errors():
  s = StageCost(forward=2.0)
  assert (s.backward, s.recompute) == (4.0, 2.0)
  with pytest.raises(SimulationError, match='StageCost.forward = -1'):
    StageCost(forward=-1)
  with pytest.raises(SimulationError, match='StageCost.activation_bytes'):
    StageCost(forward=1.0, activation_bytes=float('nan'))


@pytest.mark.parametrize('kwargs, message', [
    (dict(stages=[]), 'non-empty list of StageCost'),
    (dict(num_micro_batches=0), 'num_micro_batches must be an int ≥ 1'),
    (dict(recompute='maybe'), "recompute='maybe' is not one of"),
    (dict(schedule='zb'), "schedule='zb' is not one of"),
    (dict(transfer_time=-1.0), 'transfer_time = -1.0'),
])
def test_simulate_errors(kwargs, message):
  args = dict(stages=[StageCost(1.0)] * 2, num_micro_batches=2)
  args.update(kwargs)
  with pytest.raises(SimulationError) as e:
    simulator.simulate(**args)
  assert message in str(e.value)


def test_stage_costs_from_layers_errors():
  good = dict(layer_flops=[1, 1], layer_out_bytes=[1, 1],
              layer_param_bytes=[1, 1], input_bytes=1, boundaries=[0, 1, 2],
              num_micro_batches=1, flops_per_second=1.0)
  for change, message in [
      (dict(layer_out_bytes=[1]), 'one entry per layer; got 2, 1 and 2'),
      (dict(boundaries=[0, 2, 2]), 'strictly increasing'),
      (dict(flops_per_second=0.0), 'flops_per_second = 0.0'),
      (dict(num_micro_batches=0), 'num_micro_batches must be'),
  ]:
    with pytest.raises(SimulationError, match=message):
      simulator.stage_costs_from_layers(**{**good, **change})


def test_split_backward_costs_default_to_halves():
  cost = StageCost(forward=1.0)
  assert (cost.time('I'), cost.time('W')) == (1.0, 1.0)
  cost = StageCost(forward=1.0, backward=3.0, weight_grad=0.5)
  assert (cost.time('I'), cost.time('W')) == (2.5, 0.5)


def test_zb_h1_bubble_is_a_third_of_1f1b():
  # F = I = W = 1 (B = 2): 1F1B idles 3(K-1) units per device, ZB-H1 K-1
  # (W fills the cool-down), so the step is 3M + K - 1 units.
  for k, m in ((2, 4), (4, 8)):
    one = simulator.simulate([StageCost(1.0)] * k, m, 'never', '1f1b')
    zb = simulator.simulate([StageCost(1.0)] * k, m, 'never', 'zb_h1')
    assert one.step_time == 3 * m + 3 * (k - 1)
    assert zb.step_time == 3 * m + (k - 1)
    assert sum(zb.busy) == sum(one.busy)


def test_zb_v_by_name_places_a_v_and_keeps_1f1b_memory():
  k, m = 2, 8
  stages = [StageCost(0.5, activation_bytes=1.0)] * (2 * k)
  r = simulator.simulate(stages, m, 'never', 'zb_v')
  assert r.stage_devices == (0, 1, 1, 0)
  assert r.num_stages == k
  one = simulator.simulate([StageCost(1.0, activation_bytes=2.0)] * k, m,
                           'never', '1f1b')
  assert r.step_time < one.step_time
  assert max(r.peak_activation_bytes) <= max(one.peak_activation_bytes)


def test_kept_bytes_are_held_from_i_to_w():
  # One stage, one micro-batch: F, I, W back to back; kept is the only
  # memory left once I frees the activations.
  r = simulator.simulate([StageCost(1.0, kept_bytes=5.0)], 1, 'never',
                         'zb_h1')
  assert [e.kind for e in r.events] == ['F', 'I', 'W']
  assert r.peak_activation_bytes == (5.0,)
  r = simulator.simulate([StageCost(1.0, activation_bytes=7.0,
                                    kept_bytes=5.0)], 1, 'never', 'zb_h1')
  assert r.peak_activation_bytes == (7.0,)


def test_stage_costs_split_by_weight_shares():
  costs = simulator.stage_costs_from_layers(
      [2.0, 2.0], [1.0, 1.0], [4.0, 0.0], 1.0, [0, 1, 2], 1, 1.0,
      layer_kept_bytes=[3.0, 0.0])
  # Rule: a layer with parameters splits its backward in halves, one
  # without is all I.
  assert [(c.time('I'), c.time('W')) for c in costs] == [(2.0, 2.0),
                                                         (4.0, 0.0)]
  assert [c.kept_bytes for c in costs] == [3.0, 0.0]
