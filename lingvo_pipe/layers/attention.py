"""Multi-head dot-product attention, with a cache for incremental decoding.

    q, k, v = x_q·Wq, x_kv·Wk, x_kv·Wv          # [B, T, N, H] (N heads of H)
    logits  = q·kᵀ / sqrt(H), blocked → -big     # [B, N, Tq, Tk]
    out     = dropout(softmax(logits))·v·Wo      # [B, Tq, D]

Blocked positions are padded keys (`key_paddings` = 1.0) and, with `causal`,
keys after the query. Their logits are *replaced* (`tf.where`, not added) by
-0.7 × the dtype's largest value, which is finite in float32, bfloat16 and
float16 and never overflows to -inf. A query whose keys are all blocked then
sees equal logits and a uniform softmax: finite output, no NaN (the loss
weights ignore such rows). The softmax runs in float32 whatever fprop_dtype.

Attention-probability dropout uses the shared `apply_dropout` with seed key
`<layer path>/atten`, so the pipeline's recompute draws the forward mask.

Incremental decoding: greedy and beam search feed one token per step.
Recomputing attention over the whole prefix costs O(t²) per step;
`ExtendStep(theta, query_t, cache, t)` instead writes this step's key and
value into a preallocated `[B, T_max, N, H]` cache at position t and attends
over positions <= t, so a step costs O(T_max). Static cache shapes keep the
decode loop a single `tf.function`/XLA trace. For cross-attention, the memory
is projected once (`ProjectKeyValue`) and re-used with `AttendTo`.

Cost convention (FPropMeta): 2 flops per multiply-add (projections, q·kᵀ,
probs·v); 1 per element for the query scale, biases, mask, softmax and
dropout.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import dropout

LayerError = base_layer.LayerError


def blocked_logit(dtype: tf.DType) -> float:
  """The logit given to blocked positions: finite, safely below any real."""
  return -0.7 * dtype.max


class MultiHeadAttention(base_layer.BaseLayer):
  """Multi-head attention of queries [B, Tq, D] over keys/values [B, Tk, D].

  >>> p = MultiHeadAttention.Params().Set(name='atten', input_dim=8,
  ...                                     num_heads=2, causal=True)
  >>> layer = p.Instantiate()
  >>> x = tf.ones([3, 5, 8])
  >>> y = layer.FProp(layer.theta, x, x, tf.zeros([3, 5]))  # [3, 5, 8]
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Depth D of queries, keys/values and output.')
    p.Define('num_heads', 1, 'Number of heads N; hidden_dim / N is the depth '
             'H of each head.')
    p.Define('hidden_dim', 0, 'Total depth N·H of the projected queries, '
             'keys and values; 0 means input_dim.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout rate on the attention '
             'probabilities in training, in [0, 1).')
    p.Define('causal', False, 'Query i attends only to keys j <= i (decoder '
             'self-attention); needs Tq == Tk.')
    p.Define('use_bias', True, 'Add learned biases to the four projections.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_params(self.path, self.params)
    p = self.params
    d, n, h = p.input_dim, p.num_heads, _hidden_dim(p) // p.num_heads
    for name in ('query', 'key', 'value'):
      self.CreateVariable(f'{name}_w', base_layer.WeightParams([d, n, h]))
    self.CreateVariable('post_w', base_layer.WeightParams([n, h, d]))
    if p.use_bias:
      zeros = base_layer.WeightInit.Constant(0.0)
      for name in ('query', 'key', 'value'):
        self.CreateVariable(f'{name}_b', base_layer.WeightParams([n, h],
                                                                 zeros))
      self.CreateVariable('post_b', base_layer.WeightParams([d], zeros))

  # ---- Pieces ----------------------------------------------------------------
  def _Project(self, theta: NestedMap, x: tf.Tensor, name: str) -> tf.Tensor:
    """[B, T, D] → [B, T, N, H] with projection `name`."""
    out = tf.einsum('BTD,DNH->BTNH', x,
                    tf.cast(theta[f'{name}_w'], self.fprop_dtype))
    if self.params.use_bias:
      out += tf.cast(theta[f'{name}_b'], self.fprop_dtype)
    return out

  def _CheckDepth(self, x: tf.Tensor, what: str) -> tf.Tensor:
    x = tf.cast(x, self.fprop_dtype)
    d = self.params.input_dim
    if x.shape.rank != 3 or x.shape[-1] not in (None, d):
      raise LayerError(f'{self.path}: {what} must be [B, T, {d}] '
                       f'(input_dim={d}), got shape {x.shape}; set '
                       'p.input_dim to the model depth.')
    return x

  def _Attend(self, theta: NestedMap, q: tf.Tensor, k: tf.Tensor,
              v: tf.Tensor, blocked: tf.Tensor | None) -> tf.Tensor:
    """Attention of q [B,Tq,N,H] over k, v [B,Tk,N,H] → [B, Tq, D].

    `blocked` is a bool tensor broadcastable to [B, N, Tq, Tk]; True keys are
    ignored.
    """
    h = q.shape[-1]
    q *= tf.cast(h ** -0.5, q.dtype)
    logits = tf.einsum('BQNH,BKNH->BNQK', q, k)  # [B, N, Tq, Tk]
    logits = tf.cast(logits, tf.float32)
    if blocked is not None:
      blocked = tf.broadcast_to(blocked, tf.shape(logits))
      logits = tf.where(blocked, blocked_logit(tf.float32), logits)
    probs = tf.cast(tf.nn.softmax(logits, axis=-1), self.fprop_dtype)
    probs = dropout.apply_dropout(probs, self.params.atten_dropout_prob,
                                  f'{self.path}/atten')
    ctx = tf.einsum('BNQK,BKNH->BQNH', probs, v)  # [B, Tq, N, H]
    out = tf.einsum('BQNH,NHD->BQD', ctx,
                    tf.cast(theta.post_w, self.fprop_dtype))
    if self.params.use_bias:
      out += tf.cast(theta.post_b, self.fprop_dtype)
    return out

  # ---- Full sequences --------------------------------------------------------
  def FProp(self, theta: NestedMap, query: tf.Tensor, key_value: tf.Tensor,
            key_paddings: tf.Tensor | None = None) -> tf.Tensor:
    """Attends from every query position over all (unblocked) keys.

    Args:
      theta: this layer's variables.
      query: [B, Tq, D].
      key_value: [B, Tk, D] (the query itself for self-attention).
      key_paddings: optional [B, Tk] float, 1.0 at padded keys.

    Returns:
      [B, Tq, D] in fprop_dtype.

    Raises:
      LayerError: on a depth mismatch, or causal with Tq != Tk.
    """
    query = self._CheckDepth(query, 'query')
    key_value = self._CheckDepth(key_value, 'key_value')
    tq, tk = query.shape[1], key_value.shape[1]
    if self.params.causal and None not in (tq, tk) and tq != tk:
      raise LayerError(f'{self.path}: causal attention needs as many queries '
                       f'as keys, got Tq={tq}, Tk={tk}; use ExtendStep for '
                       'one-step decoding or set p.causal = False.')
    kv = self.ProjectKeyValue(theta, key_value)
    q = self._Project(theta, query, 'query')
    blocked = _padding_block(key_paddings)
    if self.params.causal:
      n = tf.shape(query)[1]
      causal = tf.range(n)[None, :] > tf.range(n)[:, None]  # [Tq, Tk]
      causal = causal[None, None]  # [1, 1, Tq, Tk]
      blocked = causal if blocked is None else tf.logical_or(blocked, causal)
    return self._Attend(theta, q, kv.key, kv.value, blocked)

  def ProjectKeyValue(self, theta: NestedMap,
                      key_value: tf.Tensor) -> NestedMap:
    """NestedMap(key, value), each [B, Tk, N, H]: reusable across steps."""
    key_value = self._CheckDepth(key_value, 'key_value')
    return NestedMap(key=self._Project(theta, key_value, 'key'),
                     value=self._Project(theta, key_value, 'value'))

  def AttendTo(self, theta: NestedMap, query: tf.Tensor, kv: NestedMap,
               key_paddings: tf.Tensor | None = None) -> tf.Tensor:
    """Non-causal attention of query [B, Tq, D] over projected `kv`."""
    q = self._Project(theta, self._CheckDepth(query, 'query'), 'query')
    return self._Attend(theta, q, kv.key, kv.value,
                        _padding_block(key_paddings))

  # ---- Incremental decoding --------------------------------------------------
  def InitCache(self, batch_size: int, max_len: int) -> NestedMap:
    """Zero self-attention cache: key and value [B, max_len, N, H]."""
    p = self.params
    shape = [batch_size, max_len, p.num_heads, _hidden_dim(p) // p.num_heads]
    return NestedMap(key=tf.zeros(shape, self.fprop_dtype),
                     value=tf.zeros(shape, self.fprop_dtype))

  def ExtendStep(self, theta: NestedMap, query_t: tf.Tensor, cache: NestedMap,
                 t: tf.Tensor | int) -> tuple[tf.Tensor, NestedMap]:
    """One causal self-attention step at position t.

    Args:
      theta: this layer's variables.
      query_t: [B, 1, D], the input at position t.
      cache: NestedMap(key, value) [B, T_max, N, H] holding positions < t.
      t: the position, a Python int or scalar int tensor, < T_max.

    Returns:
      (out [B, 1, D], the cache with position t filled in).
    """
    query_t = self._CheckDepth(query_t, 'query_t')
    max_len = tf.shape(cache.key)[1]
    at_t = tf.one_hot(t, max_len, dtype=self.fprop_dtype)[None, :, None, None]
    new_cache = NestedMap()
    for name in ('key', 'value'):
      x_t = self._Project(theta, query_t, name)  # [B, 1, N, H]
      new_cache[name] = cache[name] * (1 - at_t) + x_t * at_t
    q = self._Project(theta, query_t, 'query')
    future = tf.range(max_len) > tf.cast(t, tf.int32)  # [T_max]
    out = self._Attend(theta, q, new_cache.key, new_cache.value,
                       future[None, None, None, :])
    return out, new_cache

  # ---- Cost ------------------------------------------------------------------
  @classmethod
  def FPropMeta(cls, p: Params, query: tf.TensorShape,
                key_value: tf.TensorShape,
                key_paddings: tf.TensorShape | None = None
               ) -> base_layer.LayerMeta:
    del key_paddings  # Costs nothing beyond the mask counted below.
    _check_params(p.name, p)
    query, key_value = tf.TensorShape(query), tf.TensorShape(key_value)
    for what, s in (('query', query), ('key_value', key_value)):
      if s.rank != 3 or s[-1] != p.input_dim:
        raise LayerError(f'{p.name}: {what} must be [B, T, {p.input_dim}] '
                         f'(input_dim), got {s}; set p.input_dim.')
    b, tq, tk = query[0] or 1, query[1] or 1, key_value[1] or 1
    d, hd, n = p.input_dim, _hidden_dim(p), p.num_heads
    projections = 2 * b * d * hd * (2 * tq + 2 * tk)  # q, out; k, v
    scores = 2 * 2 * b * tq * tk * hd  # q·kᵀ and probs·v
    per_logit = 2 + int(p.atten_dropout_prob > 0)  # mask, softmax, dropout
    elementwise = b * tq * hd + per_logit * b * n * tq * tk
    if p.use_bias:
      elementwise += b * (tq * hd + 2 * tk * hd + tq * d)
    num_params = 4 * d * hd + ((3 * hd + d) if p.use_bias else 0)
    return base_layer.LayerMeta.build(
        p, flops=projections + scores + elementwise, out_shapes=(query,),
        num_params=num_params)


def _hidden_dim(p: Params) -> int:
  return p.hidden_dim or p.input_dim


def _padding_block(key_paddings: tf.Tensor | None) -> tf.Tensor | None:
  """[B, Tk] paddings → [B, 1, 1, Tk] bool, True at padded keys."""
  if key_paddings is None:
    return None
  return (tf.cast(key_paddings, tf.float32) > 0.5)[:, None, None, :]


def _check_params(where: str, p: Params) -> None:
  for name in ('input_dim', 'num_heads'):
    value = getattr(p, name)
    if not isinstance(value, int) or value <= 0:
      raise LayerError(f'{where}: {name} must be an int > 0, got {value!r}; '
                       f'set p.{name}.')
  hd = _hidden_dim(p)
  if not isinstance(hd, int) or hd < 0 or hd % p.num_heads:
    raise LayerError(f'{where}: hidden_dim {hd!r} must be a multiple of '
                     f'num_heads {p.num_heads}; set p.hidden_dim to N·H (0 '
                     'uses input_dim).')
  if not 0 <= p.atten_dropout_prob < 1:
    raise LayerError(f'{where}: atten_dropout_prob must be in [0, 1), got '
                     f'{p.atten_dropout_prob}; e.g. 0.1, or 0 to disable.')
