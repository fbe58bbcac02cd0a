"""The decoder-only Transformer LM as a flat layer list.

Every layer maps one tuple to the next, so the pipeline can cut anywhere:

    LmEmbedding                ids [B, T], paddings [B, T] → (x [B, T, D],
                               paddings): table lookup × sqrt(D), sinusoidal
                               positions, dropout
    TransformerCausalLayer × N (x, paddings) → (x, paddings): causal
                               self-attention, feed-forward (pre-LN)
    LmSoftmax                  final LayerNorm + projection → logits [B, T, V]

The softmax's weights are the embedding table transposed (`lm_ties`),
as in GPT-2 and the Transformer (Press & Wolf, 2017): the table lives on the
first stage and the softmax on the last, and the pipeline keeps the two
copies in step (`core/tied_weights.py`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import embedding
from lingvo_pipe.layers import shape as shape_lib
from lingvo_pipe.tasks.mt import layers as mt_layers

Shape = tf.TensorShape


class LmEmbedding(base_layer.BaseLayer):
  """Layer 0: (ids, paddings) → (x, paddings)."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of ids V.')
    p.Define('model_dim', 0, 'Model depth D; even (sine/cosine pairs).')
    p.Define('dropout_prob', 0.0, 'Dropout on embeddings + positions.')
    return p

  @classmethod
  def _Children(cls, p: Params) -> dict[str, InstantiableParams]:
    return dict(
        emb=embedding.EmbeddingLayer.Params().Set(
            vocab_size=p.vocab_size, embedding_dim=p.model_dim,
            scale_sqrt_depth=True, dtype=p.dtype, fprop_dtype=p.fprop_dtype,
            params_init=base_layer.WeightInit.Gaussian(
                max(p.model_dim, 1) ** -0.5)),
        pos=embedding.PositionalEmbeddingLayer.Params().Set(
            embedding_dim=p.model_dim, dtype=p.dtype,
            fprop_dtype=p.fprop_dtype))

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    if not 0 <= self.params.dropout_prob < 1:
      raise base_layer.LayerError(
          f'{self.path}: dropout_prob must be in [0, 1), got '
          f'{self.params.dropout_prob}; e.g. 0.1, or 0 to disable.')
    for name, child in self._Children(self.params).items():
      self.CreateChild(name, child)

  def FProp(self, theta: NestedMap, ids: tf.Tensor,
            paddings: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    x = self.children.emb.FProp(theta.emb, tf.cast(ids, tf.int32))
    x = self.children.pos.FProp(theta.pos, x)
    x = dropout.apply_dropout(x, self.params.dropout_prob, self.path)
    return x, tf.cast(paddings, self.fprop_dtype)

  @classmethod
  def FPropMeta(cls, p: Params, ids: Shape,
                paddings: Shape) -> base_layer.LayerMeta:
    c = cls._Children(p)
    for name, child in c.items():
      child.name = f'{p.name or cls.__name__}.{name}'
    x = c['emb'].cls.FPropMeta(c['emb'], Shape(ids))
    y = c['pos'].cls.FPropMeta(c['pos'], x.out_shapes[0])
    flops = x.flops + y.flops
    if p.dropout_prob > 0:
      flops += shape_lib.num_elements(y.out_shapes[0])
    return base_layer.LayerMeta.build(
        p, flops=flops, out_shapes=(y.out_shapes[0], Shape(paddings)),
        num_params=p.vocab_size * p.model_dim)


class LmSoftmax(mt_layers.DecoderSoftmax):
  """The last layer: (x, paddings) → logits [B, T, V] (the translator's
  softmax, fed one sequence)."""

  def FProp(self, theta: NestedMap, x: tf.Tensor,  # pylint: disable=arguments-differ
            paddings: tf.Tensor) -> tf.Tensor:
    del paddings  # The loss weighs padding out.
    return self.Logits(theta, x)

  @classmethod
  def FPropMeta(cls, p: Params, x: Shape,  # pylint: disable=arguments-differ
                paddings: Shape) -> base_layer.LayerMeta:
    return super().FPropMeta(p, x, paddings, x, paddings)


def lm_layers(vocab_size: int, model_dim: int, num_heads: int,
              hidden_dim: int, num_layers: int, dropout_prob: float = 0.1,
              ffn_init_scale: float = 1.0, logits_abs_max: float = 0.0,
              fprop_dtype: Any = None) -> list[InstantiableParams]:
  """The pipeline's layer list: embedding, N causal layers, softmax."""
  from lingvo_pipe.layers import transformer  # pylint: disable=g-import-not-at-top
  out = [LmEmbedding.Params().Set(name='emb', vocab_size=vocab_size,
                                  model_dim=model_dim,
                                  dropout_prob=dropout_prob)]
  out += [transformer.TransformerCausalLayer.Params().Set(
      name=f'layer{i}', input_dim=model_dim, num_heads=num_heads,
      hidden_dim=hidden_dim, residual_dropout_prob=dropout_prob,
      relu_dropout_prob=dropout_prob, ffn_init_scale=ffn_init_scale)
          for i in range(num_layers)]
  out.append(LmSoftmax.Params().Set(
      name='softmax', input_dim=model_dim, vocab_size=vocab_size,
      logits_abs_max=logits_abs_max))
  for p in out:
    p.fprop_dtype = fprop_dtype
  return out
