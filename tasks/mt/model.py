"""TranslationTask: an encoder-decoder Transformer trained through GPipe.

    logits  = pipeline(src_ids, src_paddings, tgt_ids, tgt_paddings)  # [B,T,V]
    loss    = Σ_tokens w · xent_ε(logits, tgt_labels) / Σ_tokens w
              (w = 1 − tgt_paddings, ε = label_smoothing)

In training the loss is computed in the pipeline's last stage, micro-batch
by micro-batch (PipelinedTask), as a weighted mean: the engine combines
each micro-batch's (token mean, number of tokens) into the token mean over
the whole batch, and its gradient, exactly.

Evaluation (`EvalStep`, inference mode) computes the teacher-forced metrics
and decodes the source (greedy, or beam search with `beam_size` > 1); the
aggregator detokenises the hypotheses with SentencePiece and scores corpus
BLEU with sacrebleu against the raw references of the whole split.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_pipe import extras

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import base_model
from lingvo_pipe.core import gpipe
from lingvo_pipe.core import pipelined_task
from lingvo_pipe.core import tied_weights
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import softmax
from lingvo_pipe.tasks.mt import decoder
from lingvo_pipe.tasks.mt import layers as mt_layers
from lingvo_pipe.tasks.mt import vocab as vocab_lib


def transformer_layers(vocab_size: int, model_dim: int, num_heads: int,
                       hidden_dim: int, num_encoder_layers: int,
                       num_decoder_layers: int, dropout_prob: float = 0.1,
                       atten_dropout_prob: float = 0.0,
                       ffn_init_scale: float = 1.0,
                       logits_abs_max: float = 0.0,
                       pre_layer_norm: bool = True,
                       fprop_dtype: tf.DType | None = None,
                       share_embedding: bool = True
                      ) -> list[InstantiableParams]:
  """The pipeline's layer list (see `lingvo_pipe.tasks.mt.layers`), pre-LN by default.

  Post-LN stacks (`pre_layer_norm=False`) normalise after every residual
  add, so they get no final norms. `fprop_dtype` (e.g. tf.bfloat16) is the
  compute dtype of every layer; variables stay float32, and layer norms,
  softmaxes and the loss compute in float32 regardless. `share_embedding`:
  one table for source and target (a joint vocabulary); `softmax_ties`
  then ties the softmax to it too.
  """
  common = dict(input_dim=model_dim, num_heads=num_heads,
                hidden_dim=hidden_dim, pre_layer_norm=pre_layer_norm,
                residual_dropout_prob=dropout_prob,
                relu_dropout_prob=dropout_prob,
                atten_dropout_prob=atten_dropout_prob,
                ffn_init_scale=ffn_init_scale)
  out = [mt_layers.SourceTargetEmbedding.Params().Set(
      name='emb', vocab_size=vocab_size, model_dim=model_dim,
      dropout_prob=dropout_prob, share_embedding=share_embedding)]
  out += [mt_layers.EncoderLayer.Params().Set(name=f'enc{i}', **common)
          for i in range(num_encoder_layers)]
  if pre_layer_norm:
    out.append(mt_layers.EncoderFinalNorm.Params().Set(
        name='enc_norm', input_dim=model_dim))
  out += [mt_layers.DecoderLayer.Params().Set(name=f'dec{i}', **common)
          for i in range(num_decoder_layers)]
  out.append(mt_layers.DecoderSoftmax.Params().Set(
      name='softmax', input_dim=model_dim, vocab_size=vocab_size,
      final_layer_norm=pre_layer_norm, logits_abs_max=logits_abs_max))
  for p in out:
    p.fprop_dtype = fprop_dtype
  return out


def softmax_ties() -> list[Params]:
  """The pipeline's `tied_weights` for a joint vocabulary: the softmax's
  weights [D, V] are the (shared) embedding table [V, D] transposed, as in
  the Transformer and Lingvo's MT models (Press & Wolf, 2017)."""
  return [tied_weights.tie('softmax.softmax.w', 'emb.src_emb.emb',
                           transpose=True)]


def input_shapes(batch_size: int, max_len: int) -> list[list[int]]:
  """`input_shapes` of the pipeline: src ids/paddings, tgt ids/paddings."""
  return [[batch_size, max_len]] * 4


def layer_costs(layers: list[InstantiableParams], batch_size: int,
                max_len: int) -> list[float]:
  """FPropMeta flops of each layer at [batch_size, max_len].

  The pipeline's `costs` when batches come in several shapes (length
  buckets): `input_shapes` must then stay None (the pipeline would check
  every batch against one shape), so the partition needs costs given.
  """
  metas = gpipe.layer_metas(layers, input_shapes(batch_size, max_len))
  return [float(m.flops) for m in metas]


def pipeline_inputs(batch: NestedMap) -> tuple[tf.Tensor, ...]:
  """(src_ids int32, src_paddings, tgt_ids int32, tgt_paddings float32)."""
  return (tf.cast(batch.src_ids, tf.int32),
          tf.cast(batch.src_paddings, tf.float32),
          tf.cast(batch.tgt_ids, tf.int32),
          tf.cast(batch.tgt_paddings, tf.float32))


def token_metrics(logits: tf.Tensor, labels: tf.Tensor, paddings: tf.Tensor,
                  label_smoothing: float) -> base_model.Metrics:
  """A sequence model's metrics: token means, each weighted by the number
  of unpadded tokens: the training loss (label-smoothed), its unsmoothed
  log-perplexity, and the argmax's accuracy."""
  weights = 1.0 - tf.cast(paddings, tf.float32)
  loss, num_tokens = softmax.mean_softmax_cross_entropy(
      logits, labels, weights, label_smoothing)
  log_pplx = loss
  if label_smoothing > 0:
    log_pplx, _ = softmax.mean_softmax_cross_entropy(logits, labels, weights)
  hits = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                          tf.cast(labels, tf.int32)), tf.float32)
  accuracy = tf.math.divide_no_nan(tf.reduce_sum(hits * weights), num_tokens)
  return {'loss': (loss, num_tokens),
          'log_pplx': (tf.stop_gradient(log_pplx), num_tokens),
          'token_accuracy': (accuracy, num_tokens)}


