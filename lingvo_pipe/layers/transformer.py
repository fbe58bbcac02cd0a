"""Transformer encoder and decoder layers that stack in a pipeline.

A pipeline is a flat list of layers in which each layer's outputs are the
next one's positional inputs. So the encoder layer maps (x, paddings) to
(x, paddings), and the decoder layer maps (x, paddings, memory,
memory_paddings) to the same four, passing the encoder memory through to the
next decoder layer on whichever stage it lives.

Each layer is residual blocks around a sub-layer f (attention or a
feed-forward net):

    pre_layer_norm=True  (default):  x + dropout(f(LN(x)))
    pre_layer_norm=False (original): LN(x + dropout(f(x)))

Pre-LN keeps gradients well scaled in deep stacks (end the stack with a
LayerNormLayer); GPipe's 128-layer Transformers also needed scaled-down
initial feed-forward weights, which `ffn_init_scale` gives (with logit
clipping in the softmax).

Padded positions: outputs there are computed like any other position and
left as they are (not zeroed); they are finite, even for fully padded rows
(see attention.py), and the loss weights ignore them.

Incremental decoding: `TransformerDecoderLayer.InitDecodeCache` projects the
memory once for cross-attention and allocates the self-attention cache;
`ExtendStep` then costs O(T_max) per token.

Cost convention (FPropMeta): the sum of the children's costs (2 flops per
multiply-add, 1 per element for norms, softmax, activations), plus 1 flop per
element for each residual add and each active dropout.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import activations
from lingvo_pipe.layers import attention
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import shape as shape_lib

LayerError = base_layer.LayerError
LayerMeta = base_layer.LayerMeta


def _check(where: str, p: Params, int_keys: tuple[str, ...],
           rate_keys: tuple[str, ...]) -> None:
  for key in int_keys:
    value = getattr(p, key)
    if not isinstance(value, int) or value <= 0:
      raise LayerError(f'{where}: {key} must be an int > 0, got {value!r}; '
                       f'set p.{key}.')
  for key in rate_keys:
    if not 0 <= getattr(p, key) < 1:
      raise LayerError(f'{where}: {key} must be in [0, 1), got '
                       f'{getattr(p, key)}; e.g. 0.1, or 0 to disable.')


def _inherit(p: Params, child: InstantiableParams) -> InstantiableParams:
  """Children compute in the parent's dtypes."""
  return child.Set(dtype=p.dtype, fprop_dtype=p.fprop_dtype)


def _sum(p: Params, metas: list[LayerMeta], extra_flops: int,
         out_shapes: tuple[Any, ...]) -> LayerMeta:
  num_params = sum(m.param_bytes for m in metas) // p.dtype.size
  return LayerMeta.build(p, flops=sum(m.flops for m in metas) + extra_flops,
                         out_shapes=out_shapes, num_params=num_params)


