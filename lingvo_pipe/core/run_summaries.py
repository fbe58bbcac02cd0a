"""What the trainer tells TensorBoard once per run: params, hparams, partition.

Scalars say how a run goes; these say what the run *is*, next to its curves
(`tensorboard --logdir=<logdir or a parent of several>`):

* Text tab, `params`: the run's whole `params.txt` (as Lingvo writes its
  params), so a curve can always be traced back to its config.
* Text tab, `pipeline/partition`: `task.Inspect()`, the partition report and
  the simulated schedule of the pipeline (stage costs, imbalance, bubble).
* HParams tab: the hyperparameters that tell runs apart (`task.train.*`,
  the pipeline's K, M and recompute policy, batch size, model), through
  TensorBoard's hparams plugin when the `tensorboard` package is installed
  (`pip install 'lingvo_pipe[tensorboard]'`); without it the trainer logs
  one line and writes everything else.
"""

from __future__ import annotations

import os
from typing import Any

from absl import logging
import tensorflow as tf

from lingvo_pipe.core import summaries
from lingvo_pipe.core.hyperparams import Params

# Leaves of these paths (or ending in these names) go to the HParams tab.
_HPARAM_PREFIXES = ('task.train.',)
_HPARAM_NAMES = ('model', 'batch_size', 'num_stages', 'num_micro_batches',
                 'micro_batch_size', 'recompute', 'fprop_dtype')


def _markdown_code(text: str) -> str:
  """`text` as a Markdown code block (TensorBoard renders text as Markdown)."""
  return '\n'.join('    ' + line for line in text.splitlines())


def hparams_of(params: Params) -> dict[str, bool | int | float | str]:
  """The leaves of `params` that the HParams tab shows, by dotted path."""
  out: dict[str, bool | int | float | str] = {}

  def _visit(key: str, value: Any) -> None:
    name = key.rpartition('.')[2]
    if not (key.startswith(_HPARAM_PREFIXES) or name in _HPARAM_NAMES):
      return
    if isinstance(value, (bool, int, float, str)):
      out[key] = value
    elif value is not None:
      out[key] = str(value.name if isinstance(value, tf.DType) else value)

  params.Visit(_visit)
  return out


def write_params_and_partition(writer: tf.summary.SummaryWriter, step: int,
                               params: Params, task: Any) -> None:
  """Text summaries `params` and (if the task has one) `pipeline/partition`."""
  texts = {'params': _markdown_code(params.ToText())}
  inspect = getattr(task, 'Inspect', None)
  report = inspect() if inspect is not None else ''
  if report:
    texts['pipeline/partition'] = _markdown_code(report)
  summaries.text(writer, step, texts)


def write_hparams(logdir: str, params: Params) -> bool:
  """Writes the HParams session of this run into `logdir` itself, so that
  its `train/` and `eval_*/` scalars are the session's metrics. Returns
  False (and logs why) when TensorBoard's hparams plugin is not installed.
  """
  try:
    from tensorboard.plugins.hparams import api as hp  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.info('No HParams summary: TensorBoard is not installed; pip '
                 "install 'lingvo_pipe[tensorboard]' to get it.")
    return False
  writer = tf.summary.create_file_writer(logdir)
  with writer.as_default():
    hp.hparams(hparams_of(params),
               trial_id=os.path.basename(os.path.abspath(logdir)))
  writer.close()
  return True


def write_run_description(logdir: str, writer: tf.summary.SummaryWriter,
                          step: int, params: Params, task: Any) -> None:
  """Everything above, at `step` (the step the run starts from)."""
  write_params_and_partition(writer, step, params, task)
  write_hparams(logdir, params)
