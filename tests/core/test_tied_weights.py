"""Tied weights in one process: one variable, the gradient of both uses.

The tied stack (tests/pipeline_stacks.py) reads its embedding table
[V, D] again, transposed, as the softmax's weights. Its twin is the same
stack untied, its softmax weights set to the table transposed: the tied
gradient must be the twin's embedding gradient plus its softmax gradient
transposed, at any K (what a tie means, derived without the tie code).
Stage processes: tests/pipeline/test_stage_processes.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.core import tied_weights
from lingvo_pipe.pipeline import memory
from lingvo_pipe.pipeline import transparency

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order


def _step(net, inputs, labels):
  with tf.GradientTape() as tape:
    with fprop_context.scope(training=True, step=3):
      metrics = net.FPropLoss(net.theta, inputs, labels, stacks.weighted_loss)
  return metrics['loss'][0], dict(zip(
      [v.name for v in net.trainable_variables],
      tape.gradient(metrics['loss'][0], net.trainable_variables)))


def _untied_twin(net):
  """The same layers untied (K=1): every weight starts as net's (its path
  and seed are the same), and the softmax's weights are set to the table ᵀ.
  """
  twin = net.params.Copy().Set(tied_weights=[], num_stages=1,
                               schedule='gpipe').Instantiate()
  twin.children.layers[-1].vars.w.assign(
      tf.transpose(net.children.layers[0].vars.emb))
  return twin


@pytest.mark.parametrize('k,schedule', [(1, 'gpipe'), (2, '1f1b'),
                                        (4, 'gpipe')])
def test_tied_gradient_is_the_sum_of_both_uses(k, schedule):
  net, inputs = stacks.net('tied', num_stages=k, num_micro_batches=4,
                           schedule=schedule)
  labels = stacks.loss_labels('tied')
  names = [v.name for v in net.trainable_variables]
  assert sum('emb/emb' in n for n in names) == 1
  assert not any('softmax/w' in n for n in names)  # One variable.
  loss, grads = _step(net, inputs, labels)
  twin = _untied_twin(net)
  twin_loss, twin_grads = _step(twin, inputs, labels)
  want = {n: g for n, g in twin_grads.items() if 'softmax/w' not in n}
  want['net.emb/emb:0'] = (tf.convert_to_tensor(want['net.emb/emb:0']) +
                           tf.transpose(twin_grads['net.softmax/w:0']))
  assert abs(float(loss) - float(twin_loss)) <= 1e-5 * abs(float(loss))
  got = [tf.convert_to_tensor(grads[n]) for n in sorted(want)]
  diff = transparency.max_rel_diff(got, [want[n] for n in sorted(want)])[0]
  assert diff <= 1e-5, diff


def test_the_checkpoint_and_params_hold_the_tie_once(tmp_path):
  net, _ = stacks.net('tied', num_stages=2, num_micro_batches=2)
  text = net.params.ToText()
  assert "tied_weights[0].weight : 'softmax.w'" in text
  assert "tied_weights[0].owner : 'emb.emb'" in text
  path = tf.train.Checkpoint(net=net).write(str(tmp_path / 'ckpt'))
  keys = [k for k, _ in tf.train.list_variables(path) if 'VARIABLE' in k]
  assert 'net/emb/emb/.ATTRIBUTES/VARIABLE_VALUE' in keys
  assert len(keys) == 1 + 2 * 3 + 1, keys  # Table, 3 FC (w, b), softmax b.
  assert net.tied.copies == {}  # One process: the owner's variable only.


def test_the_partition_and_memory_count_the_sharers_copy():
  net, _ = stacks.net('tied', num_stages=2, num_micro_batches=2)
  v, d = 11, 6
  assert net.plan.metas[-1].param_bytes >= v * d * 4  # The softmax stage.
  pred = memory.predict(net.plan.metas, net.boundaries, 2, input_bytes=0)
  assert pred.stages[-1].parameters >= v * d * 4


@pytest.mark.parametrize('tie,message', [
    (tied_weights.tie('softmax.w', 'embed.emb', True),
     r"'softmax.w' is tied to 'embed.emb', but the pipeline has no layer "
     r"'embed'"),
    (tied_weights.tie('softmax.w', 'emb.emb', False),
     r"'softmax.w' is float32 \[6, 11\] but 'emb.emb' is float32 \[11, 6\]"),
    (tied_weights.tie('softmax.v', 'emb.emb', True),
     r"'softmax.v' names no variable of layer net.softmax \(which has "
     r"\['b', 'w'\]\)"),
    (tied_weights.tie('emb.emb', 'softmax.w', True),
     r'not an earlier layer than layers\[0\]; the owner comes first'),
    (tied_weights.tie('softmax', 'emb.emb', True), r'must each be'),
])
def test_bad_ties_are_one_line_naming_both_paths(tie, message):
  layers, shapes, _ = stacks.tied_stack()
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, input_shapes=shapes, num_stages=2,
      tied_weights=[tie])
  with pytest.raises(tied_weights.TieError, match=message) as e:
    p.Instantiate()
  assert '\n' not in str(e.value)
