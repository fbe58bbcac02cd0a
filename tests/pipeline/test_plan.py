"""Planning from Params: costs, cut, M, memory preflight — no devices needed."""

from __future__ import annotations

import pytest
import tensorflow as tf

from lingvo_pipe.core import gpipe
from lingvo_pipe.core import model_registry
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.pipeline import plan as plan_lib


def _fc(widths, batch=64, **kw):
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=a,
                                        output_dim=b, activation='RELU')
            for i, (a, b) in enumerate(zip(widths, widths[1:]))]
  return gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, input_shapes=[[batch, widths[0]]], **kw)


def test_without_shapes_or_costs_the_cut_balances_parameters():
  # DeepSpeed's default: fc0 has 64·1024+1024 parameters, the rest 16·16+16.
  p = _fc([64, 1024, 16, 16, 16, 16]).Set(num_stages=2, input_shapes=None)
  plan = plan_lib.make_plan(p, 'net')
  assert plan.cost_unit == 'parameters' and plan.boundaries == (0, 1, 5)
  assert 'costs: parameter counts' in plan.to_text()


def test_profile_costs_cut_by_measured_time():
  # Two 1024² layers among 16-wide ones (4000× the flops): whatever the
  # machine's load, the measured cut puts one wide layer in each stage.
  widths = [1024, 1024, 16, 16, 16, 16, 1024, 1024]
  p = _fc(widths, batch=64, num_stages=2, costs='profile')
  plan = plan_lib.make_plan(p, 'net')
  assert plan.cost_unit == 'seconds' and len(plan.costs) == 7
  assert all(c >= 0 for c in plan.costs)  # Tiny layers may round to 0.
  assert min(plan.costs[0], plan.costs[6]) > sum(plan.costs[2:5])
  assert 1 <= plan.boundaries[1] <= 6  # fc0 and fc6 in different stages.
  text = plan.to_text()
  assert 'imbalance by flops' in text and 'measured layer times' in text
  # W's measured share of each backward reaches the simulator's I and W.
  assert len(plan.weight_shares) == 7
  assert all(0 <= w <= 1 for w in plan.weight_shares)
  sim = plan.simulate(schedule='zb_h1')
  for cost in sim.stages:
    assert cost.time('I') + cost.time('W') == pytest.approx(cost.backward)


def test_micro_batch_size_is_honoured_by_every_report():
  p = _fc([8, 8, 8, 8], batch=64, num_stages=2, micro_batch_size=8)
  net = p.Instantiate()
  assert net.plan.num_micro_batches() == 8
  assert 'M=8' in net.Inspect()
  assert net.Summaries()['pipeline/bubble_fraction'] == pytest.approx(1 / 9)
  assert net.Simulate().num_micro_batches == 8


def test_auto_micro_batches_fit_the_budget_with_m_at_least_4k():
  p = _fc([256] * 9, batch=256, num_stages=2, num_micro_batches='auto',
          recompute='never', memory_budget_bytes=64 << 20)
  plan = plan_lib.make_plan(p, 'net')
  m = plan.num_micro_batches()
  assert m >= 8 and 256 % m == 0  # 4·K fits in 64 MiB.
  with pytest.raises(plan_lib.PlanError, match=r'stage \d .*budget is 64 KiB'):
    plan_lib.make_plan(p.Copy().Set(memory_budget_bytes=64 << 10),
                       'net').num_micro_batches()


def test_a_config_over_budget_fails_before_the_first_step():
  p = _fc([256] * 9, batch=256, num_stages=2, num_micro_batches=2,
          recompute='never', memory_budget_bytes=1 << 20)
  net = p.Instantiate()  # Builds; the batch size is known here already:
  with pytest.raises(plan_lib.PlanError,
                     match=r'net: Memory preflight: stage \d is predicted to '
                     r'need .*but the budget is 1 MiB'):
    net.plan.num_micro_batches()


def test_auto_needs_a_budget():
  p = _fc([8, 8, 8], num_stages=2, num_micro_batches='auto')
  with pytest.raises(plan_lib.PlanError, match='memory_budget_bytes'):
    plan_lib.make_plan(p, 'net').num_micro_batches()


def test_paper_sized_config_plans_without_its_eight_devices():
  params = model_registry.get_params(
      'image.fashion_mnist.AmoebaNetD18x256', 'Train')
  assert len(tf.config.list_logical_devices('CPU')) < 8
  text = params.task.cls.InspectParams(params.task)
  assert '8 devices' in text and 'bubble' in text


@pytest.mark.parametrize('entry,match', [
    (linear.FCLayer, 'not layer Params'),
    ('fc', 'not layer Params'),
    (None, 'not layer Params'),
])
def test_non_params_entries_in_layers_are_named(entry, match):
  p = _fc([8, 8, 8], num_stages=2)
  p.layers = list(p.layers) + [entry]
  with pytest.raises(plan_lib.PlanError, match=r'net.layers\[2\] .*' + match):
    plan_lib.make_plan(p, 'net')


def test_a_built_layer_in_layers_is_named():
  p = _fc([8, 8, 8], num_stages=2)
  p.layers = [p.layers[0].Instantiate(), p.layers[1]]
  with pytest.raises(plan_lib.PlanError, match=r'layers\[0\] is FCLayer'):
    plan_lib.make_plan(p, 'net')


def test_duplicate_layer_names_are_refused():
  bn = normalization.BatchNormLayer.Params().Set(name='fc0', dim=8)
  p = _fc([8, 8, 8], num_stages=2)
  p.layers = list(p.layers) + [bn]
  with pytest.raises(plan_lib.PlanError, match=r"layers\[0\] and layers\[2\] "
                     "are both named 'fc0'"):
    plan_lib.make_plan(p, 'net')
