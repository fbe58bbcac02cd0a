"""The translator as a flat layer list: every layer maps one tuple to the next.

A GPipe pipeline is a sequence of layers cut anywhere, so an encoder-decoder
has to be written as one: the source and the target travel together through
every layer, and each layer updates its part of the tuple

    (src_x [B, S, D], src_paddings [B, S], tgt_x [B, T, D], tgt_paddings [B, T])

and passes the rest on to whichever stage holds the next layer:

    SourceTargetEmbedding   ids → vectors for both sides (target shifted by
                            the input generator: BOS, y_0, …, y_{T-2})
    EncoderLayer × Ne       updates src_x
    EncoderFinalNorm        LayerNorm of src_x (pre-LN stacks end with one)
    DecoderLayer × Nd       updates tgt_x, attending over src_x (the memory)
    DecoderSoftmax          final LayerNorm + projection → logits [B, T, V]

The padding masks cross every stage boundary with the activations, so a
decoder layer on stage 3 masks the same source positions as the encoder on
stage 0. Every tensor keeps the batch dimension first, so the pipeline can
cut and glue micro-batches anywhere. With a joint vocabulary the softmax's
weights are the embedding table transposed (`model.softmax_ties`, declared in
the pipeline's `tied_weights`): the table lives on the first stage and the
softmax on the last, and `core/tied_weights.py` keeps the two in step.

Decoding does not use the tuple: `decoder.PipelineDecoder` calls the
per-part methods here (`EmbedSource`, `EmbedTarget`, `Encode`,
`ExtendStep`, `Logits`) layer by layer on each layer's stage device.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import embedding
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import shape as shape_lib
from lingvo_pipe.layers import softmax
from lingvo_pipe.layers import transformer

LayerMeta = base_layer.LayerMeta
Shape = tf.TensorShape


def _num_params(p: Params, metas: list[LayerMeta]) -> int:
  return sum(m.param_bytes for m in metas) // p.dtype.size


def _meta(p: Params, metas: list[LayerMeta], extra_flops: int,
          out_shapes: tuple[Any, ...]) -> LayerMeta:
  """One LayerMeta summing `metas`, with this layer's own output shapes."""
  return LayerMeta.build(p, flops=sum(m.flops for m in metas) + extra_flops,
                         out_shapes=out_shapes,
                         num_params=_num_params(p, metas))


