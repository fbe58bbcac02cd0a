"""TensorBoard scalars and text without a TensorBoard install.

`tf.summary.scalar` and `tf.summary.text` live in the `tensorboard` package,
which TensorFlow does not pull in (it is lingvo_pipe's `[tensorboard]`
extra). The event files only need TensorFlow's own `tf.summary.write` with
the plugin's metadata, which is all this module adds; TensorBoard, installed
anywhere, reads the result as ordinary scalars and text.
"""

from __future__ import annotations

from typing import Any, Iterator

import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.core.util import event_pb2

_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='scalars'),
    data_class=summary_pb2.DATA_CLASS_SCALAR).SerializeToString()
_TEXT_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='text'),
    data_class=summary_pb2.DATA_CLASS_TENSOR).SerializeToString()


def scalars(writer: tf.summary.SummaryWriter, step: int,
            values: dict[str, float | tf.Tensor]) -> None:
  """Writes each value as a float32 scalar summary at `step`, then flushes."""
  with writer.as_default(step=step):
    for name, value in values.items():
      tf.summary.write(name, tf.cast(value, tf.float32),
                       metadata=_SCALAR_METADATA)
  writer.flush()


def text(writer: tf.summary.SummaryWriter, step: int,
         texts: dict[str, str]) -> None:
  """Writes each text (Markdown, as TensorBoard's text tab renders it) at
  `step`, then flushes."""
  with writer.as_default(step=step):
    for name, value in texts.items():
      tf.summary.write(name, tf.constant(value), metadata=_TEXT_METADATA)
  writer.flush()


def read_texts(event_dir: str) -> dict[str, list[tuple[int, str]]]:
  """(step, text) lists by tag of the text summaries in `event_dir`."""
  out: dict[str, list[tuple[int, str]]] = {}
  for step, value in _values(event_dir, 'text'):
    text_value = tf.make_ndarray(value.tensor).item().decode('utf-8')
    out.setdefault(value.tag, []).append((step, text_value))
  return out


def read_scalars(event_dir: str) -> dict[str, list[tuple[int, float]]]:
  """(step, value) lists by tag of the scalar summaries in `event_dir`."""
  out: dict[str, list[tuple[int, float]]] = {}
  for step, value in _values(event_dir, 'scalars'):
    number = float(tf.make_ndarray(value.tensor))
    out.setdefault(value.tag, []).append((step, number))
  return out


def _values(event_dir: str, plugin: str) -> Iterator[tuple[int, Any]]:
  """(step, summary value) of `plugin`'s tags, in file order. A writer may
  put the plugin metadata only on a tag's first value, so it is remembered."""
  plugins: dict[str, str] = {}
  for path in sorted(tf.io.gfile.glob(f'{event_dir}/events.out.tfevents.*')):
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name:
          plugins[value.tag] = value.metadata.plugin_data.plugin_name
        if plugins.get(value.tag) == plugin:
          yield int(event.step), value
