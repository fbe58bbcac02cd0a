"""RegressionTask: an MLP with BatchNorm, trained through a GPipe pipeline.

The smallest task that still uses every moving part of training: its network
is a `PipeliningLayer` (stages on logical devices, micro-batches, recompute),
it has a BatchNorm layer (statistics summed over micro-batches, folded once
per step by the trainer), and its loss is the mean over the batch of
per-example losses, as `base_model` requires.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_pipe.core import base_model
from lingvo_pipe.core import pipelined_task
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization


def mlp_layers(input_dim: int, hidden_dims: list[int],
               output_dim: int) -> list[InstantiableParams]:
  """FC+ReLU → BatchNorm per hidden layer, then a linear FC output."""
  layers = []
  dim = input_dim
  for i, hidden in enumerate(hidden_dims):
    layers.append(linear.FCLayer.Params().Set(
        name=f'fc{i}', input_dim=dim, output_dim=hidden, activation='RELU'))
    layers.append(normalization.BatchNormLayer.Params().Set(
        name=f'bn{i}', dim=hidden))
    dim = hidden
  layers.append(linear.FCLayer.Params().Set(
      name='out', input_dim=dim, output_dim=output_dim))
  return layers


class RegressionTask(pipelined_task.PipelinedTask):
  """Predicts y from x with `p.pipeline`; loss = mean squared error.

  Metrics: `loss` (mean over examples of the mean over output dims of the
  squared error) and `mean_abs_error`, each weighted by the batch size.
  """

  @classmethod
  def PipelineInputs(cls, batch: NestedMap) -> tuple[tf.Tensor]:
    return (batch.x,)

  @classmethod
  def LossInputs(cls, batch: NestedMap) -> NestedMap:
    return NestedMap(y=batch.y)

  def ComputeLoss(self, theta: NestedMap, predictions: tf.Tensor,
                  batch: NestedMap) -> base_model.Metrics:
    del theta
    err = predictions - tf.cast(batch.y, predictions.dtype)
    weight = tf.cast(tf.shape(err)[0], tf.float32)
    return {
        'loss': (tf.reduce_mean(tf.square(err)), weight),
        'mean_abs_error': (tf.reduce_mean(tf.abs(err)), weight),
    }
