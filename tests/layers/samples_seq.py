"""Conformance samples for the sequence layers (embedding ... transformer).

`SAMPLES[cls]` is a list of `(params, input_shapes, input_maker)`;
`input_maker(shapes, rng)` returns the FProp inputs as a tuple of tensors
(int ids, 0/1 right-padded paddings) where random floats would not do.
"""

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from lingvo_pipe.layers import attention
from lingvo_pipe.layers import embedding
from lingvo_pipe.layers import softmax
from lingvo_pipe.layers import transformer

VOCAB, D = 11, 8


def _list(shape: Any) -> list[int]:
  return tf.TensorShape(shape).as_list()


def _integers(rng: Any, high: int, size: Sequence[int]) -> np.ndarray:
  """Ints in [0, high) from a numpy Generator or RandomState."""
  draw = getattr(rng, 'integers', None) or rng.randint
  return np.asarray(draw(0, high, size=size))


def _paddings(rng: Any, shape: Any) -> tf.Tensor:
  """[B, T] right padding: row b has a random length in [0, T]."""
  b, t = _list(shape)
  lengths = _integers(rng, t + 1, [b])
  lengths[0] = t  # At least one full row ...
  if b > 1:
    lengths[-1] = 0  # ... and one fully padded row.
  return tf.constant(np.arange(t)[None, :] >= lengths[:, None], tf.float32)


def _floats(rng: Any, shape: Any) -> tf.Tensor:
  return tf.constant(rng.uniform(-1.0, 1.0, size=_list(shape)), tf.float32)


def _maker(kinds: str) -> Callable[[Sequence[Any], Any], tuple[Any, ...]]:
  """kinds[i] is 'f' (floats), 'p' (paddings) or 'i' (ids) for input i."""

  def make(shapes: Sequence[Any], rng: Any) -> tuple[Any, ...]:
    out = []
    for kind, shape in zip(kinds, shapes):
      if kind == 'p':
        out.append(_paddings(rng, shape))
      elif kind == 'i':
        out.append(tf.constant(_integers(rng, VOCAB, _list(shape)), tf.int32))
      else:
        out.append(_floats(rng, shape))
    return tuple(out)

  return make


def _tr(cls: type, **kwargs: Any) -> Any:
  p = cls.Params().Set(name=cls.__name__.lower(), input_dim=D, num_heads=2,
                       hidden_dim=16)
  return p.Set(**kwargs)


_MHA = attention.MultiHeadAttention.Params().Set(
    name='atten', input_dim=D, num_heads=2)
_DROPOUTS = dict(atten_dropout_prob=0.1, residual_dropout_prob=0.1,
                 relu_dropout_prob=0.1)

SAMPLES = {
    embedding.EmbeddingLayer: [
        (embedding.EmbeddingLayer.Params().Set(
            name='emb', vocab_size=VOCAB, embedding_dim=D,
            scale_sqrt_depth=True), ([2, 5],), _maker('i')),
    ],
    embedding.PositionalEmbeddingLayer: [
        (embedding.PositionalEmbeddingLayer.Params().Set(
            name='pos', embedding_dim=D), ([2, 5, D],), None),
    ],
    softmax.SoftmaxLayer: [
        (softmax.SoftmaxLayer.Params().Set(
            name='softmax', input_dim=D, num_classes=VOCAB), ([2, 5, D],),
         None),
        (softmax.SoftmaxLayer.Params().Set(
            name='softmax', input_dim=D, num_classes=VOCAB, has_bias=False,
            logits_abs_max=2.0), ([3, D],), None),
    ],
    attention.MultiHeadAttention: [
        (_MHA.Copy().Set(causal=True, atten_dropout_prob=0.1),
         ([2, 5, D], [2, 5, D], [2, 5]), _maker('ffp')),
        (_MHA.Copy().Set(num_heads=3, hidden_dim=12, use_bias=False),
         ([2, 3, D], [2, 6, D], [2, 6]), _maker('ffp')),
    ],
    transformer.TransformerAttentionLayer: [
        (transformer.TransformerAttentionLayer.Params().Set(
            name='self_atten', input_dim=D, num_heads=2, causal=True,
            atten_dropout_prob=0.1, residual_dropout_prob=0.1),
         ([2, 5, D], [2, 5]), _maker('fp')),
        (transformer.TransformerAttentionLayer.Params().Set(
            name='cross_atten', input_dim=D, num_heads=2,
            pre_layer_norm=False),
         ([2, 3, D], [2, 6], [2, 6, D]), _maker('fpf')),
    ],
    transformer.TransformerFeedForwardLayer: [
        (transformer.TransformerFeedForwardLayer.Params().Set(
            name='ffn', input_dim=D, hidden_dim=16, relu_dropout_prob=0.1,
            residual_dropout_prob=0.1), ([2, 5, D],), None),
        (transformer.TransformerFeedForwardLayer.Params().Set(
            name='ffn', input_dim=D, hidden_dim=16, activation='GELU',
            pre_layer_norm=False, init_scale=0.5), ([3, D],), None),
    ],
    transformer.TransformerEncoderLayer: [
        (_tr(transformer.TransformerEncoderLayer, **_DROPOUTS),
         ([2, 5, D], [2, 5]), _maker('fp')),
        (_tr(transformer.TransformerEncoderLayer, pre_layer_norm=False),
         ([2, 5, D], [2, 5]), _maker('fp')),
    ],
    transformer.TransformerCausalLayer: [
        (_tr(transformer.TransformerCausalLayer, **_DROPOUTS),
         ([2, 5, D], [2, 5]), _maker('fp')),
    ],
    transformer.TransformerDecoderLayer: [
        (_tr(transformer.TransformerDecoderLayer, **_DROPOUTS),
         ([2, 5, D], [2, 5], [2, 4, D], [2, 4]), _maker('fpfp')),
        (_tr(transformer.TransformerDecoderLayer, pre_layer_norm=False,
             ffn_init_scale=0.5),
         ([2, 5, D], [2, 5], [2, 4, D], [2, 4]), _maker('fpfp')),
    ],
}
