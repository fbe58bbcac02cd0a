"""Checks that training can start, made before the trainer writes anything.

A bad config must end with one line and an untouched logdir, not with a
traceback at the first step after `params.txt` was written. Most of what
params can get wrong fails by construction, in `params.task.Instantiate()`:
the partition (`split_points`, `num_stages` against the layers), the
devices (K against what exists), the layer shapes (each layer's `FPropMeta`
fed the previous one's, from `input_shapes`). What construction cannot see
is the data:

    for N, spec in generator.TrainBatchSpecs(...):  # one, or one per bucket
      task.CheckTrainBatch(spec, N)

and a task's `CheckTrainBatch` (by default `check_task`) checks each
pipeline with `check_pipeline`: N against `num_micro_batches` /
`micro_batch_size` and the schedule (what the pipeline's plan would check
at the first step, memory budget included), the batch axis of every input
and label, and the inputs' shapes against `input_shapes` (so FPropMeta's
shapes are the real ones). With stage processes, every input's shape must
be known from the step (`TrainBatchSpecs`: a fixed shape, or one per length
bucket), and FPropMeta must take it: that is what the processes exchange. A task that says how a batch feeds its pipeline
(the classmethods `PipelineInputs` and `LossInputs`, as `PipelinedTask`
has) gets those specs by tracing just that mapping.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import gpipe


class BatchShapeError(errors.LingvoPipeError):
  """Training batches that do not fit the model; names the param to fix."""


def check_train_batches(task: Any, generator: Any,
                        element_spec: Any) -> None:
  """Runs `task.CheckTrainBatch` for every batch size the generator makes.

  Args:
    task: The instantiated task.
    generator: The training input generator.
    element_spec: `generator.TrainDataset(...).element_spec`.

  Raises:
    errors.LingvoPipeError: the task cannot train on these batches.
  """
  for size, spec in generator.TrainBatchSpecs(element_spec):
    task.CheckTrainBatch(spec, size)


def check_task(task: Any, batch_spec: Any, batch_size: int) -> None:
  """`BaseTask.CheckTrainBatch`'s default: every pipeline child of `task`.

  Args:
    task: An instantiated task.
    batch_spec: NestedMap of tf.TensorSpec of one training batch.
    batch_size: Examples in the batch.
  """
  for name, child in task.children.items():
    if not isinstance(child, gpipe.PipeliningLayer):
      continue
    inputs = labels = None
    if name == 'pipeline' and hasattr(type(task), 'PipelineInputs'):
      inputs, labels = _traced_inputs(type(task), batch_spec)
    check_pipeline(child, inputs, batch_size, labels)


def _traced_inputs(task_cls: Any, batch_spec: Any) -> tuple[Any, Any]:
  """(PipelineInputs, LossInputs) of a batch like `batch_spec`, symbolic."""

  def _feeds(batch: Any) -> tuple[Any, Any]:
    labels = (task_cls.LossInputs(batch)
              if hasattr(task_cls, 'LossInputs') else None)
    return tuple(task_cls.PipelineInputs(batch)), labels

  traced = tf.function(_feeds, autograph=False)
  return traced.get_concrete_function(batch_spec).structured_outputs


def check_pipeline(pipeline: Any, inputs: Any, batch_size: int,
                   labels: Any = None) -> None:
  """Checks a PipeliningLayer against the specs of its training inputs.

  Args:
    pipeline: An instantiated `gpipe.PipeliningLayer`.
    inputs: A nest of `tf.TensorSpec` (or tensors): the pipeline's
      positional inputs for one training batch, or None to check only the
      micro-batching and the schedule.
    batch_size: Examples per training step (N).
    labels: Optional nest the loss reads, split into micro-batches with the
      inputs (`FPropLoss`): only its batch axis is checked.

  Raises:
    errors.LingvoPipeError: N does not split into the micro-batches, or no
      schedule runs them (the plan's own errors); BatchShapeError: an
      input's batch axis or shape disagrees with the pipeline's `batch_dim`
      or `input_shapes`.
  """
  p, where = pipeline.params, pipeline.path
  m = pipeline.plan.num_micro_batches(batch_size)
  if m is not None:
    pipeline.plan.schedule(m)
  if inputs is None:
    return
  leaves = tf.nest.flatten(inputs)
  _check_batch_axis(leaves + ([] if labels is None else
                              tf.nest.flatten(labels)), p.batch_dim,
                    batch_size, where)
  if p.input_shapes is not None:
    _check_input_shapes(p.input_shapes, leaves, p.batch_dim, where)
  if pipeline.placement.multi_process:
    _check_static(pipeline, inputs, batch_size)


def _check_static(pipeline: Any, inputs: Any, batch_size: int) -> None:
  """Stage processes exchange tensors of shapes known from the step."""
  for i, leaf in enumerate(tf.nest.flatten(inputs)):
    shape = tf.TensorShape(leaf.shape)
    if not shape.is_fully_defined():
      raise BatchShapeError(
          f'{pipeline.path}: input {i} of the training batches of '
          f'{batch_size} examples has shape {shape}, not known before the '
          'step; stage processes exchange tensors of shapes every task '
          'knows from the step: pad every batch to one length, or use '
          'length buckets of one shape each (the input generator\'s '
          'TrainBatchSpecs says which).')
  gpipe.layer_metas(list(pipeline.params.layers),
                    tuple(tf.nest.map_structure(lambda x: x.shape, inputs)),
                    pipeline.path)  # Raises where FPropMeta refuses them.


def _check_batch_axis(leaves: list[Any], bd: int, batch_size: int,
                      where: str) -> None:
  """Every leaf has `batch_size` (or an unknown size) on axis `bd`."""
  for i, leaf in enumerate(leaves):
    shape = tf.TensorShape(leaf.shape)
    if shape.rank is None:
      continue
    if shape.rank <= bd or shape[bd] not in (None, batch_size):
      axis = (f'has no axis {bd}' if shape.rank <= bd else
              f'has {shape[bd]} on axis {bd}')
      raise BatchShapeError(
          f'{where}: input {i} of a training batch has shape {shape}, which '
          f'{axis} (task.pipeline.batch_dim={bd}), but a batch holds '
          f'{batch_size} examples; set task.pipeline.batch_dim to the batch '
          'axis of the inputs.')


def _check_input_shapes(input_shapes: Any, leaves: list[Any], bd: int,
                        where: str) -> None:
  """The non-batch dims of the real inputs against `p.input_shapes`."""
  want = [tf.TensorShape(s) for s in input_shapes]
  got = [tf.TensorShape(leaf.shape) for leaf in leaves]

  def _strip(s: tf.TensorShape) -> tf.TensorShape:
    if s.rank is None or s.rank <= bd:
      return s
    dims = s.as_list()
    return tf.TensorShape(dims[:bd] + dims[bd + 1:])

  if len(want) != len(got) or any(
      not _strip(w).is_compatible_with(_strip(g)) for w, g in zip(want, got)):
    raise BatchShapeError(
        f'{where}: training batches give the pipeline inputs of shapes '
        f'{[str(g) for g in got]}, but task.pipeline.input_shapes = '
        f'{[w.as_list() if w.rank is not None else None for w in want]} (the '
        'shapes its FPropMeta checks and costs are computed for); make them '
        'agree (the input params, or input_shapes).')
