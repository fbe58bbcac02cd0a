"""LanguageModelTask: a decoder-only Transformer trained through GPipe.

    logits = pipeline(ids, paddings)                      # [B, T, V]
    loss   = Σ_tokens w · xent(logits, labels) / Σ_tokens w   (w = 1 − paddings)

The loss is computed in the last stage, micro-batch by micro-batch
(PipelinedTask), as the token mean; its exponential is the perplexity,
which the trainer's summaries and the evaler's aggregate report beside
`log_pplx` (the mean over every token of the batch, or of the split).

`InspectParams` adds the parameter count, a tied weight counted once, beside
the Transformer rows of the GPipe paper's Table 1, so a deep config can be
compared with the paper's before anything is built.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_pipe.core import base_model
from lingvo_pipe.core import pipelined_task
from lingvo_pipe.core import tied_weights
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import plan as plan_lib
from lingvo_pipe.tasks.mt import model as mt_model

# GPipe (Huang et al., 2019), Table 1: Transformer-L on TPUv3 (16 GB),
# (configuration, layers, parameters).
GPIPE_TRANSFORMER_ROWS = (('Naive-1', 3, 282.2e6), ('Pipeline-1', 13, 785.8e6),
                          ('Pipeline-8', 103, 5.3e9),
                          ('Pipeline-32', 415, 21.0e9),
                          ('Pipeline-128', 1663, 83.9e9))


def lm_ties() -> list[Params]:
  """`tied_weights` of `layers.lm_layers`: softmax = embedding table ᵀ."""
  return [tied_weights.tie('softmax.softmax.w', 'emb.emb.emb',
                           transpose=True)]


def _parameters(pipeline: Params) -> tuple[int, int]:
  """(parameters counted once, of which tied) from FPropMeta, no build."""
  shapes = pipeline.input_shapes or [[1, 2], [1, 2]]
  metas = plan_lib.layer_metas(list(pipeline.layers), shapes)
  total = sum(m.param_bytes // lp.dtype.size
              for m, lp in zip(metas, pipeline.layers))
  tied = 0
  for t in pipeline.tied_weights:  # The sharer's FPropMeta counts it again.
    owner = pipeline.layers[[lp.name for lp in pipeline.layers].index(
        t.owner.split('.')[0])]
    tied += owner.vocab_size * owner.model_dim  # Embedding tables.
  return total - tied, tied


class LanguageModelTask(pipelined_task.PipelinedTask):
  """Token ids → next-token logits through `p.pipeline`."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('label_smoothing', 0.0, 'ε of the training loss; log_pplx is '
             'reported without it.')
    return p

  @classmethod
  def PipelineInputs(cls, batch: NestedMap) -> tuple[tf.Tensor, ...]:
    return (tf.cast(batch.ids, tf.int32), tf.cast(batch.paddings, tf.float32))

  @classmethod
  def LossInputs(cls, batch: NestedMap) -> NestedMap:
    return NestedMap(labels=batch.labels, paddings=batch.paddings)

  def ComputeLoss(self, theta: NestedMap, predictions: tf.Tensor,
                  batch: NestedMap) -> base_model.Metrics:
    """Token means, each weighted by the number of (unpadded) tokens."""
    del theta
    return mt_model.token_metrics(predictions, batch.labels, batch.paddings,
                                  self.params.label_smoothing)

  def CreateEvalAggregator(self) -> 'PerplexityAggregator':
    return PerplexityAggregator()

  @classmethod
  def InspectParams(cls, p: Params, profile_inputs: Any = None) -> str:
    """The plan, then the parameters beside GPipe's Transformer rows."""
    text = super().InspectParams(p, profile_inputs)
    pipeline = cls.PipelineParams(p)
    once, tied = _parameters(pipeline)
    lines = [f'Parameters: {once / 1e6:,.1f}M ({len(pipeline.layers) - 2} '
             f'Transformer layers; a tied {tied / 1e6:,.1f}M counted once), '
             f'K={pipeline.num_stages}, M={pipeline.num_micro_batches}.',
             'GPipe Table 1, Transformer-L (TPUv3, 16 GB): ' + ', '.join(
                 f'{name} {layers} layers {params / 1e9:.2f}B'
                 for name, layers, params in GPIPE_TRANSFORMER_ROWS) + '.']
    return text + '\n' + '\n'.join(lines)


class PerplexityAggregator(base_model.WeightedMeanAggregator):
  """Token means over the split, plus `perplexity` = exp(log_pplx)."""

  def Finalize(self) -> dict[str, float]:
    out = super().Finalize()
    if 'log_pplx' in out:
      out['perplexity'] = math.exp(min(out['log_pplx'], 700.0))
    return out
