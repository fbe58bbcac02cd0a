"""Does a checkpoint fit the model it is about to be restored into?

A checkpoint whose variables have other shapes than the model's is almost
never a damaged file: it was written by another model (the evaler pointed
at another run's logdir) or with other params (a layer size, the number of
layers or the optimizer changed since). TensorFlow says so with a
ValueError from deep inside the restore, or an AssertionError listing
Python objects, and then logs a page of "value in checkpoint could not be
found" warnings when the half-restored checkpoint object is collected. So
`misfit` compares the two before anything is restored, matching objects as
the restore does (`tf.train.CheckpointView.match`), and names the first
variable that differs, with both shapes; `checkpoints.restore` turns that
into one line with the likely cause and the fix.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
# The object graph every TF2 checkpoint holds; TF exports no name for it.
from tensorflow.core.protobuf import trackable_object_graph_pb2

_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'
_VALUE = 'VARIABLE_VALUE'


def misfit(root: Any, prefixes: Sequence[str]) -> str:
  """What about the checkpoint in `prefixes` does not fit `root` ('' if it
  fits): a variable of another shape or dtype, or one of the model's
  variables that it does not hold.

  Args:
    root: What is restored into (a `tf.train.Checkpoint`).
    prefixes: The checkpoint's files: one prefix, or one per stage shard
      (each holding part of the model under the same object paths).

  Raises:
    tf.errors.OpError: a file cannot be read (damaged or deleted meanwhile);
      the caller says which.
  """
  matched, differ = set(), []
  for prefix in prefixes:
    reader = tf.train.load_checkpoint(prefix)
    if not reader.has_tensor(_GRAPH_KEY):
      return ('it is not a TensorFlow 2 object-based checkpoint (it has no '
              'object graph: written by TF1\'s Saver or another program)')
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_GRAPH_KEY))
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    for node_id, obj in tf.train.CheckpointView(prefix).match(root).items():
      matched.add(id(obj))
      key = next((a.checkpoint_key for a in graph.nodes[node_id].attributes
                  if a.name == _VALUE), None)
      if not isinstance(obj, tf.Variable) or key not in shapes:
        continue
      saved = tf.TensorShape(shapes[key])
      if saved != obj.shape:
        differ.append((obj, f'has shape {_shape(saved)} in the checkpoint '
                       f'but {_shape(obj.shape)} in the model'))
      elif dtypes[key] != obj.dtype:
        differ.append((obj, f'is {dtypes[key].name} in the checkpoint but '
                       f'{obj.dtype.name} in the model'))
  if differ:
    obj, how = min(differ, key=lambda d: _rank(d[0]))
    return f'{_name(obj)} {how}{_more(differ, "and {} more differ")}'
  missing = [v for v in tf.train.TrackableView(root).descendants()
             if isinstance(v, tf.Variable) and id(v) not in matched]
  if missing:
    first = min(missing, key=_rank)
    return (f'the model\'s {_name(first)} is not in it'
            f'{_more(missing, "nor are {} more of its variables")}')
  return ''


def _rank(v: tf.Variable) -> tuple[bool, int, str]:
  """Layer weights first (`fc0/w`), then their optimizer slots (`fc0/w/m`),
  then the rest (`global_step`)."""
  depth = _name(v).count('/')
  return depth == 0, depth, _name(v)


def _more(found: list, template: str) -> str:
  return f' ({template.format(len(found) - 1)})' if len(found) > 1 else ''


def _name(v: tf.Variable) -> str:
  return v.name[:-2] if v.name.endswith(':0') else v.name


def _shape(shape: tf.TensorShape) -> str:
  return str(shape.as_list()) if shape.rank is not None else '(unknown)'
