"""TensorBoard scalars without a TensorBoard install.

`tf.summary.scalar` lives in the `tensorboard` package, which tensorflow-cpu
does not pull in. The event files only need TensorFlow's own
`tf.summary.write` with the scalar plugin's metadata, which is all this
module adds; TensorBoard, installed anywhere, reads the result as ordinary
scalars.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.core.util import event_pb2

_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='scalars'),
    data_class=summary_pb2.DATA_CLASS_SCALAR).SerializeToString()


def scalars(writer: tf.summary.SummaryWriter, step: int,
            values: dict[str, float | tf.Tensor]) -> None:
  """Writes each value as a float32 scalar summary at `step`, then flushes."""
  with writer.as_default(step=step):
    for name, value in values.items():
      tf.summary.write(name, tf.cast(value, tf.float32),
                       metadata=_SCALAR_METADATA)
  writer.flush()


def read_scalars(event_dir: str) -> dict[str, list[tuple[int, float]]]:
  """(step, value) lists by tag from the event files in `event_dir`."""
  out: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(tf.io.gfile.glob(f'{event_dir}/events.out.tfevents.*')):
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for value in event.summary.value:
        number = float(tf.make_ndarray(value.tensor))
        out.setdefault(value.tag, []).append((int(event.step), number))
  return out