def _residual(layer: base_layer.BaseLayer, theta: NestedMap, x: tf.Tensor,
              fn: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
  """Pre-LN x + drop(fn(LN(x))) or post-LN LN(x + drop(fn(x))).

  `layer` has a child `ln` and params pre_layer_norm, residual_dropout_prob.
  """
  p, ln = layer.params, layer.children.ln
  x = tf.cast(x, layer.fprop_dtype)
  y = fn(ln.FProp(theta.ln, x) if p.pre_layer_norm else x)
  y = dropout.apply_dropout(y, p.residual_dropout_prob,
                            f'{layer.path}/residual')
  return x + y if p.pre_layer_norm else ln.FProp(theta.ln, x + y)


def _residual_flops(p: Params, x: tf.TensorShape) -> int:
  """The residual add and, when active, the residual dropout."""
  return shape_lib.num_elements(x) * (1 + int(p.residual_dropout_prob > 0))


def _named(where: str, children: dict[str, InstantiableParams]
          ) -> dict[str, InstantiableParams]:
  """Names children '<where>.<child>' so FPropMeta errors show the path."""
  for name, child in children.items():
    child.name = f'{where}.{name}'
  return children


class TransformerAttentionLayer(base_layer.BaseLayer):
  """Residual multi-head attention: self- (key_value=None) or cross-."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Model depth D.')
    p.Define('num_heads', 8, 'Attention heads; D must divide by it.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout on attention probabilities.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout on the sub-layer output '
             'before the residual add.')
    p.Define('causal', False, 'Self-attention to earlier positions only.')
    p.Define('pre_layer_norm', True, 'Normalise the input (True) or the sum '
             '(False); see the module docstring.')
    return p

  @classmethod
  def _Children(cls, p: Params, where: str) -> dict[str, InstantiableParams]:
    _check(where, p, ('input_dim', 'num_heads'),
           ('atten_dropout_prob', 'residual_dropout_prob'))
    return dict(
        ln=_inherit(p, normalization.LayerNormLayer.Params().Set(
            input_dim=p.input_dim)),
        atten=_inherit(p, attention.MultiHeadAttention.Params().Set(
            input_dim=p.input_dim, num_heads=p.num_heads,
            atten_dropout_prob=p.atten_dropout_prob, causal=p.causal,
            params_init=p.params_init.Copy())))

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    for name, child in self._Children(self.params, self.path).items():
      self.CreateChild(name, child)

  def FProp(self, theta: NestedMap, query: tf.Tensor,
            key_paddings: tf.Tensor | None,
            key_value: tf.Tensor | None = None) -> tf.Tensor:
    """[B, Tq, D] → [B, Tq, D].

    Args:
      theta: this layer's variables.
      query: [B, Tq, D].
      key_paddings: [B, Tk] paddings of the keys (of `query` itself for
        self-attention); None for no padding.
      key_value: [B, Tk, D] memory for cross-attention; None for
        self-attention (on the normalised query with pre_layer_norm).
    """
    atten = self.children.atten
    if key_value is None:
      fn = lambda q: atten.FProp(theta.atten, q, q, key_paddings)
    else:
      fn = lambda q: atten.FProp(theta.atten, q, key_value, key_paddings)
    return _residual(self, theta, query, fn)

  def ExtendStep(self, theta: NestedMap, query_t: tf.Tensor, cache: NestedMap,
                 t: Any) -> tuple[tf.Tensor, NestedMap]:
    """Self-attention at position t (see MultiHeadAttention.ExtendStep)."""
    out: list[NestedMap] = []

    def fn(q: tf.Tensor) -> tf.Tensor:
      y, new_cache = self.children.atten.ExtendStep(theta.atten, q, cache, t)
      out.append(new_cache)
      return y

    y = _residual(self, theta, query_t, fn)
    return y, out[0]

  def AttendTo(self, theta: NestedMap, query: tf.Tensor, kv: NestedMap,
               key_paddings: tf.Tensor | None) -> tf.Tensor:
    """Cross-attention over memory projected by `atten.ProjectKeyValue`."""
    return _residual(self, theta, query, lambda q: self.children.atten.AttendTo(
        theta.atten, q, kv, key_paddings))

  @classmethod
  def FPropMeta(cls, p: Params, query: tf.TensorShape,
                key_paddings: tf.TensorShape | None,
                key_value: tf.TensorShape | None = None) -> LayerMeta:
    where = p.name or cls.__name__
    c = _named(where, cls._Children(p, where))
    query = tf.TensorShape(query)
    kv = query if key_value is None else tf.TensorShape(key_value)
    metas = [c['ln'].cls.FPropMeta(c['ln'], query),
             c['atten'].cls.FPropMeta(c['atten'], query, kv, key_paddings)]
    return _sum(p, metas, _residual_flops(p, query), (query,))


class TransformerFeedForwardLayer(base_layer.BaseLayer):
  """Residual two-layer feed-forward net: D → hidden_dim → D."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Model depth D.')
    p.Define('hidden_dim', 0, 'Inner depth, typically 4·D.')
    p.Define('activation', 'RELU', f'One of {activations.NAMES}.')
    p.Define('relu_dropout_prob', 0.0, 'Dropout on the inner activations.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout on the output before '
             'the residual add.')
    p.Define('pre_layer_norm', True, 'Normalise the input (True) or the sum '
             '(False).')
    p.Define('init_scale', 1.0, 'Gain of the Xavier init of both weights; '
             'GPipe scaled it down (< 1) to train very deep Transformers.')
    return p

  @classmethod
  def _Children(cls, p: Params, where: str) -> dict[str, InstantiableParams]:
    _check(where, p, ('input_dim', 'hidden_dim'),
           ('relu_dropout_prob', 'residual_dropout_prob'))
    if not p.init_scale > 0:
      raise LayerError(f'{where}: init_scale must be > 0, got '
                       f'{p.init_scale}; e.g. 1.0, or smaller for deep nets.')
    init = base_layer.WeightInit.Xavier(p.init_scale)
    fc = linear.FCLayer.Params
    return dict(
        ln=_inherit(p, normalization.LayerNormLayer.Params().Set(
            input_dim=p.input_dim)),
        fc_in=_inherit(p, fc().Set(input_dim=p.input_dim,
                                   output_dim=p.hidden_dim,
                                   activation=p.activation,
                                   params_init=init.Copy())),
        fc_out=_inherit(p, fc().Set(input_dim=p.hidden_dim,
                                    output_dim=p.input_dim,
                                    params_init=init.Copy())))

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    for name, child in self._Children(self.params, self.path).items():
      self.CreateChild(name, child)

  def _Ffn(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    h = self.children.fc_in.FProp(theta.fc_in, x)
    h = dropout.apply_dropout(h, self.params.relu_dropout_prob,
                              f'{self.path}/relu')
    return self.children.fc_out.FProp(theta.fc_out, h)

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    """[..., D] → [..., D]."""
    return _residual(self, theta, x, lambda y: self._Ffn(theta, y))

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> LayerMeta:
    where = p.name or cls.__name__
    c = _named(where, cls._Children(p, where))
    x = tf.TensorShape(x)
    metas = [c['ln'].cls.FPropMeta(c['ln'], x),
             c['fc_in'].cls.FPropMeta(c['fc_in'], x)]
    hidden = metas[-1].out_shapes[0]
    metas.append(c['fc_out'].cls.FPropMeta(c['fc_out'], hidden))
    relu_drop = (shape_lib.num_elements(hidden)
                 if p.relu_dropout_prob > 0 else 0)
    return _sum(p, metas, _residual_flops(p, x) + relu_drop, (x,))


def _transformer_params(p: InstantiableParams) -> InstantiableParams:
  p.Define('input_dim', 0, 'Model depth D.')
  p.Define('num_heads', 8, 'Attention heads; D must divide by it.')
  p.Define('hidden_dim', 0, 'Feed-forward inner depth, typically 4·D.')
  p.Define('activation', 'RELU', 'Feed-forward activation name.')
  p.Define('pre_layer_norm', True, 'Pre-LN (True) or post-LN residuals.')
  p.Define('atten_dropout_prob', 0.0, 'Dropout on attention probabilities.')
  p.Define('residual_dropout_prob', 0.0, 'Dropout on each sub-layer output '
           'before its residual add.')
  p.Define('relu_dropout_prob', 0.0, 'Dropout on feed-forward activations.')
  p.Define('ffn_init_scale', 1.0, 'Gain of the feed-forward weights\' Xavier '
           'init; < 1 for very deep stacks (GPipe).')
  return p


def _atten_params(p: Params, causal: bool) -> InstantiableParams:
  return _inherit(p, TransformerAttentionLayer.Params().Set(
      input_dim=p.input_dim, num_heads=p.num_heads, causal=causal,
      atten_dropout_prob=p.atten_dropout_prob,
      residual_dropout_prob=p.residual_dropout_prob,
      pre_layer_norm=p.pre_layer_norm, params_init=p.params_init.Copy()))


def _ffn_params(p: Params) -> InstantiableParams:
  return _inherit(p, TransformerFeedForwardLayer.Params().Set(
      input_dim=p.input_dim, hidden_dim=p.hidden_dim,
      activation=p.activation, relu_dropout_prob=p.relu_dropout_prob,
      residual_dropout_prob=p.residual_dropout_prob,
      pre_layer_norm=p.pre_layer_norm, init_scale=p.ffn_init_scale))


def _check_paddings(where: str, x: tf.Tensor, paddings: tf.Tensor,
                    what: str) -> tf.Tensor:
  paddings = tf.convert_to_tensor(paddings)
  if paddings.shape.rank != 2 or not paddings.shape.is_compatible_with(
      x.shape[:2]):
    raise LayerError(f'{where}: {what} must be [B, T] = {x.shape[:2]} '
                     f'matching its inputs, got {paddings.shape}; pass float '
                     'paddings with 1.0 at padded positions.')
  return paddings


class TransformerEncoderLayer(base_layer.BaseLayer):
  """Self-attention then feed-forward: (x, paddings) → (x, paddings).

  >>> p = TransformerEncoderLayer.Params().Set(
  ...     name='enc0', input_dim=8, num_heads=2, hidden_dim=32)
  >>> layer = p.Instantiate()
  >>> x, paddings = layer.FProp(layer.theta, tf.ones([2, 5, 8]),
  ...                           tf.zeros([2, 5]))
  """

  CAUSAL = False  # Whether a position attends only to itself and before.

  @classmethod
  def Params(cls) -> InstantiableParams:
    return _transformer_params(super().Params())

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('self_atten', _atten_params(self.params, self.CAUSAL))
    self.CreateChild('ffn', _ffn_params(self.params))

  def FProp(self, theta: NestedMap, x: tf.Tensor,
            paddings: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """x [B, T, D], paddings [B, T] → (x [B, T, D], paddings)."""
    paddings = _check_paddings(self.path, x, paddings, 'paddings')
    x = self.children.self_atten.FProp(theta.self_atten, x, paddings)
    return self.children.ffn.FProp(theta.ffn, x), paddings

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape,
                paddings: tf.TensorShape) -> LayerMeta:
    c = _named(p.name or cls.__name__, dict(
        self_atten=_atten_params(p, cls.CAUSAL), ffn=_ffn_params(p)))
    atten, ffn = c['self_atten'], c['ffn']
    metas = [atten.cls.FPropMeta(atten, x, paddings),
             ffn.cls.FPropMeta(ffn, x)]
    return _sum(p, metas, 0, (x, paddings))


class TransformerCausalLayer(TransformerEncoderLayer):
  """The encoder layer with causal self-attention: a decoder-only language
  model's layer, (x, paddings) → (x, paddings).

  >>> p = TransformerCausalLayer.Params().Set(
  ...     name='layer0', input_dim=8, num_heads=2, hidden_dim=32)
  >>> layer = p.Instantiate()
  >>> x, paddings = layer.FProp(layer.theta, tf.ones([2, 5, 8]),
  ...                           tf.zeros([2, 5]))
  """

  CAUSAL = True


class TransformerDecoderLayer(base_layer.BaseLayer):
  """Causal self-attention, cross-attention over memory, feed-forward.

  FProp: (x, paddings, memory, memory_paddings) → the same four, x updated.
  Decoding, in pseudo-code:

      cache = layer.InitDecodeCache(theta, memory, max_len)
      for t in range(max_len):
        y_t, cache = layer.ExtendStep(theta, x_t, memory_paddings, cache, t)
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    return _transformer_params(super().Params())

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self.CreateChild('self_atten', _atten_params(self.params, causal=True))
    self.CreateChild('cross_atten', _atten_params(self.params, causal=False))
    self.CreateChild('ffn', _ffn_params(self.params))

  def FProp(self, theta: NestedMap, x: tf.Tensor, paddings: tf.Tensor,
            memory: tf.Tensor, memory_paddings: tf.Tensor) -> tuple[Any, ...]:
    """x [B, T, D], paddings [B, T], memory [B, S, D], memory_paddings [B, S].

    Returns:
      (x [B, T, D], paddings, memory, memory_paddings).
    """
    c = self.children
    x, memory = tf.cast(x, self.fprop_dtype), tf.cast(memory, self.fprop_dtype)
    paddings = _check_paddings(self.path, x, paddings, 'paddings')
    memory_paddings = _check_paddings(self.path, memory, memory_paddings,
                                      'memory_paddings')
    y = c.self_atten.FProp(theta.self_atten, x, paddings)
    y = c.cross_atten.FProp(theta.cross_atten, y, memory_paddings, memory)
    return c.ffn.FProp(theta.ffn, y), paddings, memory, memory_paddings

  def InitDecodeCache(self, theta: NestedMap, memory: tf.Tensor,
                      max_len: int) -> NestedMap:
    """Projected memory (once) and an empty [B, max_len, N, H] self cache."""
    batch = memory.shape[0] or tf.shape(memory)[0]
    return NestedMap(
        self_atten=self.children.self_atten.children.atten.InitCache(
            batch, max_len),
        memory=self.children.cross_atten.children.atten.ProjectKeyValue(
            theta.cross_atten.atten, memory))

  def ExtendStep(self, theta: NestedMap, x_t: tf.Tensor,
                 memory_paddings: tf.Tensor, cache: NestedMap,
                 t: Any) -> tuple[tf.Tensor, NestedMap]:
    """One decoding step at position t: x_t [B, 1, D] → ([B, 1, D], cache).

    Positions 0..t are all attended (a decoded prefix has no padding); this
    equals FProp at every real position of right-padded targets.
    """
    c = self.children
    y, self_cache = c.self_atten.ExtendStep(theta.self_atten, x_t,
                                            cache.self_atten, t)
    y = c.cross_atten.AttendTo(theta.cross_atten, y, cache.memory,
                               memory_paddings)
    y = c.ffn.FProp(theta.ffn, y)
    return y, NestedMap(self_atten=self_cache, memory=cache.memory)

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape, paddings: tf.TensorShape,
                memory: tf.TensorShape,
                memory_paddings: tf.TensorShape) -> LayerMeta:
    c = _named(p.name or cls.__name__, dict(
        self_atten=_atten_params(p, True), cross_atten=_atten_params(p, False),
        ffn=_ffn_params(p)))
    self_atten, cross, ffn = c['self_atten'], c['cross_atten'], c['ffn']
    metas = [self_atten.cls.FPropMeta(self_atten, x, paddings),
             cross.cls.FPropMeta(cross, x, memory_paddings, memory),
             ffn.cls.FPropMeta(ffn, x)]
    return _sum(p, metas, 0, (x, paddings, memory, memory_paddings))
