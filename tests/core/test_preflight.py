"""Checks before the first step: shapes that stage processes cannot know.

Stage processes receive tensors of the shape each step's inputs imply, so
every task must know the shape from the step: a training batch whose shape
the input generator leaves unknown is refused before anything is written.
"""

import pytest
import tensorflow as tf

from lingvo_pipe.core import preflight
from lingvo_pipe.pipeline import collective
from lingvo_pipe.pipeline import placement

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order


def _as_stage_process(net):
  """`net` as if it ran in task 0 of 2 stage processes (no cluster needed:
  the check reads the placement only)."""
  peers = collective.Peers(task=0, addresses=('127.0.0.1:1', '127.0.0.1:2'))
  net._placement = placement.Placement(peers, 2)  # pylint: disable=protected-access
  return net


def test_an_unknown_length_is_refused_on_stage_processes():
  net, _ = stacks.net('transformer', num_stages=2, num_micro_batches=2)
  specs = (tf.TensorSpec([stacks.BATCH, None, 8]),
           tf.TensorSpec([stacks.BATCH, None]))
  preflight.check_pipeline(net, specs, stacks.BATCH)  # One process: fine.
  with pytest.raises(preflight.BatchShapeError,
                     match=r'input 0 of the training batches of 8 examples '
                     r'has shape \(8, None, 8\), not known before the step.*'
                     r'length buckets') as e:
    preflight.check_pipeline(_as_stage_process(net), specs, stacks.BATCH)
  assert '\n' not in str(e.value)


def test_the_shapes_of_length_buckets_pass():
  net = _as_stage_process(stacks.net('transformer', num_stages=2,
                                     num_micro_batches=2)[0])
  for n in (stacks.BATCH, 2 * stacks.BATCH):  # Two buckets' batch sizes.
    preflight.check_pipeline(net, (tf.TensorSpec([n, 5, 8]),
                                   tf.TensorSpec([n, 5])), n)
