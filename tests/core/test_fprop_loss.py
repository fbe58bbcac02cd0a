"""Transparency of every schedule: the loss inside the pipeline.

`PipeliningLayer.FPropLoss` runs GPipe, 1F1B, interleaved 1F1B and the
zero-bubble ZB-H1 and ZB-V (split backward: I, then W) with the
last stage computing each micro-batch's weighted-mean loss. The step's loss,
its gradients and the BatchNorm statistics must equal plain autodiff over
the same layers and weights, micro-batch by micro-batch (BatchNorm
normalises each micro-batch by its own statistics), with the loss a
weighted mean over the whole batch — for every schedule, recompute policy,
K ∈ {1, 2, 4} and M ∈ {1, 2, 4, 8}: 1e-5 relative, or as close to a
float64 run as the float32 reference is (`transparency.Discrepancy.ok`).

The cases are a covering design, not the full product (which took 11 of
CI's 30 minutes): every (model, schedule, K, M) runs eagerly once, with
the recompute policy rotating so that each policy meets every model,
schedule and K; under tf.function every (model, schedule) runs once, at
(K, M) = (2, 4) or (4, 8) in turn, policies rotating too. LINGVO_PIPE_FULL_MATRIX=1
runs the whole product (do, after changing the executor).

The reference does not depend on K, the schedule or the policy (initial
weights are a function of the layer paths only), so it is computed once per
model and M.
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.nested_map import NestedMap

from lingvo_pipe.pipeline import transparency

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order

BATCH = stacks.BATCH
MODELS = ('conv_bn', 'transformer', 'nested')
NUM_LAYERS = {'conv_bn': 8, 'transformer': 4, 'nested': 6}
SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zb_h1', 'zb_v')


_reference = functools.lru_cache(maxsize=None)(stacks.loss_reference)
_pipelined = stacks.pipelined_loss


def _valid(model, schedule, k, m) -> bool:
  if schedule == 'zb_v':  # Two stages per device, in a V.
    return 2 * k <= NUM_LAYERS[model]
  if schedule != 'interleaved':
    return True
  return m % k == 0 and 2 * k <= NUM_LAYERS[model]


# Schedules with a split backward trace each stage's backward graph and cut
# it (split_backward.py): a case costs several of 1F1B's, so eagerly each
# (model, schedule) runs every third (K, M) of the grid, which still holds
# every K and every M.
_SPLIT = ('zb_h1', 'zb_v')


def _cases(full: bool) -> list[tuple[str, str, int, int, str, str]]:
  """The (model, schedule, K, M, recompute, mode) cases (module docstring)."""
  policies = stacks.POLICIES
  cases = []
  for i, (model, s) in enumerate(itertools.product(MODELS, SCHEDULES)):
    grid = [(k, m) for k, m in itertools.product((1, 2, 4), (1, 2, 4, 8))
            if _valid(model, s, k, m)]
    if s in _SPLIT and not full:  # Every K and every M, not every pair.
      grid = grid[i % 3::3]
    for j, (k, m) in enumerate(grid):
      chosen = policies if full else [policies[(i + j) % len(policies)]]
      cases += [(model, s, k, m, r, 'eager') for r in chosen]
    # Under tf.function Grappler and the dataflow executor get their say.
    # Each (model, schedule) once, at (2, 4) or (4, 8) in turn (both with
    # LINGVO_PIPE_FULL_MATRIX=1).
    for j, (k, m) in enumerate(((2, 4), (4, 8))):
      if _valid(model, s, k, m) and (full or (i + j) % 2 == 0 or
                                     not _valid(model, s, 6 - k, 2 * (6 - k))):
        chosen = policies if full else [policies[(i + 2 * j) % len(policies)]]
        cases += [(model, s, k, m, r, 'graph') for r in chosen]
  return cases


CASES = _cases(os.environ.get('LINGVO_PIPE_FULL_MATRIX') == '1')


@pytest.mark.parametrize('model,schedule,num_stages,num_micro_batches,'
                         'recompute,mode', CASES)
def test_loss_in_pipeline_equals_unpipelined(model, schedule, num_stages,
                                             num_micro_batches, recompute,
                                             mode):
  net, inputs = stacks.net(model, num_stages=num_stages,
                            num_micro_batches=num_micro_batches,
                            recompute=recompute, schedule=schedule)
  run = lambda: _pipelined(net, inputs, stacks.loss_labels(model))
  got = tf.function(run)() if mode == 'graph' else run()
  want, want64 = _reference(model, num_micro_batches)
  for name, i in (('loss', 0), ('gradients', 1), ('statistics', 2)):
    d = transparency.discrepancy(got[i], want[i], want64[i])
    assert d.ok(), f'{name}: {d}'


def test_metrics_are_weighted_means_over_the_whole_batch():
  # Micro-batches of unequal weight: a mean of micro-batch means is wrong.
  net, inputs = stacks.net('nested', num_stages=2, num_micro_batches=4,
                            schedule='1f1b')
  labels = NestedMap(w=tf.constant([1.0] * 6 + [5.0, 5.0]))
  with fprop_context.scope(training=True, step=7):
    got = net.FPropLoss(net.theta, inputs, labels, stacks.weighted_loss)
  x = inputs[0]
  for layer, theta in zip(net.children.layers, net.theta.layers):
    x = layer.FProp(theta, x)
  want = stacks.weighted_loss(x, labels)
  for name in ('loss', 'abs_mean'):
    np.testing.assert_allclose(got[name][0], want[name][0], rtol=1e-6)
    np.testing.assert_allclose(got[name][1], want[name][1], rtol=1e-6)


def test_fprop_under_an_outer_tape_needs_a_forward_first_schedule():
  net, inputs = stacks.net('nested', num_stages=2, num_micro_batches=4,
                            schedule='1f1b')
  with pytest.raises(ValueError, match='FPropLoss'):
    stacks.pipelined(net, inputs)


def test_outside_training_fprop_loss_is_the_loss_of_the_whole_batch():
  net, inputs = stacks.net('nested', num_stages=2, num_micro_batches=4,
                            schedule='interleaved')
  labels = stacks.loss_labels('nested')
  got = net.FPropLoss(net.theta, inputs, labels, stacks.weighted_loss)
  want = stacks.weighted_loss(net.FProp(net.theta, *inputs), labels)
  np.testing.assert_allclose(got['loss'][0], want['loss'][0], rtol=1e-6)
