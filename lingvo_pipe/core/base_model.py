"""Tasks and model params: what the trainer and evaler run.

A *task* is a layer that turns an input batch into predictions and a loss:

    preds   = task.ComputePredictions(theta, batch)
    metrics = task.ComputeLoss(theta, preds, batch)  # {'loss': (v, w), ...}

Every metric is a `(value, weight)` pair: `value` is a mean over `weight`
examples (or tokens), so the evaler can average metrics over batches
exactly. The loss of a batch of N examples must be the *sum* of per-example
losses divided by N; the pipeline splits the gradient of exactly that
quantity across micro-batches, so no rescaling is needed anywhere.

A *model* is a `SingleTaskModelParams` subclass registered under `params/`:
`Task()` gives the task's Params, `Train()` / `Dev()` / `Test()` the input
generator Params of each split.

Hooks the binaries call (override what a task needs):

* `Summaries() -> dict[str, float]` — extra scalars the trainer writes to
  TensorBoard beside the loss (pipeline tasks: partition imbalance, bubble
  fraction). Called in Python, outside the train step.
* `EvalStep(theta, batch) -> NestedMap` — what the evaler computes per batch
  in inference mode (default: FProp's metrics). A translation task decodes
  here and returns the hypotheses.
* `CreateEvalAggregator()` — an object with `Update(batch, outputs)` (both
  NestedMaps of numpy arrays, once per eval batch) and `Finalize() ->
  dict[str, float]` (once per checkpoint). The default,
  `WeightedMeanAggregator`, averages every `(value, weight)` metric over the
  whole split exactly: Σ value·weight / Σ weight, not a mean of batch means
  (the last eval batch may be smaller). Accuracy for images or BLEU over decoded sentences are
  aggregators of their own.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap

Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]


def train_params() -> Params:
  """Training hyperparameters shared by every task (`task.train`)."""
  p = Params()
  p.Define('optimizer', 'adam', 'One of: sgd (momentum), adam, rmsprop.')
  p.Define('learning_rate', 1e-3, 'Peak learning rate.')
  p.Define('momentum', 0.9, 'Momentum of sgd and rmsprop.')
  p.Define('rmsprop_decay', 0.9, 'RMSProp decay of the squared-gradient '
           'average (GPipe\'s AmoebaNet recipe: 0.9).')
  p.Define('adam_beta1', 0.9, 'Adam beta1.')
  p.Define('adam_beta2', 0.999, 'Adam beta2.')
  p.Define('epsilon', 1e-7, 'Optimizer epsilon (adam, rmsprop).')
  p.Define('lr_schedule', 'constant', 'One of: constant, exponential '
           '(×lr_decay_rate every lr_decay_steps), cosine (to 0 at '
           'max_steps), rsqrt (Transformer: warm-up then 1/sqrt(step)).')
  p.Define('lr_warmup_steps', 0, 'Linear warm-up steps (all schedules).')
  p.Define('lr_decay_steps', 1000, 'Steps per decay period (exponential).')
  p.Define('lr_decay_rate', 0.97, 'Decay per period (exponential; GPipe\'s '
           'AmoebaNet recipe: 0.97 every 3 epochs).')
  p.Define('clip_gradient_norm', 0.0, 'Clip the global gradient norm to '
           'this value; 0 disables.')
  p.Define('weight_decay', 0.0, 'L2 weight decay: weight_decay·½·Σw² over '
           'every trainable variable is added to the loss.')
  p.Define('max_steps', 1000, 'Training stops after this many steps.')
  p.Define('save_interval_steps', 100, 'Checkpoint every this many steps.')
  p.Define('max_checkpoints_to_keep', 5, 'Older checkpoints are deleted.')
  p.Define('summary_interval_steps', 10, 'TensorBoard summaries every this '
           'many steps.')
  return p


class BaseTask(base_layer.BaseLayer):
  """A layer that computes predictions, a loss and metrics from a batch."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('train', train_params(), 'Training hyperparameters.')
    return p

  def ComputePredictions(self, theta: NestedMap, batch: NestedMap) -> Any:
    raise NotImplementedError(f'{type(self).__name__}.ComputePredictions')

  def ComputeLoss(self, theta: NestedMap, predictions: Any,
                  batch: NestedMap) -> Metrics:
    raise NotImplementedError(f'{type(self).__name__}.ComputeLoss')

  def FProp(self, theta: NestedMap, batch: NestedMap) -> Metrics:
    """Predictions then loss: the metrics dict, which includes 'loss'."""
    return self.ComputeLoss(theta, self.ComputePredictions(theta, batch),
                            batch)

  def Inspect(self) -> str:
    """A report of the built task (partition, schedule); default none."""
    return ''

  @classmethod
  def InspectParams(cls, p: InstantiableParams) -> str:
    """What `trainer --mode=inspect_params` prints for task params `p`.

    Builds the task and calls Inspect(); tasks that can plan from Params
    alone (PipelinedTask) override it, so it needs no devices.
    """
    return p.Instantiate().Inspect()

  def Summaries(self) -> dict[str, float]:
    """Extra scalars for the trainer's TensorBoard summaries (default none)."""
    return {}

  def EvalStep(self, theta: NestedMap, batch: NestedMap) -> NestedMap:
    """What the evaler computes per batch (inference mode): FProp's metrics."""
    return NestedMap(self.FProp(theta, batch))

  def CreateEvalAggregator(self) -> 'EvalAggregator':
    """A fresh aggregator of `EvalStep` outputs over one eval pass."""
    return WeightedMeanAggregator()


class EvalAggregator(Protocol):
  """Accumulates eval outputs over a split (see the module docstring)."""

  def Update(self, batch: NestedMap, outputs: NestedMap) -> None:
    ...

  def Finalize(self) -> dict[str, float]:
    ...


class WeightedMeanAggregator:
  """Exact weighted means of every `(value, weight)` entry of the outputs.

  >>> agg = WeightedMeanAggregator()
  >>> agg.Update(NestedMap(), NestedMap(loss=(np.float32(1.0), 3.0)))
  >>> agg.Update(NestedMap(), NestedMap(loss=(np.float32(3.0), 1.0)))
  >>> agg.Finalize()
  {'loss': 1.5}

  Entries that are not pairs (e.g. decoded ids) are ignored.
  """

  def __init__(self) -> None:
    self._sums: dict[str, float] = {}
    self._weights: dict[str, float] = {}

  def Update(self, batch: NestedMap, outputs: NestedMap) -> None:
    del batch  # The metrics already carry their weights.
    for name, entry in outputs.items():
      if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
        continue
      value, weight = (float(np.asarray(x, np.float64)) for x in entry)
      self._sums[name] = self._sums.get(name, 0.0) + value * weight
      self._weights[name] = self._weights.get(name, 0.0) + weight

  def Finalize(self) -> dict[str, float]:
    return {name: (self._sums[name] / w if w > 0 else float('nan'))
            for name, w in self._weights.items()}


class SingleTaskModelParams:
  """Base class of registered model configs (see `model_registry`)."""

  def Task(self) -> InstantiableParams:
    raise NotImplementedError(f'{type(self).__name__}.Task')

  def Train(self) -> InstantiableParams:
    raise NotImplementedError(f'{type(self).__name__}.Train')

  def Dev(self) -> InstantiableParams:
    return self.Test()

  def Test(self) -> InstantiableParams:
    raise NotImplementedError(f'{type(self).__name__}.Test')
