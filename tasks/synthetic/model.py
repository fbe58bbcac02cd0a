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
from lingvo_pipe.core import gpipe
from lingvo_pipe.core import preflight
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


class RegressionTask(base_model.BaseTask):
  """Predicts y from x with `p.pipeline`; loss = mean squared error.

  Metrics: `loss` (mean over examples of the mean over output dims of the
  squared error) and `mean_abs_error`, each weighted by the batch size.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('pipeline', gpipe.PipeliningLayer.Params(), 'The network: a '
             'PipeliningLayer over mlp_layers(...), x → predictions.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('pipeline', self.params.pipeline)

  def ComputePredictions(self, theta: NestedMap,
                         batch: NestedMap) -> tf.Tensor:
    return self.children.pipeline.FProp(theta.pipeline, batch.x)

  def ComputeLoss(self, theta: NestedMap, predictions: tf.Tensor,
                  batch: NestedMap) -> base_model.Metrics:
    del theta
    err = predictions - tf.cast(batch.y, predictions.dtype)
    weight = tf.cast(tf.shape(err)[0], tf.float32)
    return {
        'loss': (tf.reduce_mean(tf.square(err)), weight),
        'mean_abs_error': (tf.reduce_mean(tf.abs(err)), weight),
    }

  def CheckTrainBatch(self, batch_spec: NestedMap, batch_size: int) -> None:
    preflight.check_pipeline(self.children.pipeline, (batch_spec.x,),
                             batch_size)

  def Inspect(self) -> str:
    return self.children.pipeline.Inspect()

  def Summaries(self) -> dict[str, float]:
    pipeline = self.children.pipeline
    m = pipeline.params.num_micro_batches or 1
    return {'pipeline/partition_imbalance': pipeline.report.imbalance,
            'pipeline/bubble_fraction': pipeline.report.bubble_fraction(m)}
