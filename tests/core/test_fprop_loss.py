"""Transparency of every schedule: the loss inside the pipeline.

`PipeliningLayer.FPropLoss` runs GPipe, 1F1B and interleaved 1F1B with the
last stage computing each micro-batch's weighted-mean loss. The step's loss,
its gradients and the BatchNorm statistics must equal plain autodiff over
the same layers and weights, micro-batch by micro-batch (BatchNorm
normalises each micro-batch by its own statistics), with the loss a
weighted mean over the whole batch — for every schedule, recompute policy,
K ∈ {1, 2, 4} and M ∈ {1, 2, 4, 8}: 1e-5 relative, or as close to a
float64 run as the float32 reference is (`transparency.Discrepancy.ok`).

The reference does not depend on K, the schedule or the policy (initial
weights are a function of the layer paths only), so it is computed once per
model and M.
"""

from __future__ import annotations

import functools
import itertools

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
SCHEDULES = ('gpipe', '1f1b', 'interleaved')


_reference = functools.lru_cache(maxsize=None)(stacks.loss_reference)
_pipelined = stacks.pipelined_loss


def _valid(model, schedule, k, m) -> bool:
  if schedule != 'interleaved':
    return True
  return m % k == 0 and 2 * k <= NUM_LAYERS[model]


CASES = [(model, s, k, m, r, 'eager') for model, s, k, m, r in
         itertools.product(MODELS, SCHEDULES, (1, 2, 4), (1, 2, 4, 8),
                           stacks.POLICIES) if _valid(model, s, k, m)]
# Under tf.function Grappler and the dataflow executor get their say.
CASES += [(model, s, k, m, r, 'graph') for model, s, r in
          itertools.product(MODELS, SCHEDULES, stacks.POLICIES)
          for k, m in ((2, 4), (4, 8)) if _valid(model, s, k, m)]


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
