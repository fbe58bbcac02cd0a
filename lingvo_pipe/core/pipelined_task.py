"""PipelinedTask: a task whose network is one PipeliningLayer.

What every pipelined task shares, written once:

    ComputePredictions  pipeline.FProp(theta.pipeline, *PipelineInputs(batch))
    FProp (training)    pipeline.FPropLoss(...): the last stage computes
                        ComputeLoss of each micro-batch, so every schedule
                        (1F1B and interleaved too) runs; eval is unchanged
    Inspect, Summaries  the pipeline's partition, schedule and bubble
    InspectParams       the same from Params alone: no devices, no weights

A subclass says which batch fields feed the pipeline (`PipelineInputs`) and
which the loss reads (`LossInputs`, every leaf with the batch on the
pipeline's batch_dim: they are split into micro-batches with the inputs),
and, if the layer list is derived from other params (an AmoebaNet from
`task.network`), overrides the classmethod `PipelineParams`.
"""

from __future__ import annotations

from typing import Any

from lingvo_pipe.core import base_model
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import plan as plan_lib


class PipelinedTask(base_model.BaseTask):
  """A BaseTask whose predictions come from the PipeliningLayer `pipeline`."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('pipeline', gpipe.PipeliningLayer.Params(), 'The network as a '
             'pipeline: layers, num_stages, num_micro_batches, schedule, '
             'recompute, devices.')
    return p

  @classmethod
  def PipelineParams(cls, p: Params, where: str = '') -> InstantiableParams:
    """The pipeline's Params for task params `p` (default: p.pipeline)."""
    del where
    return p.pipeline.Copy()

  @classmethod
  def InspectParams(cls, p: Params) -> str:
    """`Inspect()` from Params alone: no devices, no variables."""
    where = f'{p.name or "task"}.pipeline'
    return plan_lib.make_plan(cls.PipelineParams(p, where), where).to_text()

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('pipeline', self.PipelineParams(
        self.params, f'{self.path}.pipeline'))

  def PipelineInputs(self, batch: NestedMap) -> tuple[Any, ...]:
    """The pipeline's positional inputs, from the batch."""
    raise NotImplementedError(f'{type(self).__name__}.PipelineInputs')

  def LossInputs(self, batch: NestedMap) -> NestedMap:
    """The batch fields ComputeLoss reads (each with the batch dim)."""
    raise NotImplementedError(f'{type(self).__name__}.LossInputs')

  def ComputePredictions(self, theta: NestedMap, batch: NestedMap) -> Any:
    return self.children.pipeline.FProp(theta.pipeline,
                                        *self.PipelineInputs(batch))

  def FProp(self, theta: NestedMap,
            batch: NestedMap) -> base_model.Metrics:
    """Metrics; in training the loss is computed inside the pipeline."""
    if not fprop_context.current().training:
      return super().FProp(theta, batch)
    return self.children.pipeline.FPropLoss(
        theta.pipeline, self.PipelineInputs(batch), self.LossInputs(batch),
        lambda outputs, labels: self.ComputeLoss(theta, outputs, labels))

  def Inspect(self) -> str:
    return self.children.pipeline.Inspect()

  def Summaries(self) -> dict[str, float]:
    return self.children.pipeline.Summaries()

