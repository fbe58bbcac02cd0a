"""The evaler's task hooks (base_model): EvalStep and the default aggregator."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_model
from lingvo_pipe.core.nested_map import NestedMap


def test_weighted_mean_is_exact_over_unequal_batches():
  rng = np.random.default_rng(0)
  per_example = rng.normal(size=23)
  agg = base_model.WeightedMeanAggregator()
  for start in range(0, 23, 8):  # Batches of 8, 8 and 7.
    chunk = per_example[start:start + 8]
    agg.Update(NestedMap(), NestedMap(
        loss=(np.float32(chunk.mean()), np.float32(len(chunk))),
        ids=np.arange(3)))  # Not a (value, weight) pair: ignored.
  result = agg.Finalize()
  assert set(result) == {'loss'}
  assert result['loss'] == pytest.approx(per_example.mean(), rel=1e-6)


def test_zero_weight_gives_nan_not_an_exception():
  agg = base_model.WeightedMeanAggregator()
  agg.Update(NestedMap(), NestedMap(acc=(1.0, 0.0)))
  assert np.isnan(agg.Finalize()['acc'])


class _MeanTask(base_model.BaseTask):
  """loss = mean of x, for checking the default hooks."""

  def ComputePredictions(self, theta, batch):
    return batch.x

  def ComputeLoss(self, theta, predictions, batch):
    return {'loss': (tf.reduce_mean(predictions),
                     tf.cast(tf.size(predictions), tf.float32))}


def test_default_hooks():
  task = _MeanTask.Params().Set(name='t').Instantiate()
  out = task.EvalStep(task.theta, NestedMap(x=tf.constant([1.0, 2.0, 6.0])))
  assert isinstance(out, NestedMap)
  assert float(out.loss[0]) == 3.0 and float(out.loss[1]) == 3.0
  assert task.Summaries() == {}
  assert isinstance(task.CreateEvalAggregator(),
                    base_model.WeightedMeanAggregator)
