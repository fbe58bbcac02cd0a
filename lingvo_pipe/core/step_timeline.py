"""The trainer's `--timeline_steps`: pictures of real training steps.

At each chosen step (and the step before it, to warm the function up) the
trainer runs that step through a second compiled step function: the same
training step with `fprop_context.scope(timeline=[...])` open, so the
pipeline engine brackets every forward, recompute and backward with
`tf.timestamp()`. The step returns what the plain one does (metrics, norm,
status, learning rate; its update applied, or not, by the same rule) and
the timestamps as well. From them it writes, under
`<logdir>/timeline/`:

* `step_<s>.trace.json`: a Chrome trace (chrome://tracing, ui.perfetto.dev)
  with the measured step and the simulator's prediction for it;
* `step_<s>.png`: the same as a Gantt chart (needs `lingvo_pipe[plots]`).

TensorFlow refuses `tf.timestamp` under op determinism (the trainer's
--deterministic), so a recorded step runs with it switched off; on CPU the
step's update is still the same, bit for bit (tests check it).

The prediction is `simulator.simulate` on stage costs calibrated from this
step's own median op durations (`timeline.calibrated_costs`), so the two
panels differ where the real step leaves the schedule (transfers, dispatch
gaps). Tracing the second function costs about as much as the first step.

A compiled function's first run of a batch shape pays one-off costs
(memory and kernel set-up: the translation task's step 8 on 2 stage
processes took 4.00 s cold and 3.32 s warm, its forward ops up to a third
longer, when every dropout op still drew the whole batch's mask; 2.30 s
warm since), so a chosen step runs on a warmed-up function: the
latest earlier step of the same batch shape runs recorded too. With one
shape that is the step before; with length buckets (the translation
task's three shapes take turns) the trainer asks the input generator each
step's shapes (`warm_up_steps`). The first step of a run cannot be warmed
up and shows one-off start-up work.

On a cluster (stage processes, replicas) each task records its own
stages; the recorded step then sums every task's stamps, laid out as one
[stages, micro-batches, F/R/B, start/end] array (zeros where another task
ran the op, and in every replica but the first), in one all-reduce, and the
chief writes the merged picture. Its times are each process's clock: one
host's processes share it; across hosts the picture is as good as their
clocks agree (NTP: about a millisecond).
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable, Iterable, Sequence

from absl import logging
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # pylint: disable=g-direct-tensorflow-import

from lingvo_pipe import errors
from lingvo_pipe import extras
from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import timeline

TIMELINE_DIR = 'timeline'
# How far back a chosen step's batch shape is looked for (the translation
# task's buckets recur within 5 steps).
WARM_UP_SEARCH = 16


class TimelineStepError(errors.LingvoPipeError):
  """--timeline_steps cannot be honoured; the message says why and the fix."""


def _pipeline_of(task: Any) -> gpipe.PipeliningLayer:
  for layer in task.Walk():
    if isinstance(layer, gpipe.PipeliningLayer):
      return layer
  raise TimelineStepError(
      f'--timeline_steps records the pipeline engine, but task {task.path} '
      'has no PipeliningLayer; drop --timeline_steps.')


def _without_op_determinism(fn: Callable[..., Any], *args: Any) -> Any:
  """`fn(*args)` with TF op determinism off: under it `tf.timestamp` fails."""
  was_on = tf_config.is_op_determinism_enabled()
  if was_on:
    tf_config.disable_op_determinism()
  try:
    return fn(*args)
  finally:
    if was_on:
      tf.config.experimental.enable_op_determinism()


def warm_up_steps(chosen: Iterable[int], first: int,
                  signature: Callable[[int], Any] | None,
                  search: int = WARM_UP_SEARCH) -> set[int]:
  """For each chosen step, the step whose recorded run warms its function.

  Args:
    chosen: the steps to record (1-based).
    first: the run's first step; nothing before it runs.
    signature: step → its batch's shapes, or None if every step has the
      same (the step before a chosen step then warms it).
    search: how many steps back a chosen step's shapes are looked for.

  Returns:
    The latest step before each chosen one (≥ `first`) with its shapes.
    None within `search` steps: that chosen step runs cold and says so.
  """
  warm = set()
  for s in sorted(chosen):
    earlier = range(s - 1, max(first, s - search) - 1, -1)
    if signature is None:
      warm.update(earlier[:1])
      continue
    want = signature(s)
    match = next((t for t in earlier if signature(t) == want), None)
    if match is not None:
      warm.add(match)
    elif s > first:
      logging.warning(
          'Timeline of step %d: no step from %d to %d has its batch shapes '
          '%s, so its function is not warmed up and its ops include one-off '
          'costs; choose a later step.', s, max(first, s - search), s - 1,
          want)
  return warm


class TimelineSteps:
  """Records the training steps in `steps` (1-based, as the progress line
  counts them) and writes their pictures into `<logdir>/timeline/`."""

  def __init__(self, logdir: str, steps: Sequence[int], task: Any,
               train_step: Callable[..., tuple[Any, ...]]) -> None:
    """Args: train_step(batch, timeline=list) is the trainer's step."""
    bad = [s for s in steps if s < 1]
    if bad:
      raise TimelineStepError(f'--timeline_steps={",".join(map(str, steps))}'
                              f' holds {bad[0]}; steps count from 1.')
    extras.require('matplotlib', 'plots', '--timeline_steps (its PNG)')
    self._pipeline = _pipeline_of(task)
    self._dir = os.path.join(logdir, TIMELINE_DIR)
    self._steps = set(steps)
    self._train_step = train_step
    self._keys: list[Any] = []
    self._fn = tf.function(self._recorded_step, autograph=False)
    self._warm = warm_up_steps(self._steps, 1, None)

  def plan_warm_ups(self, first: int,
                    signature: Callable[[int], Any] | None) -> None:
    """Chooses the warm-up steps of a run whose first step is `first`
    (`warm_up_steps`); by default, each chosen step's step before."""
    self._warm = warm_up_steps(self._steps, first, signature)

  def wants(self, step: int) -> bool:
    """Whether step `step` runs recorded: a chosen step, or the one that
    warms a chosen step's function up (`plan_warm_ups`)."""
    return step in self._steps or step in self._warm

  def _recorded_step(self, batch: Any) -> tuple[Any, ...]:
    ops: list[Any] = []
    outputs = self._train_step(batch, timeline=ops)
    self._keys, stamps = timeline.stamps(ops)
    if self._pipeline.placement.multi_process:
      stamps = self._merged(stamps)
    return tuple(outputs) + (stamps,)

  def _merged(self, stamps: tf.Tensor) -> tf.Tensor:
    """Every task's stamps of replica 0, as `timeline.stamps` gives them:
    one row per (stage, micro-batch, F/R/B), zeros where no op ran."""
    place = self._pipeline.placement
    counts = collections.Counter(self._keys)  # Each op once per micro-batch.
    num_micro = max(counts.values(), default=1)
    shape = [self._pipeline.plan.num_stages, num_micro, len(timeline.KINDS)]
    dense = tf.zeros(shape + [2], tf.float64)
    if self._keys and not place.replica:  # Replicas: show the first only.
      where = tf.stack([
          tf.constant([k for k, _ in self._keys]),
          tf.cast(stamps[:, 0], tf.int32),
          tf.constant([timeline.KINDS.index(kind) for _, kind in self._keys])
      ], axis=1)
      dense = tf.scatter_nd(where, stamps[:, 1:], shape + [2])
    merged = place.peers.all_reduce(dense, place.all_tasks(), ('timeline',))
    self._keys = [(k, kind) for k in range(shape[0])
                  for _ in range(num_micro) for kind in timeline.KINDS]
    micro = tf.constant([[float(m)] for _ in range(shape[0])
                         for m in range(num_micro) for _ in timeline.KINDS],
                        tf.float64)
    return tf.concat([micro, tf.reshape(merged, [-1, 2])], 1)

  def run(self, step: int, batch: Any) -> tuple[Any, ...]:
    """Runs training step `step` recorded; the chief writes its files;
    returns the train step's outputs."""
    *outputs, stamps = _without_op_determinism(self._fn, batch)
    records = [r for r in timeline.from_stamps(self._keys, stamps.numpy())
               if r.end > 0]  # Merged: the ops nobody ran are zeros.
    if step not in self._steps or self._pipeline.placement.peers.task:
      pass  # The warm-up run before a chosen step, or not the chief.
    elif records:
      self._write(step, timeline.normalized(records))
    else:  # Inference-only or K=1 paths record nothing.
      logging.warning('Step %d recorded no pipeline ops; nothing written.',
                      step)
    return tuple(outputs)

  def _write(self, step: int, measured: list[timeline.Record]) -> None:
    os.makedirs(self._dir, exist_ok=True)
    recompute = self._pipeline.params.recompute
    num_micro_batches = max(r.micro_batch for r in measured) + 1
    predicted = simulator.simulate(timeline.calibrated_costs(measured),
                                   num_micro_batches, recompute).events
    panels = [('measured', measured), ('predicted (simulator)', predicted)]
    base = os.path.join(self._dir, f'step_{step}')
    timeline.write_chrome_trace(base + '.trace.json', panels)
    num_stages = max(r.stage for r in measured) + 1
    timeline.plot_gantt(panels, base + '.png',
                        title=f'{self._pipeline.path}: step {step}, '
                        f'K={num_stages}, M={num_micro_batches}, '
                        f'recompute={recompute}')
    logging.info('Timeline of step %d: %s.trace.json (chrome://tracing, '
                 'ui.perfetto.dev) and %s.png.', step, base, base)
