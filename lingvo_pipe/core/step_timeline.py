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
Step 1 cannot be warmed up and shows one-off start-up work.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from absl import logging
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # pylint: disable=g-direct-tensorflow-import

from lingvo_pipe import errors
from lingvo_pipe import extras
from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import timeline

TIMELINE_DIR = 'timeline'


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

  def wants(self, step: int) -> bool:
    """Whether step `step` runs recorded: a chosen step, or the one before
    it (a compiled function's first run pays one-off costs, ~100 ms gaps
    between ops, so the chosen step gets a warmed-up function)."""
    return step in self._steps or step + 1 in self._steps

  def _recorded_step(self, batch: Any) -> tuple[Any, ...]:
    ops: list[Any] = []
    outputs = self._train_step(batch, timeline=ops)
    self._keys, stamps = timeline.stamps(ops)
    return tuple(outputs) + (stamps,)

  def run(self, step: int, batch: Any) -> tuple[Any, ...]:
    """Runs training step `step` recorded; writes its files; returns the
    train step's outputs."""
    *outputs, stamps = _without_op_determinism(self._fn, batch)
    records = timeline.from_stamps(self._keys, stamps.numpy())
    if step not in self._steps:
      pass  # The warm-up run before a chosen step.
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