class SourceTargetEmbedding(base_layer.BaseLayer):
  """Layer 0: (src_ids, src_paddings, tgt_ids, tgt_paddings) → the tuple.

  Ids are embedded (× sqrt(D)), sinusoidal positions added, then dropout.
  Source and target share one table by default: the vocabulary is joint.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of ids of the (joint) vocabulary.')
    p.Define('model_dim', 0, 'Model depth D; must be even (sine/cosine '
             'position channels come in pairs).')
    p.Define('share_embedding', True, 'One table for source and target '
             '(the SentencePiece vocabulary is joint English–Spanish).')
    p.Define('dropout_prob', 0.0, 'Dropout on embeddings + positions.')
    return p

  @classmethod
  def _Children(cls, p: Params) -> dict[str, InstantiableParams]:
    emb = embedding.EmbeddingLayer.Params().Set(
        vocab_size=p.vocab_size, embedding_dim=p.model_dim,
        scale_sqrt_depth=True, dtype=p.dtype, fprop_dtype=p.fprop_dtype,
        params_init=base_layer.WeightInit.Gaussian(
            max(p.model_dim, 1) ** -0.5))
    children = dict(src_emb=emb)
    if not p.share_embedding:
      children['tgt_emb'] = emb.Copy()
    children['pos'] = embedding.PositionalEmbeddingLayer.Params().Set(
        embedding_dim=p.model_dim, dtype=p.dtype, fprop_dtype=p.fprop_dtype)
    return children

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    if not 0 <= self.params.dropout_prob < 1:
      raise base_layer.LayerError(
          f'{self.path}: dropout_prob must be in [0, 1), got '
          f'{self.params.dropout_prob}; e.g. 0.1, or 0 to disable.')
    for name, child in self._Children(self.params).items():
      self.CreateChild(name, child)

  def _Embed(self, theta: NestedMap, ids: tf.Tensor, table: str,
             position_offset: Any, seed_key: str) -> tf.Tensor:
    ids = tf.cast(ids, tf.int32)
    x = self.children[table].FProp(theta[table], ids)
    x = self.children.pos.FProp(theta.pos, x, position_offset)
    return dropout.apply_dropout(x, self.params.dropout_prob,
                                 f'{self.path}/{seed_key}')

  def EmbedSource(self, theta: NestedMap, ids: tf.Tensor) -> tf.Tensor:
    """Source ids [B, S] → [B, S, D]."""
    return self._Embed(theta, ids, 'src_emb', 0, 'src')

  def EmbedTarget(self, theta: NestedMap, ids: tf.Tensor,
                  position_offset: Any = 0) -> tf.Tensor:
    """Decoder input ids [B, T] at positions offset… → [B, T, D]."""
    table = 'src_emb' if self.params.share_embedding else 'tgt_emb'
    return self._Embed(theta, ids, table, position_offset, 'tgt')

  def FProp(self, theta: NestedMap, src_ids: tf.Tensor,
            src_paddings: tf.Tensor, tgt_ids: tf.Tensor,
            tgt_paddings: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """Embeds both sides; paddings pass through as float (1.0 = padded)."""
    return (self.EmbedSource(theta, src_ids),
            tf.cast(src_paddings, self.fprop_dtype),
            self.EmbedTarget(theta, tgt_ids),
            tf.cast(tgt_paddings, self.fprop_dtype))

  @classmethod
  def FPropMeta(cls, p: Params, src_ids: Shape, src_paddings: Shape,
                tgt_ids: Shape, tgt_paddings: Shape) -> LayerMeta:
    c = cls._Children(p)
    for name, child in c.items():
      child.name = f'{p.name or cls.__name__}.{name}'
    emb, pos = c['src_emb'], c['pos']
    outs, flops = [], 0
    for ids in (Shape(src_ids), Shape(tgt_ids)):
      x = emb.cls.FPropMeta(emb, ids)
      y = pos.cls.FPropMeta(pos, x.out_shapes[0])
      outs.append(y.out_shapes[0])
      flops += x.flops + y.flops
      if p.dropout_prob > 0:
        flops += shape_lib.num_elements(y.out_shapes[0])
    num_tables = 1 if p.share_embedding else 2
    return LayerMeta.build(
        p, flops=flops, num_params=num_tables * p.vocab_size * p.model_dim,
        out_shapes=(outs[0], Shape(src_paddings), outs[1],
                    Shape(tgt_paddings)))


class EncoderLayer(transformer.TransformerEncoderLayer):
  """A Transformer encoder layer on src_x; the target passes through."""

  def Encode(self, theta: NestedMap, x: tf.Tensor,
             paddings: tf.Tensor) -> tf.Tensor:
    """src_x [B, S, D] → [B, S, D] (used by decoding, outside the tuple)."""
    return super().FProp(theta, x, paddings)[0]

  def FProp(self, theta: NestedMap, src_x: tf.Tensor, src_paddings: tf.Tensor,
            tgt_x: tf.Tensor, tgt_paddings: tf.Tensor) -> tuple[Any, ...]:
    return (self.Encode(theta, src_x, src_paddings), src_paddings, tgt_x,
            tgt_paddings)

  @classmethod
  def FPropMeta(cls, p: Params, src_x: Shape, src_paddings: Shape,
                tgt_x: Shape, tgt_paddings: Shape) -> LayerMeta:
    meta = super().FPropMeta(p, src_x, src_paddings)
    return _meta(p, [meta], 0, (Shape(src_x), Shape(src_paddings),
                                Shape(tgt_x), Shape(tgt_paddings)))


class EncoderFinalNorm(normalization.LayerNormLayer):
  """LayerNorm of src_x after the last pre-LN encoder layer."""

  def Encode(self, theta: NestedMap, x: tf.Tensor,
             paddings: tf.Tensor) -> tf.Tensor:
    del paddings  # Per position: padding does not matter.
    return super().FProp(theta, x)

  def FProp(self, theta: NestedMap, src_x: tf.Tensor, src_paddings: tf.Tensor,
            tgt_x: tf.Tensor, tgt_paddings: tf.Tensor) -> tuple[Any, ...]:
    return (self.Encode(theta, src_x, src_paddings), src_paddings, tgt_x,
            tgt_paddings)

  @classmethod
  def FPropMeta(cls, p: Params, src_x: Shape, src_paddings: Shape,
                tgt_x: Shape, tgt_paddings: Shape) -> LayerMeta:
    meta = super().FPropMeta(p, src_x)
    return _meta(p, [meta], 0, (Shape(src_x), Shape(src_paddings),
                                Shape(tgt_x), Shape(tgt_paddings)))


class DecoderLayer(transformer.TransformerDecoderLayer):
  """A Transformer decoder layer on tgt_x over the memory src_x.

  Decoding uses the inherited `InitDecodeCache` and `ExtendStep`.
  """

  def FProp(self, theta: NestedMap, src_x: tf.Tensor, src_paddings: tf.Tensor,
            tgt_x: tf.Tensor, tgt_paddings: tf.Tensor) -> tuple[Any, ...]:
    y, tgt_paddings, src_x, src_paddings = super().FProp(
        theta, tgt_x, tgt_paddings, src_x, src_paddings)
    return src_x, src_paddings, y, tgt_paddings

  @classmethod
  def FPropMeta(cls, p: Params, src_x: Shape, src_paddings: Shape,
                tgt_x: Shape, tgt_paddings: Shape) -> LayerMeta:
    meta = super().FPropMeta(p, tgt_x, tgt_paddings, src_x, src_paddings)
    return _meta(p, [meta], 0, (Shape(src_x), Shape(src_paddings),
                                Shape(tgt_x), Shape(tgt_paddings)))


class DecoderSoftmax(base_layer.BaseLayer):
  """The last layer: (final LayerNorm of) tgt_x → logits [B, T, V]."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Model depth D.')
    p.Define('vocab_size', 0, 'Number of classes V.')
    p.Define('final_layer_norm', True, 'Normalise tgt_x first (pre-LN '
             'stacks: their residual stream is never normalised otherwise).')
    p.Define('logits_abs_max', 0.0, 'Clip logits to [-c, c]; 0 disables. '
             'GPipe clipped logits to keep deep Transformers stable.')
    return p

  @classmethod
  def _Children(cls, p: Params) -> dict[str, InstantiableParams]:
    children = {}
    if p.final_layer_norm:
      children['ln'] = normalization.LayerNormLayer.Params().Set(
          input_dim=p.input_dim, dtype=p.dtype, fprop_dtype=p.fprop_dtype)
    children['softmax'] = softmax.SoftmaxLayer.Params().Set(
        input_dim=p.input_dim, num_classes=p.vocab_size,
        logits_abs_max=p.logits_abs_max, dtype=p.dtype,
        fprop_dtype=p.fprop_dtype, params_init=p.params_init.Copy())
    return children

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    for name, child in self._Children(self.params).items():
      self.CreateChild(name, child)

  def Logits(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    """[..., D] → [..., V]."""
    if self.params.final_layer_norm:
      x = self.children.ln.FProp(theta.ln, x)
    return self.children.softmax.FProp(theta.softmax, x)

  def FProp(self, theta: NestedMap, src_x: tf.Tensor, src_paddings: tf.Tensor,
            tgt_x: tf.Tensor, tgt_paddings: tf.Tensor) -> tf.Tensor:
    del src_x, src_paddings, tgt_paddings  # The loss weighs padding out.
    return self.Logits(theta, tgt_x)

  @classmethod
  def FPropMeta(cls, p: Params, src_x: Shape, src_paddings: Shape,
                tgt_x: Shape, tgt_paddings: Shape) -> LayerMeta:
    del src_x, src_paddings, tgt_paddings
    c = cls._Children(p)
    metas = []
    x = Shape(tgt_x)
    for name, child in c.items():
      child.name = f'{p.name or cls.__name__}.{name}'
      metas.append(child.cls.FPropMeta(child, x))
      x = metas[-1].out_shapes[0]
    return _meta(p, metas, 0, (x,))
