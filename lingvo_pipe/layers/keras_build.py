"""The Keras side of `KerasLayer`: build a Keras layer from Params, check it.

`KerasLayer` (keras_layer.py) runs a Keras layer as a pure function of
theta. What that needs from Keras lives here, in four parts:

* **Building without weights.** The Keras layer is deserialized from
  `p.keras_layer` and built from `p.build_config` inside a
  `keras.StatelessScope(initialize_variables=False)`: Keras then creates
  its variables *uninitialized* (each holds its initializer, no value).
  They are the keys FProp maps to theta's values, so the Keras layer takes
  no memory of its own and nothing of it is checkpointed. Keras draws each
  unseeded initializer's seed from Python's `random` when it is made, so
  that happens under a `random` state seeded by (random_seed, layer path)
  and restored after: the initial weights, like `CreateVariable`'s, are a
  pure function of the path (every process and replica agrees).
* **State, checked before the first step** (`probe`): the layer is traced
  once in training mode, symbolically. A BatchNormalization that updates
  its moving averages becomes 'batch_norm' (statistics summed over
  micro-batches, folded once per step); Keras's random layers become
  'noise' (lingvo_pipe's per-example draws: keras_layer._noise). A layer
  that updates any other state, adds losses (regularizers), carries weight
  constraints or emits a Keras mask is refused with one line naming it,
  because the pipeline would train it differently from Keras.
* **The dtype policy** is derived from (dtype, fprop_dtype): fprop_dtype
  bfloat16 over float32 weights is Keras's `mixed_bfloat16` (`policy_name`).
* **Costs** (`flops`): 2 flops per multiply-add of every weight of rank ≥ 2
  at every output position (exact for Dense, Conv1D/2D/3D, depthwise and
  separable convs in channels-last layouts), attention's scores and
  weighted sums for MultiHeadAttention, and 1 flop per output element;
  embeddings count only the latter. Recurrent layers count one time step
  and transposed convolutions stride² times too much: where the rule
  misjudges, profile (PipeliningLayer's `costs='profile'`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
import threading
from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.nested_map import NestedMap

LayerError = base_layer.LayerError
NOISE_CLASSES = ('Dropout', 'SpatialDropout1D', 'SpatialDropout2D',
                 'SpatialDropout3D', 'GaussianNoise', 'GaussianDropout',
                 'AlphaDropout')
_RANDOM_LOCK = threading.RLock()


def policy_name(dtype: tf.DType, fprop_dtype: tf.DType | None) -> str:
  """The Keras dtype policy of weights in `dtype` computing in
  `fprop_dtype` (None: dtype): Keras's mixed policies where they fit
  (float32 weights computing in bfloat16 or float16), else the compute
  dtype's, whose variables KerasLayer feeds theta cast to it (as every
  lingvo_pipe layer casts theta to fprop_dtype: the float64 twin of
  `transparency.check_transparency`)."""
  compute = tf.as_dtype(fprop_dtype or dtype)
  if tf.as_dtype(dtype) == tf.float32 and compute in (tf.bfloat16,
                                                      tf.float16):
    return f'mixed_{compute.name}'
  return compute.name


def policy_dtypes(layer: Any, where: str) -> tuple[tf.DType, Any]:
  """(dtype, fprop_dtype or None) of a Keras layer's dtype policy."""
  policy = layer.dtype_policy
  if policy.quantization_mode is not None:
    raise LayerError(
        f'{where}: dtype policy {policy.name!r} quantizes the layer '
        f'({policy.quantization_mode}), which lingvo_pipe does not run; '
        'convert the float model.')
  dtype = tf.as_dtype(policy.variable_dtype)
  compute = tf.as_dtype(policy.compute_dtype)
  return dtype, (None if compute == dtype else compute)


@contextlib.contextmanager
def seeded_python_random(*parts: Any) -> Iterator[None]:
  """Python's `random` seeded by `parts` inside, restored after."""
  digest = hashlib.md5('/'.join(map(str, parts)).encode()).digest()
  with _RANDOM_LOCK:
    state = random.getstate()
    random.seed(int.from_bytes(digest[:8], 'little'))
    try:
      yield
    finally:
      random.setstate(state)