class TranslationTask(pipelined_task.PipelinedTask):
  """Source ids → target logits through `p.pipeline`; decodes in eval."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('label_smoothing', 0.1, 'ε of the training loss (the '
             'Transformer\'s 0.1); log_pplx is reported without it.')
    p.Define('beam_size', 1, 'Decoding in eval: 1 = greedy, K > 1 = beam '
             'search with K beams (about K times slower).')
    p.Define('length_penalty', 0.6, 'α of GNMT\'s ((5 + n) / 6)^α in beam '
             'search (0 = none; greedy ignores it).')
    p.Define('max_decode_len', 64, 'Longest hypothesis in pieces, EOS '
             'included (the cache length of every decoder layer).')
    p.Define('vocab_path', '', 'SentencePiece model that detokenises '
             'hypotheses for BLEU; "" = the prepared one.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    if p.beam_size < 1 or p.max_decode_len < 1 or p.length_penalty < 0:
      raise base_layer.LayerError(
          f'{self.path}: need beam_size ≥ 1, max_decode_len ≥ 1 and '
          f'length_penalty ≥ 0, got {p.beam_size}, {p.max_decode_len} and '
          f'{p.length_penalty}; e.g. 4, 64 and 0.6.')
    self._decoder = decoder.PipelineDecoder(self.children.pipeline)

  # ---- Training -------------------------------------------------------------
  @classmethod
  def PipelineInputs(cls, batch: NestedMap) -> tuple[tf.Tensor, ...]:
    """→ logits [B, T, V] of the teacher-forced decoder."""
    return pipeline_inputs(batch)

  @classmethod
  def LossInputs(cls, batch: NestedMap) -> NestedMap:
    return NestedMap(tgt_paddings=batch.tgt_paddings,
                     tgt_labels=batch.tgt_labels)

  def ComputeLoss(self, theta: NestedMap, predictions: tf.Tensor,
                  batch: NestedMap) -> base_model.Metrics:
    """Token means, each weighted by the number of target tokens."""
    del theta
    return token_metrics(predictions, batch.tgt_labels, batch.tgt_paddings,
                         self.params.label_smoothing)

  # ---- Decoding ------------------------------------------------------------
  def Decode(self, theta: NestedMap, src_ids: tf.Tensor,
             src_paddings: tf.Tensor) -> tf.Tensor:
    """Hypothesis ids [B, max_decode_len] (EOS, then PAD), in inference."""
    p = self.params
    k, max_len = p.beam_size, p.max_decode_len
    batch_size = tf.shape(src_ids)[0]
    memory = self._decoder.encode(theta.pipeline, src_ids, src_paddings)
    if k > 1:  # Row b·K + j is beam j of sentence b.
      memory = tf.repeat(memory, k, axis=0)
      src_paddings = tf.repeat(src_paddings, k, axis=0)
    step_fn, state = self._decoder.step_fn(theta.pipeline, memory,
                                           src_paddings, max_len)
    if k == 1:
      return decoder.greedy_search(step_fn, state, batch_size, max_len)
    return decoder.beam_search(step_fn, state, batch_size, k, max_len,
                               p.length_penalty).ids

  def EvalStep(self, theta: NestedMap, batch: NestedMap) -> NestedMap:
    """Teacher-forced metrics plus `hyp_ids` [B, max_decode_len]."""
    out = NestedMap(self.FProp(theta, batch))
    out.hyp_ids = self.Decode(theta, batch.src_ids, batch.src_paddings)
    return out

  def CreateEvalAggregator(self) -> 'BleuAggregator':
    return BleuAggregator(self.params.vocab_path or None)


class BleuAggregator(base_model.WeightedMeanAggregator):
  """Weighted means of the metrics, plus corpus BLEU of the hypotheses.

  Hypotheses are detokenised with the SentencePiece model and scored with
  `sacrebleu.corpus_bleu(hyps, [refs])` (its default 13a tokenisation) over
  every sentence the evaler fed, against the raw references `tgt_text`.
  Finalize adds `bleu`, `perplexity` = exp(log_pplx) and `num_sentences`.
  """

  def __init__(self, vocab_path: Any = None) -> None:
    super().__init__()
    self._sacrebleu = extras.require('sacrebleu', 'mt', 'BLEU scoring')
    self._vocab = vocab_lib.Vocab(vocab_path)
    self.hypotheses: list[str] = []
    self.references: list[str] = []

  def Update(self, batch: NestedMap, outputs: NestedMap) -> None:
    super().Update(batch, outputs)
    for ids, ref in zip(np.asarray(outputs.hyp_ids),
                        np.asarray(batch.tgt_text)):
      self.hypotheses.append(self._vocab.decode(ids))
      self.references.append(ref.decode('utf-8') if isinstance(ref, bytes)
                             else str(ref))

  def Finalize(self) -> dict[str, float]:
    out = super().Finalize()
    if 'log_pplx' in out:
      out['perplexity'] = math.exp(min(out['log_pplx'], 700.0))
    out['bleu'] = float(self._sacrebleu.corpus_bleu(
        self.hypotheses, [self.references]).score)
    out['num_sentences'] = float(len(self.hypotheses))
    return out
