"""Token embeddings and sinusoidal position encodings.

A sequence model starts by turning int ids [B, T] into vectors [B, T, D]
(`EmbeddingLayer`) and adding where each token sits (`PositionalEmbeddingLayer`,
no variables). The Transformer multiplies the looked-up vectors by sqrt(D)
(`scale_sqrt_depth`) so that they are on the scale of the position encodings
(values in [-1, 1]); with that, initialise the table with stddev D^-1/2
(`WeightInit.Gaussian(embedding_dim ** -0.5)`), as Lingvo's configs do.

Out-of-range ids: `tf.gather` raises on CPU but silently returns zeros on GPU,
so a bad vocabulary would train on one device and crash on another. FProp
therefore checks `0 <= id < vocab_size` with `tf.debugging` assertions (eager
and `tf.function` alike) and fails with a message naming the layer path and
the vocabulary size. `check_ids=False` removes the check (XLA/TPU, where the
assertions are not supported).

Position offsets: during incremental decoding the one new token sits at
position t, so `FProp(theta, x, position_offset=t)` (t a Python int or a
scalar int tensor) encodes positions t, t+1, ..., t+T-1.

Cost convention (FPropMeta): 1 flop per output element (the copy of a gather,
the sqrt(D) scale, the add of a position), so the cost scales with B·T·D. The
[T, D] sine table is per position, not per example, and is not counted.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap

LayerError = base_layer.LayerError


def _check_positive(where: str, name: str, value: Any, fix: str) -> None:
  if not isinstance(value, int) or value <= 0:
    raise LayerError(f'{where}: {name} must be an int > 0, got {value!r}; '
                     f'{fix}')


class EmbeddingLayer(base_layer.BaseLayer):
  """Looks up int ids [B, T] in a [vocab_size, embedding_dim] table.

  >>> p = EmbeddingLayer.Params().Set(name='emb', vocab_size=8,
  ...                                 embedding_dim=4)
  >>> layer = p.Instantiate()
  >>> layer.FProp(layer.theta, tf.constant([[1, 2, 3]])).shape
  TensorShape([1, 3, 4])
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of ids (rows of the table); ids must '
             'be in [0, vocab_size).')
    p.Define('embedding_dim', 0, 'Depth D of each embedding vector.')
    p.Define('scale_sqrt_depth', False, 'Multiply looked-up vectors by '
             'sqrt(embedding_dim), as the Transformer does; pair with '
             'params_init = WeightInit.Gaussian(embedding_dim ** -0.5).')
    p.Define('check_ids', True, 'Fail with a clear error on ids outside '
             '[0, vocab_size); turn off where tf.debugging asserts are not '
             'supported (XLA/TPU).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_params(self.path, self.params)
    p = self.params
    self.CreateVariable(
        'emb', base_layer.WeightParams([p.vocab_size, p.embedding_dim]))

  def FProp(self, theta: NestedMap, ids: tf.Tensor) -> tf.Tensor:
    """Embeds `ids`.

    Args:
      theta: NestedMap with `emb` [vocab_size, embedding_dim].
      ids: int tensor of any shape, typically [B, T].

    Returns:
      [..., embedding_dim] embeddings in fprop_dtype.

    Raises:
      LayerError: if `ids` is not an integer tensor.
      tf.errors.InvalidArgumentError: if an id is outside [0, vocab_size)
        (with check_ids).
    """
    p = self.params
    ids = tf.convert_to_tensor(ids)
    if not ids.dtype.is_integer:
      raise LayerError(f'{self.path}: ids must be an int tensor, got '
                       f'{ids.dtype.name}; pass token ids, not embeddings.')
    if p.check_ids:
      msg = (f'{self.path}: ids must be in [0, vocab_size={p.vocab_size}); '
             'fix the input pipeline or raise p.vocab_size.')
      ids = _checked_ids(ids, p.vocab_size, msg)
    emb = tf.cast(theta.emb, self.fprop_dtype)
    out = tf.gather(emb, ids)
    if p.scale_sqrt_depth:
      out *= tf.cast(math.sqrt(p.embedding_dim), self.fprop_dtype)
    return out

  @classmethod
  def FPropMeta(cls, p: Params, ids: tf.TensorShape) -> base_layer.LayerMeta:
    _check_params(p.name, p)
    ids = tf.TensorShape(ids)
    out = ids.concatenate([p.embedding_dim])
    return base_layer.LayerMeta.build(
        p, flops=out.num_elements() or 0, out_shapes=(out,),
        num_params=p.vocab_size * p.embedding_dim)


def _check_params(where: str, p: Params) -> None:
  _check_positive(where, 'vocab_size', p.vocab_size,
                  'set p.vocab_size to the number of distinct ids.')
  _check_positive(where, 'embedding_dim', p.embedding_dim,
                  'set p.embedding_dim to the model depth, e.g. 512.')


def _checked_ids(ids: tf.Tensor, vocab_size: int, msg: str) -> tf.Tensor:
  checks = [
      tf.debugging.assert_non_negative(ids, message=msg),
      tf.debugging.assert_less(ids, tf.cast(vocab_size, ids.dtype),
                               message=msg),
  ]
  with tf.control_dependencies(checks):
    return tf.identity(ids)


def sinusoidal_positions(length: Any, depth: int, position_offset: Any = 0,
                         min_timescale: float = 1.0,
                         max_timescale: float = 1.0e4,
                         dtype: tf.DType = tf.float32) -> tf.Tensor:
  """The Transformer's sine/cosine encodings of positions offset..offset+T-1.

  Channel i < D/2 of position s is sin(s / max_ts^(i/(D/2-1))) (min_ts = 1);
  channel D/2 + i is the cosine of the same angle.

  Args:
    length: T, a Python int or scalar int tensor.
    depth: D, even.
    position_offset: position of the first row (Python int or scalar tensor).
    min_timescale: shortest wavelength / 2π.
    max_timescale: longest wavelength / 2π.
    dtype: dtype of the result (computed in float32).

  Returns:
    [T, D] encodings.

  Raises:
    LayerError: if depth is odd or not positive.
  """
  if not isinstance(depth, int) or depth <= 0 or depth % 2:
    raise LayerError(f'Sinusoidal positions need an even depth > 0, got '
                     f'{depth!r}; use an even embedding_dim.')
  half = depth // 2
  positions = tf.cast(tf.range(length), tf.float32) + tf.cast(
      position_offset, tf.float32)  # [T]
  log_increment = math.log(max_timescale / min_timescale) / max(half - 1, 1)
  inv_timescales = min_timescale * tf.exp(
      tf.range(half, dtype=tf.float32) * -log_increment)  # [D/2]
  angles = positions[:, None] * inv_timescales[None, :]  # [T, D/2]
  return tf.cast(tf.concat([tf.sin(angles), tf.cos(angles)], axis=1), dtype)


class PositionalEmbeddingLayer(base_layer.BaseLayer):
  """Adds sinusoidal position encodings to [B, T, D]; no variables.

  >>> layer = PositionalEmbeddingLayer.Params().Set(
  ...     name='pos', embedding_dim=4).Instantiate()
  >>> y = layer.FProp(layer.theta, tf.zeros([2, 3, 4]))  # y[b] = positions
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('embedding_dim', 0, 'Depth D of the inputs; must be even.')
    p.Define('min_timescale', 1.0, 'Shortest wavelength / 2π, in positions.')
    p.Define('max_timescale', 1.0e4, 'Longest wavelength / 2π, in positions; '
             'keep it well above the longest sequence.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_depth(self.path, self.params)

  def FProp(self, theta: NestedMap, x: tf.Tensor,
            position_offset: Any = 0) -> tf.Tensor:
    """Returns x + positions.

    Args:
      theta: empty NestedMap.
      x: [B, T, D] inputs.
      position_offset: position of x[:, 0] (int or scalar int tensor); the
        decode step t in incremental decoding.

    Returns:
      [B, T, D] in fprop_dtype.
    """
    del theta  # No variables.
    p = self.params
    x = tf.cast(x, self.fprop_dtype)
    if x.shape.rank != 3 or x.shape[-1] not in (None, p.embedding_dim):
      raise LayerError(f'{self.path}: expected x of shape [B, T, '
                       f'{p.embedding_dim}], got {x.shape}; set '
                       'p.embedding_dim to the input depth.')
    pos = sinusoidal_positions(tf.shape(x)[1], p.embedding_dim,
                               position_offset, p.min_timescale,
                               p.max_timescale, self.fprop_dtype)
    return x + pos[None]

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_depth(p.name, p)
    x = tf.TensorShape(x)
    return base_layer.LayerMeta.build(
        p, flops=x.num_elements() or 0, out_shapes=(x,), num_params=0)


def _check_depth(where: str, p: Params) -> None:
  if (not isinstance(p.embedding_dim, int) or p.embedding_dim <= 0 or
      p.embedding_dim % 2):
    raise LayerError(f'{where}: embedding_dim must be an even int > 0, got '
                     f'{p.embedding_dim!r}; sine and cosine channels come in '
                     'pairs, so use an even depth.')
  if not 0 < p.min_timescale < p.max_timescale:
    raise LayerError(f'{where}: need 0 < min_timescale < max_timescale, got '
                     f'{p.min_timescale} and {p.max_timescale}; the defaults '
                     '1.0 and 1e4 are the Transformer\'s.')