def build(keras_config: dict[str, Any], build_config: dict[str, Any] | None,
          policy: str, seed_parts: tuple[Any, ...], where: str) -> Any:
  """A built Keras layer whose variables hold no values (module docstring).

  Raises:
    LayerError: Keras cannot rebuild the layer (an unregistered class, a
      config it refuses, a build_config that does not fit).
  """
  if not isinstance(keras_config, dict) or 'class_name' not in keras_config:
    raise LayerError(
        f'{where}: keras_layer must be a serialized Keras layer (a dict with '
        f'class_name and config), got {keras_config!r:.80}; make the Params '
        'with lingvo_pipe.keras.from_keras(model) or layer_params(layer).')
  config = dict(keras_config)
  inner = dict(config.get('config') or {})
  given = inner.get('dtype')
  if isinstance(given, dict):
    given = (given.get('config') or {}).get('name')
  if given is not None and given != policy:
    raise LayerError(
        f'{where}: keras_layer\'s config says dtype {given!r} but dtype and '
        f'fprop_dtype say {policy!r}; remove \'dtype\' from the config and '
        'set fprop_dtype (bfloat16 over float32 weights = mixed_bfloat16).')
  inner['dtype'] = policy
  config['config'] = inner
  name = config['class_name']
  try:
    with seeded_python_random(*seed_parts), keras.StatelessScope(
        initialize_variables=False):
      layer = keras.saving.deserialize_keras_object(config)
      if build_config:
        layer.build_from_config(build_config)
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    raise LayerError(
        f'{where}: Keras cannot rebuild keras_layer {name!r}: '
        f'{_first_line(e)}; a layer class of your own must be registered '
        '(@keras.saving.register_keras_serializable) and imported before '
        'the Params are read.') from None
  _forget_uninitialized(layer)
  if not layer.built:
    raise LayerError(f'{where}: Keras layer {name!r} is not built; set '
                     "build_config, e.g. {'input_shape': (None, 16)}.")
  return layer


def _forget_uninitialized(layer: Any) -> None:
  """Keeps Keras from giving `layer`'s variables values later: Keras
  initializes every variable made in a stateless scope when the next
  stateless scope closes outside any other."""
  # pylint: disable-next=g-import-not-at-top
  from keras.src.backend.common import global_state
  mine = {id(v) for v in layer.variables}
  pending = global_state.get_global_attribute('uninitialized_variables')
  if pending:
    global_state.set_global_attribute(
        'uninitialized_variables', [v for v in pending if id(v) not in mine])


def _first_line(e: BaseException) -> str:
  text = str(e).strip().split('\n')[0]
  return text if len(text) <= 300 else text[:297] + '...'


def initial_value(variable: Any, dtype: Any = None) -> np.ndarray:
  """A Keras variable's initial value (from its initializer if it has
  none), drawn in `dtype` (default: the variable's)."""
  dtype = tf.as_dtype(dtype or variable.dtype)
  if getattr(variable, '_value', None) is None:
    # pylint: disable-next=protected-access
    return np.asarray(variable._initializer(variable.shape, dtype=dtype.name))
  return np.asarray(tf.cast(variable.value, dtype))


def weight_keys(layer: Any) -> list[str]:
  """theta keys of `layer.weights`: each weight's path below the layer
  ('kernel', 'query_kernel' for MultiHeadAttention's query/kernel), as an
  identifier, unique (several weights may share a short name)."""
  keys: list[str] = []
  prefix = f'{layer.name}/'
  for w in layer.weights:
    path = w.path
    rel = path[path.index(prefix) + len(prefix):] if prefix in path else (
        w.name)
    key = re.sub(r'\W', '_', rel)
    if not key.isidentifier() or hasattr(NestedMap, key):
      key = f'w_{key}'
    base, i = key, 1
    while key in keys:
      key, i = f'{base}_{i}', i + 1
    keys.append(key)
  return keys


def call_args(build_config: dict[str, Any] | None,
              inputs: tuple[Any, ...]) -> tuple[Any, ...]:
  """The positional arguments of the Keras call for the pipeline's inputs.

  A layer built from {'input_shape': [s1, s2]} (Concatenate, Add) takes
  its inputs as one list; otherwise each input is one argument.
  """
  if (build_config and 'input_shape' in build_config and len(inputs) > 1):
    return (list(inputs),)
  return inputs


def input_shapes(build_config: dict[str, Any] | None) -> list[Any] | None:
  """The shapes of the call's positional arguments in `build_config`."""
  if not build_config:
    return None
  if 'input_shape' in build_config:
    return [build_config['input_shape']]
  shapes = build_config.get('shapes_dict') or {}
  return list(shapes.values())


