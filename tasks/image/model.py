"""ImageClassifierTask: AmoebaNet-D through a GPipe pipeline, scored by
accuracy.

The network is described by `task.network` (AmoebaNet-D(L, D), see
`amoebanet.amoebanet_params`) rather than by a literal layer list, so that a
user can resize it from the command line (`task.network.num_cells: 18`) and
the pipeline is re-cut accordingly. `task.pipeline` holds everything else
about the pipeline (K, M, recompute, devices); its `layers` stay empty in
the config and the task hands the pipeline `network_layers(task.network)`.

Loss: label-smoothed softmax cross-entropy (GPipe's AmoebaNet recipe uses
ε = 0.1), the sum over examples / N as `base_model` requires. Metrics, each
weighted by the number of examples: `loss`, `accuracy`, `top1_error`. The
evaler's aggregator counts correct predictions over the whole split, so
the reported accuracy is exact, however the last batch is sized.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import base_model
from lingvo_pipe.core import pipelined_task
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import softmax
from lingvo_pipe.tasks.image import amoebanet


class ImageClassifierTask(pipelined_task.PipelinedTask):
  """Classifies `batch.image` [N, H, W, C] into `batch.label` [N] classes."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('network', amoebanet.amoebanet_params(), 'The AmoebaNet-D(L, D) '
             'network; the pipeline runs network_layers(network).')
    p.Define('label_smoothing', 0.1, 'ε of the cross-entropy (GPipe\'s '
             'AmoebaNet recipe: 0.1).')
    return p

  @classmethod
  def PipelineParams(cls, p: Params, where: str = '') -> InstantiableParams:
    """task.pipeline with the layers of task.network (leave its layers
    empty; input_shapes None means [[None, H, W, C]])."""
    return pipeline_params(p, where)

  @classmethod
  def PipelineInputs(cls, batch: NestedMap) -> tuple[tf.Tensor]:
    return (batch.image,)  # → logits [N, num_classes].

  @classmethod
  def LossInputs(cls, batch: NestedMap) -> NestedMap:
    return NestedMap(label=batch.label)

  def ComputeLoss(self, theta: NestedMap, predictions: tf.Tensor,
                  batch: NestedMap) -> base_model.Metrics:
    del theta
    labels = tf.cast(batch.label, tf.int32)
    loss, num = softmax.mean_softmax_cross_entropy(
        predictions, labels, label_smoothing=self.params.label_smoothing)
    accuracy = tf.reduce_mean(_correct(predictions, labels))
    return {'loss': (loss, num), 'accuracy': (accuracy, num),
            'top1_error': (1.0 - accuracy, num)}

  def EvalStep(self, theta: NestedMap, batch: NestedMap) -> NestedMap:
    logits = self.ComputePredictions(theta, batch)
    out = NestedMap(self.ComputeLoss(theta, logits, batch))
    correct = _correct(logits, tf.cast(batch.label, tf.int32))
    out.num_correct = tf.reduce_sum(tf.cast(correct, tf.int64))
    out.num_examples = tf.size(correct, out_type=tf.int64)
    return out

  def CreateEvalAggregator(self) -> 'AccuracyAggregator':
    return AccuracyAggregator()


class LayerListClassifierTask(ImageClassifierTask):
  """The image classifier of any layer list: task.pipeline.layers as given
  (a Keras model's, from `lingvo_pipe.keras.from_keras`), no AmoebaNet."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Delete('network')
    return p

  @classmethod
  def PipelineParams(cls, p: Params, where: str = '') -> InstantiableParams:
    if not p.pipeline.layers:
      raise base_layer.LayerError(
          f'{where}: task.pipeline.layers is empty; this task classifies '
          'with the layers given there (e.g. from_keras(model)).')
    return pipelined_task.PipelinedTask.PipelineParams(p, where)


def _correct(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
  """float32 [N]: 1 where the top-scoring class is the label."""
  predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
  return tf.cast(tf.equal(predicted, labels), tf.float32)


def pipeline_params(p: Params, where: str) -> InstantiableParams:
  """`p.pipeline` with the AmoebaNet layer list and input shapes filled in.

  Raises:
    base_layer.LayerError: `p.pipeline.layers` was set, or its input_shapes
      disagree with `p.network.image_shape`.
  """
  net = p.network
  want = list(net.image_shape)
  pipeline = p.pipeline.Copy()
  if pipeline.layers:
    raise base_layer.LayerError(
        f'{where}: task.pipeline.layers is set ({len(pipeline.layers)} '
        'layers) but this task builds them from task.network; leave it empty '
        'and change task.network (num_cells, filters, ...).')
  pipeline.layers = amoebanet.network_layers(net)
  if pipeline.input_shapes is None:
    pipeline.input_shapes = [[None] + want]
  shapes = pipeline.input_shapes
  if len(shapes) != 1 or list(shapes[0])[1:] != want:
    raise base_layer.LayerError(
        f'{where}: task.pipeline.input_shapes = {shapes} but '
        f'task.network.image_shape = {tuple(want)}; set input_shapes to '
        f'[[batch_size, {", ".join(map(str, want))}]] (or None).')
  if not pipeline.name:
    pipeline.name = 'amoebanet'
  return pipeline


class AccuracyAggregator(base_model.WeightedMeanAggregator):
  """Weighted means of the metrics, with accuracy counted exactly.

  `accuracy` = Σ num_correct / Σ num_examples over the split (integers, no
  float rounding), `top1_error` = 1 − accuracy, plus `num_examples`.
  """

  def __init__(self) -> None:
    super().__init__()
    self._correct = 0
    self._total = 0

  def Update(self, batch: NestedMap, outputs: NestedMap) -> None:
    super().Update(batch, outputs)
    self._correct += int(np.asarray(outputs.num_correct))
    self._total += int(np.asarray(outputs.num_examples))

  def Finalize(self) -> dict[str, float]:
    out = super().Finalize()
    if self._total:
      out['accuracy'] = self._correct / self._total
      out['top1_error'] = 1.0 - out['accuracy']
    out['num_examples'] = float(self._total)
    return out
