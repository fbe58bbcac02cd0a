"""KerasLayer: a Keras 3 layer as a lingvo_pipe layer, so a pipeline can run it.

A Keras layer keeps its weights inside; a lingvo_pipe layer computes from
theta alone, so that the pipeline can run it once per micro-batch and again
in the recompute. Keras 3 bridges the two: inside a `keras.StatelessScope`
a built layer reads each of its variables from a mapping it is given, which
is what `layer.stateless_call` does. FProp maps the Keras layer's weights to
theta and calls the layer through `__call__` in that scope, not through
`stateless_call`: `stateless_call` skips what `__call__` does first (cast
the inputs to the policy's compute dtype, autocast the weights, pass the
training flag to nested layers), so under `mixed_bfloat16` it computed in
float32.

    Params   keras_layer (the serialized layer), build_config (its input
             shapes), keras_weights (None, or weights from_keras registered)
    theta    the Keras layer's weights, created by lingvo_pipe (its
             checkpoint keys: 'kernel', 'query_kernel', ...); the Keras
             layer's own variables hold no values (keras_build.py)
    FProp    layer(*inputs, training) with theta as its weights
    state    BatchNormalization: each micro-batch normalised by its own
             moments (Keras's code); its moving averages see the whole batch,
             summed over micro-batches (AddStats) and folded once per step
             (FoldStats), as BatchNormLayer does. Dropout, SpatialDropout*,
             GaussianNoise, GaussianDropout, AlphaDropout: lingvo_pipe's
             per-example draws (dropout.example_noise), so the recompute
             draws what the forward drew, whatever K and M. Any other layer
             that updates state in training is refused when it is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import keras_build
from lingvo_pipe.layers import normalization

LayerError = base_layer.LayerError
# SELU's constants (Klambauer et al., 2017), as Keras's AlphaDropout uses.
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_WEIGHTS: dict[str, list[np.ndarray]] = {}
_WEIGHTS_LOCK = threading.Lock()


def register_weights(values: Sequence[Any]) -> str:
  """Keeps `values` (a Keras layer's weights, in `layer.weights` order) in
  this process; returns the name Params give them: 'sha256:' and their
  content's hash, so every process that registers the same weights gives
  them the same name (a trainer resumes with the same params.txt). The
  copy stays for the life of the process (host memory, once per model)."""
  arrays = [np.array(v, copy=True) for v in values]
  digest = hashlib.sha256()
  for a in arrays:
    digest.update(f'{a.dtype.str}{a.shape}'.encode())
    digest.update(np.ascontiguousarray(a).tobytes())
  handle = f'sha256:{digest.hexdigest()[:24]}'
  with _WEIGHTS_LOCK:
    _WEIGHTS[handle] = arrays
  return handle


def _registered(handle: str, where: str) -> list[np.ndarray]:
  with _WEIGHTS_LOCK:
    if handle in _WEIGHTS:
      return _WEIGHTS[handle]
  raise LayerError(
      f'{where}: keras_weights={handle!r} names weights that from_keras did '
      'not register in this process; call lingvo_pipe.keras.from_keras(model) '
      'here (a config calls it in Task()), or set keras_weights=None to start '
      'from fresh weights (a checkpoint then restores trained ones).')


class _Hidden:
  """Holds the Keras layer where neither tf.Module (trainable_variables) nor
  checkpoints look: its variables are keys, theta holds the values.
  `constants` maps its other variables (seed generators' states, which its
  layers never advance: keras_build.probe) to their values."""

  def __init__(self, layer: Any, constants: list[tuple[Any, Any]]) -> None:
    self.layer = layer
    self.constants = constants


_PROTOTYPES: dict[str, tuple[Any, str, str]] = {}
_PROTOTYPES_LOCK = threading.Lock()


def prototype(p: Params, where: str) -> tuple[Any, str]:
  """(a built Keras layer of `p`'s config, its kind), made once per config
  (FPropMeta's, and the probe's verdict); raises if the layer is refused."""
  policy = keras_build.policy_name(p.dtype, p.fprop_dtype)
  key = repr((p.keras_layer, p.build_config, policy))
  with _PROTOTYPES_LOCK:
    if key not in _PROTOTYPES:
      layer = keras_build.build(p.keras_layer, p.build_config, policy,
                                ('prototype',), where)
      _PROTOTYPES[key] = (layer,) + keras_build.probe(layer, p.build_config)
    layer, kind, why = _PROTOTYPES[key]
  if kind == 'refused':
    raise LayerError(f'{where}: Keras layer {type(layer).__name__} '
                     f'{layer.name!r} cannot be pipelined faithfully: {why}.')
  return layer, kind


class KerasLayer(base_layer.BaseLayer):
  """A Keras layer computing from theta (see the module docstring).

  >>> import keras
  >>> from lingvo_pipe import keras as lp_keras
  >>> p = lp_keras.layer_params(keras.layers.Dense(3), input_shape=(None, 4))
  >>> dense = p.Instantiate()
  >>> sorted(dense.theta.keys())
  ['bias', 'kernel']
  >>> dense.FProp(dense.theta, tf.ones([2, 4])).shape
  TensorShape([2, 3])
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Delete('params_init')  # The Keras layer's initializers say it.
    p.Define('keras_layer', None, 'The Keras layer, serialized '
             '(keras.saving.serialize_keras_object) without build_config '
             'and dtype policy: dtype and fprop_dtype give the policy '
             '(float32 weights with fprop_dtype bfloat16 = mixed_bfloat16).',
             value_type=dict)
    p.Define('build_config', None, 'Keras\'s build config: the input '
             'shape(s) the layer is built for, e.g. {\'input_shape\': '
             '(None, 28, 28, 1)}; the batch dimension may be None.',
             value_type=dict)
    p.Define('keras_weights', None, 'None: the initial weights come from '
             'the layer\'s Keras initializers, seeded by random_seed and the '
             'layer path. \'sha256:…\': the weights from_keras registered in '
             'this process under that name (a hash of their values).',
             value_type=str)
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    self._kind = prototype(p, self.path)[1]
    policy = keras_build.policy_name(p.dtype, p.fprop_dtype)
    layer = keras_build.build(p.keras_layer, p.build_config, policy,
                              (self.random_seed, self.path), self.path)
    weights = {id(w) for w in layer.weights}
    self._keras = _Hidden(layer, [
        (v, tf.constant(keras_build.initial_value(v)))
        for v in layer.variables if id(v) not in weights])
    self._keys = keras_build.weight_keys(layer)
    values = self._InitialValues(layer)  # theta's dtypes.
    trainable = {id(w) for w in layer.trainable_weights}
    for key, w, value in zip(self._keys, layer.weights, values):
      var = self.CreateVariable(key, base_layer.WeightParams(
          list(w.shape), base_layer.WeightInit.Constant(0.0),
          dtype=_theta_dtype(p, w), trainable=id(w) in trainable))
      var.assign(tf.cast(value, var.dtype))

  def _InitialValues(self, layer: Any) -> list[Any]:
    handle = self.params.keras_weights
    if handle is None:
      return [keras_build.initial_value(w, _theta_dtype(self.params, w))
              for w in layer.weights]
    values = _registered(handle, self.path)
    want = [tuple(w.shape) for w in layer.weights]
    got = [tuple(v.shape) for v in values]
    if want != got:
      raise LayerError(
          f'{self.path}: keras_weights={handle!r} holds weights of shapes '
          f'{got} but the layer has {want}; they belong to another layer.')
    return values

  @property
  def keras_layer(self) -> Any:
    """The built Keras layer (its variables hold no values: see theta)."""
    return self._keras.layer

  @property
  def weight_keys(self) -> list[str]:
    """theta's keys, in the order of the Keras layer's `weights`."""
    return list(self._keys)

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    """The Keras layer's call on `inputs` with theta as its weights."""
    layer = self._keras.layer
    ctx = fprop_context.current()
    if self._kind == 'noise':
      return _noise(layer, inputs[0], self.path, ctx.training)
    mapping = [(w, tf.cast(theta[k], w.dtype))
               for w, k in zip(layer.weights, self._keys)]
    with keras.StatelessScope(state_mapping=mapping + self._keras.constants,
                              initialize_variables=False):
      out = layer(*keras_build.call_args(self.params.build_config, inputs),
                  training=ctx.training)
    if self._kind == 'batch_norm' and ctx.training and ctx.stats is not None:
      # Discard what Keras assigned to the moving averages in the scope;
      # report this micro-batch's sums instead (off the gradient path).
      self.AddStats(tf.nest.map_structure(
          tf.stop_gradient, normalization.sufficient_stats(
              inputs[0], tf.float64, layer.axis)))
    return tuple(out) if isinstance(out, list) else out

  def FoldStats(self, stats: NestedMap) -> list[tf.Operation]:
    """Moves a BatchNormalization's moving averages once per step."""
    layer = self._keras.layer
    index = {id(w): k for w, k in zip(layer.weights, self._keys)}
    return normalization.move_averages(
        stats, self.vars[index[id(layer.moving_mean)]],
        self.vars[index[id(layer.moving_variance)]], layer.momentum)

  @classmethod
  def FPropMeta(cls, p: Params, *input_shapes: Any) -> base_layer.LayerMeta:
    where = p.name or 'keras_layer'
    layer, _ = prototype(p, where)
    shapes = [tf.TensorShape(s) for s in input_shapes]
    _check_shapes(where, p.build_config, shapes)
    args = keras_build.call_args(p.build_config, tuple(
        keras.KerasTensor(s.as_list(), dtype=layer.input_dtype)
        for s in shapes))
    spec = layer.compute_output_spec(*args)
    outs = tuple(spec) if isinstance(spec, (list, tuple)) else (spec,)
    out_shapes = tuple(tf.TensorShape(t.shape) for t in outs)
    meta = base_layer.LayerMeta.build(
        p, flops=keras_build.flops(layer, out_shapes[0], shapes),
        out_shapes=out_shapes, num_params=0,
        out_dtype=[tf.as_dtype(t.dtype) for t in outs])
    param_bytes = sum(math.prod(w.shape) * _theta_dtype(p, w).size
                      for w in layer.weights)
    return dataclasses.replace(meta, param_bytes=param_bytes)


def _theta_dtype(p: Params, weight: Any) -> tf.DType:
  """theta's dtype of a Keras weight: p.dtype for floats (the policy's
  variable dtype may be the compute dtype, see keras_build.policy_name)."""
  dtype = tf.as_dtype(weight.dtype)
  return tf.as_dtype(p.dtype) if dtype.is_floating else dtype


def _check_shapes(where: str, build_config: Any,
                  shapes: list[tf.TensorShape]) -> None:
  """The inputs fit the shapes the layer was built for (batch aside)."""
  built = keras_build.input_shapes(build_config)
  if built is None:
    return
  if len(built) == 1 and keras_build.is_shape_list(built[0]):
    built = list(built[0])  # One list argument (Concatenate, Add).

  def _fits(want: Any, got: tf.TensorShape) -> bool:
    want = tf.TensorShape([None] + list(want)[1:])
    return got.rank is not None and want.is_compatible_with(
        [None] + got.as_list()[1:])

  if len(built) != len(shapes) or not all(map(_fits, built, shapes)):
    raise LayerError(
        f'{where}: inputs of shapes {[str(s) for s in shapes]} do not fit '
        f'the shapes the Keras layer was built for ({build_config}); set '
        'build_config to the inputs\' shapes (the batch dimension aside).')


def _noise(layer: Any, x: Any, seed_key: str, training: bool) -> tf.Tensor:
  """A Keras noise layer's training call, on lingvo_pipe's per-example draws
  (the Keras layer's own seed generator is never used)."""
  x = tf.convert_to_tensor(x)
  if x.dtype.is_floating:
    x = tf.cast(x, layer.compute_dtype)
  name = type(layer).__name__
  rate = getattr(layer, 'rate', 0.0)
  if not training or (name != 'GaussianNoise' and rate <= 0) or (
      name == 'GaussianNoise' and layer.stddev <= 0):
    return x
  if name in ('GaussianNoise', 'GaussianDropout'):
    normal = dropout.example_noise(x, seed_key, tf.random.stateless_normal)
    if name == 'GaussianNoise':
      return x + tf.cast(normal * layer.stddev, x.dtype)
    return x * tf.cast(1.0 + normal * math.sqrt(rate / (1.0 - rate)),
                       x.dtype)
  shape_fn = _noise_shape_fn(layer)
  if name != 'AlphaDropout':
    return dropout.apply_dropout(x, rate, seed_key, shape_fn)
  alpha_p = -_SELU_ALPHA * _SELU_SCALE
  uniform = dropout.example_noise(x, seed_key, tf.random.stateless_uniform,
                                  shape_fn)
  kept = tf.cast(uniform >= rate, x.dtype)
  a = ((1 - rate) * (1 + rate * alpha_p**2))**-0.5
  b = -a * alpha_p * rate
  return a * (x * kept + alpha_p * (1 - kept)) + b


def _noise_shape_fn(layer: Any) -> dropout.NoiseShapeFn | None:
  """The mask shape of a Keras dropout layer, as apply_dropout takes it."""
  name = type(layer).__name__
  if name.startswith('SpatialDropout'):
    rank = int(name[-2]) + 2
    first = getattr(layer, 'data_format', 'channels_last') == 'channels_first'
    return lambda s: ([s[0], s[1]] + [1] * (rank - 2) if first else
                      [s[0]] + [1] * (rank - 2) + [s[-1]])
  noise_shape = getattr(layer, 'noise_shape', None)
  if noise_shape is None:
    return None
  return lambda s: [d if n is None else n for d, n in zip(s, noise_shape)]
