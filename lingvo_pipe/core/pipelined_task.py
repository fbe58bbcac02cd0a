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
  def _Pipeline(cls, p: Params, where: str) -> InstantiableParams:
    pipeline = cls.PipelineParams(p, where)
    if pipeline.memory_optimizer is None:  # The preflight counts its slots.
      pipeline.memory_optimizer = p.train.optimizer
    return pipeline

  @classmethod
  def InspectParams(cls, p: Params, profile_inputs: Any = None) -> str:
    """`Inspect()` from Params alone: no devices, no variables.

    With `profile_inputs` (a batch's PipelineInputs), each layer is also
    profiled and the report shows the partition by measured time, with
    FPropMeta flops beside it, then the FPropMeta partition.
    """
    where = f'{p.name or "task"}.pipeline'
    pipeline = cls._Pipeline(p, where)
    text = plan_lib.make_plan(pipeline, where).to_text()
    if profile_inputs is not None:
      profiled = pipeline.Copy().Set(costs='profile')
      text = (plan_lib.make_plan(profiled, where, profile_inputs).to_text()
              + '\n\nWithout profiling (the configured costs):\n' + text)
    return text

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('pipeline', self._Pipeline(
        self.params, f'{self.path}.pipeline'))

  @classmethod
  def PipelineInputs(cls, batch: NestedMap) -> tuple[Any, ...]:
    """The pipeline's positional inputs, from the batch."""
    raise NotImplementedError(f'{cls.__name__}.PipelineInputs')

  @classmethod
  def LossInputs(cls, batch: NestedMap) -> NestedMap:
    """The batch fields ComputeLoss reads (each with the batch dim)."""
    raise NotImplementedError(f'{cls.__name__}.LossInputs')

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