def probe(layer: Any, build_config: dict[str, Any] | None) -> tuple[str, str]:
  """(kind, why): how FProp must treat `layer`'s state in training
  (`layer` built from `build_config`).

  kind is 'plain', 'batch_norm' or 'noise', or 'refused' with `why` the
  reason (one line).
  """
  name = type(layer).__name__
  if name in NOISE_CLASSES and type(layer) is getattr(keras.layers, name):
    return 'noise', ''
  for w in layer.weights:
    if w.regularizer is not None or w.constraint is not None:
      what = 'regularizer' if w.regularizer is not None else 'constraint'
      return 'refused', (
          f'its weight {w.name!r} has a {what}, which Keras applies in fit '
          'and the pipeline would not; remove it (lingvo_pipe has '
          'task.train.weight_decay)')
  updated, losses, masked = _trace_training_call(layer, build_config)
  weights = {id(w) for w in layer.weights}
  if updated and all(id(v) not in weights for v in updated):
    return 'refused', ('it draws random numbers from a Keras SeedGenerator '
                       f'({updated[0].path}); the recompute would draw '
                       'others than the forward. Use a Keras Dropout or '
                       'GaussianNoise layer, which lingvo_pipe maps onto '
                       'its per-example draws, or set its rate to 0')
  if updated:
    return _classify_updates(layer, updated)
  if losses:
    return 'refused', ('it adds a loss in training (activity_regularizer or '
                       'add_loss), which the pipeline would not train; '
                       'remove it')
  if masked:
    return 'refused', ('it emits a Keras mask (mask_zero=True or Masking), '
                       'which lingvo_pipe does not pass between layers; '
                       'drop the mask and give padded positions weight 0 in '
                       'the loss')
  return 'plain', ''


def _classify_updates(layer: Any, updated: list[Any]) -> tuple[str, str]:
  names = [v.path for v in updated]
  is_bn = type(layer) is keras.layers.BatchNormalization
  if is_bn and getattr(layer, 'renorm', False):
    return 'refused', ('BatchNormalization(renorm=True) normalises training '
                       'batches with its moving statistics, which the '
                       'pipeline updates once per step; use renorm=False')
  if is_bn and {id(v) for v in updated} == {id(layer.moving_mean),
                                            id(layer.moving_variance)}:
    return 'batch_norm', ''
  return 'refused', (f'it updates its non-trainable state ({", ".join(names)})'
                     ' in training, which lingvo_pipe cannot fold once per '
                     'step; freeze the layer (trainable=False) or write it '
                     'as a lingvo_pipe layer with AddStats/FoldStats')


def _trace_training_call(layer: Any, build_config: dict[str, Any] | None
                        ) -> tuple[list[Any], list[Any], bool]:
  """(updated variables, losses, emits a mask) of one training call,
  traced (never run) on inputs of the build shapes."""
  shapes = input_shapes(build_config) or [[None]]
  dtype = tf.as_dtype(layer.input_dtype or 'float32')
  specs = [_spec(s, dtype) for s in shapes]
  found: dict[str, Any] = {}

  def _call(*xs: tf.Tensor) -> Any:
    values = [tf.zeros(v.shape, v.dtype) for v in layer.variables]
    with keras.StatelessScope(state_mapping=list(zip(layer.variables, values)),
                              collect_losses=True,
                              initialize_variables=False) as scope:
      out = layer(*call_args(build_config, xs), training=True)
    found['updated'] = [v for v, old in zip(layer.variables, values)
                        if scope.get_current_value(v) is not old]
    found['losses'] = list(scope.losses)
    found['masked'] = any(getattr(t, '_keras_mask', None) is not None
                          for t in tf.nest.flatten(out))
    return out

  tf.function(_call, autograph=False).get_concrete_function(*specs)
  return found['updated'], found['losses'], found['masked']


def is_shape_list(shape: Any) -> bool:
  """Whether `shape` is a list of shapes (one list argument's)."""
  return isinstance(shape, (list, tuple)) and bool(shape) and all(
      isinstance(s, (list, tuple)) for s in shape)


def _spec(shape: Any, dtype: tf.DType) -> Any:
  """A TensorSpec (or a list of them, for a list of shapes)."""
  if is_shape_list(shape):
    return [tf.TensorSpec([None] + list(s)[1:], dtype) for s in shape]
  return tf.TensorSpec([None] + list(shape)[1:], dtype)


def flops(layer: Any, out_shape: tf.TensorShape,
          in_shapes: list[tf.TensorShape]) -> int:
  """FPropMeta's flops of `layer` (the rule of the module docstring)."""
  out_elements = max(int(np.prod([d or 1 for d in out_shape.as_list()])), 1)
  if type(layer).__name__ == 'Embedding' or out_shape.rank == 0:
    return out_elements
  channels = out_shape[-1] or 1
  positions = out_elements // channels
  kernels = sum(int(np.prod(w.shape)) for w in layer.weights
                if len(w.shape) >= 2)
  macs = positions * kernels
  if type(layer).__name__ == 'MultiHeadAttention' and len(in_shapes) >= 2:
    q, v = in_shapes[0].as_list(), in_shapes[1].as_list()
    heads, key_dim = layer.num_heads, layer.key_dim
    value_dim = layer.value_dim or key_dim
    length_q = int(np.prod([d or 1 for d in q[1:-1]]))
    length_v = int(np.prod([d or 1 for d in v[1:-1]]))
    # Scores (q·k) and the weighted sum of values, per head.
    macs += (q[0] or 1) * heads * length_q * length_v * (key_dim + value_dim)
  return 2 * macs + out_elements
