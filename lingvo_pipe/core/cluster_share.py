"""A training run's share of its cluster: the whole run, or one task of K×R.

The trainer is one program in every process of a multi-process run
(`python -m lingvo_pipe.worker`, started by `lingvo_pipe.launch` on one
host or by hand on each host). `Share` holds what differs between its tasks,
so that the trainer keeps one code path for 1 and K×R processes:

- the slice of the global batch that this task's replica trains on (every
  task reads the same global batch: the input order is a pure function of
  the step);
- the values every task must agree on after a step: the global gradient
  norm (each task holds its own stage's gradients, already summed over the
  replicas by the engine; a tied weight's copy is counted by its owner
  only), whether any task's weights became non-finite, and whether any
  task was asked to stop;
- who writes what: the chief (task 0) writes params.txt, the summaries and
  the checkpoint state file; each task of replica 0 writes its stage's
  checkpoint shard (`checkpoints.save_shard`).

In a single process every method is the identity and the chief is this
process.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import base_model
from lingvo_pipe.core import tied_weights
from lingvo_pipe.pipeline import placement as placement_lib


class ClusterShareError(errors.LingvoPipeError):
  """A task or batch that cannot be shared over the run's processes."""


class Share:
  """This process's share of the run (see the module docstring)."""

  def __init__(self, place: placement_lib.Placement,
               copies: list[tf.Variable] | None = None) -> None:
    self._place = place
    self._copies = {v.ref() for v in copies or []}

  @classmethod
  def of(cls, task: base_model.BaseTask) -> 'Share':
    """The share of `task`'s pipeline in this process's run.

    Raises:
      ClusterShareError: a multi-process run of a task with no pipeline.
    """
    pipeline = getattr(task.children, 'pipeline', None)
    peers = placement_lib.peers()
    if pipeline is None:
      if peers.num_tasks > 1:
        raise ClusterShareError(
            f'{type(task).__name__} has no `pipeline` child (a '
            'PipeliningLayer), so it cannot run in '
            f'{peers.num_tasks} processes; run it in one process (no '
            '--cluster_spec or TF_CONFIG), or make it a PipelinedTask.')
      return cls(placement_lib.Placement(peers, 1, 1))
    return cls(pipeline.placement, tied_weights.copies_in(task))

  @property
  def multi_process(self) -> bool:
    return self._place.multi_process

  @property
  def task(self) -> int:
    return self._place.peers.task

  @property
  def is_chief(self) -> bool:
    """Task 0: writes params.txt, summaries, the checkpoint state file."""
    return self.task == 0

  @property
  def num_stages(self) -> int:
    return self._place.num_devices if self.multi_process else 1

  @property
  def stage(self) -> int:
    """The pipeline device (stage process) this task runs; 0 if all."""
    return self._place.device or 0

  @property
  def num_replicas(self) -> int:
    return self._place.num_replicas

  @property
  def replica(self) -> int:
    return self._place.replica if self.multi_process else 0

  @property
  def writes_shard(self) -> bool:
    """Whether this task saves its stage's variables (replica 0 only)."""
    return self.replica == 0

  def describe(self) -> str:
    if not self.multi_process:
      return 'one process'
    return (f'task {self.task} of {self._place.peers.num_tasks}: stage '
            f'{self.stage} of {self.num_stages}, replica {self.replica} of '
            f'{self.num_replicas}')

  def check_batch_size(self, batch_size: int, where: str) -> None:
    """Raises ClusterShareError unless the replicas split the batch evenly."""
    if batch_size % self.num_replicas:
      raise ClusterShareError(
          f'{where}: batch_size={batch_size} does not split over '
          f'{self.num_replicas} replicas; use a multiple of '
          f'{self.num_replicas} (each replica trains on batch_size ÷ R '
          'examples of the global batch).')

  # ---- Graph code: inside the train step -------------------------------------
  def replica_batch(self, batch: Any) -> Any:
    """This replica's contiguous slice of every leaf's batch (axis 0)."""
    if self.num_replicas == 1:
      return batch

    def _slice(x: tf.Tensor) -> tf.Tensor:
      n = (x.shape[0] if x.shape.rank and x.shape[0] is not None else
           tf.shape(x)[0]) // self.num_replicas  # Static if known.
      return x[self.replica * n:(self.replica + 1) * n]

    return tf.nest.map_structure(_slice, batch)

  def counted(self, grads: list[Any], variables: list[tf.Variable]
             ) -> list[tf.Tensor]:
    """The gradients this task adds to the global norm: not None, and not
    of a tied weight's copy (its owner's task counts that weight)."""
    return [g for g, v in zip(grads, variables)
            if g is not None and v.ref() not in self._copies]

  def global_norm(self, local_norm: tf.Tensor) -> tf.Tensor:
    """The norm of every stage's gradients from this stage's norm.

    Each stage's gradients are the same in every replica (all-reduced), so
    the sum of squares over all tasks counts each stage R times.
    """
    if not self.multi_process:
      return local_norm
    peers = self._place.peers
    squares = peers.all_reduce(tf.reshape(tf.square(local_norm), [1]),
                               range(peers.num_tasks), ('grad_norm',))
    return tf.sqrt(squares[0] / self.num_replicas)

  def any_task(self, flag: tf.Tensor, key: str) -> tf.Tensor:
    """Bool: `flag` is true in at least one task of the run."""
    if not self.multi_process:
      return flag
    peers = self._place.peers
    count = peers.all_reduce(tf.reshape(tf.cast(flag, tf.float32), [1]),
                             range(peers.num_tasks), ('any', key))
    return count[0] > 0

  # ---- Eager, between steps ---------------------------------------------------
  def agree_to_stop(self, local: bool) -> bool:
    """Whether any task stops after this step (a signal, a deadline): all
    must stop after the same step, or the others would wait for ever."""
    if not self.multi_process:
      return local
    return bool(self._agree(tf.constant(float(local))).numpy())

  @tf.function(autograph=False)
  def _agree(self, local: tf.Tensor) -> tf.Tensor:
    return self.any_task(local > 0, 'stop')

  def barrier(self, key: str) -> None:
    """Every task waits here for the others (e.g. all shards written)."""
    del key  # Every barrier between steps is one and the same collective.
    if self.multi_process:
      self._barrier()

  @tf.function(autograph=False)
  def _barrier(self) -> tf.Tensor:
    # A function, like the step: an eager barrier that reused its key at
    # every save once aborted a process (SIGABRT) on TF 2.21.
    return self._place.peers.barrier(key=('between_steps',))
