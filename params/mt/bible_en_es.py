"""English → Spanish Bible verses (KJV → Reina-Valera 1909), Transformer.

Data: 27,858 training verse pairs, 1,186 dev and 1,260 test (held-out
books), a joint 8k SentencePiece vocabulary; ~33 pieces per verse, ~97% of
the training pairs fit in 64 pieces (the rest are dropped in training).

TransformerSmall is the CPU default: a pre-LN 3+3-layer d=256 Transformer
cut into 2 stages, 8 micro-batches per step without recompute, batches in 3
length buckets. TransformerSmallBf16 is the same in bfloat16 compute,
faster on CPUs with bfloat16 units (AMX, AVX512-BF16). A 60-minute run of
TransformerSmallBf16 on 2 cores (`--max_train_minutes=60`: 1,971 steps,
~7.5 epochs, embeddings then untied) scored test BLEU 17.3 and dev BLEU
19.4 (greedy, sacrebleu); `--max_steps=1971` trains the same steps (README
lists the commands); the registered MAX_STEPS stops at 1000. Source
embedding, target embedding and softmax share one table, as the vocabulary
is joint (TIE_EMBEDDINGS; an untied variant is a subclass with
TIE_EMBEDDINGS = False).

TransformerDeep is GPipe's deep recipe for accelerators: 24+24 layers, 8 stages × 32 micro-batches, scaled-down feed-forward init and clipped logits.

Each config is class attributes, so a variant is a subclass that changes a
few numbers (the tests train tiny ones).
"""

import tensorflow as tf

from lingvo_pipe.core import base_model
from lingvo_pipe.core import model_registry
from lingvo_pipe.tasks.mt import input_generator
from lingvo_pipe.tasks.mt import model


class _BibleTransformer(base_model.SingleTaskModelParams):
  """Shared recipe; the registered subclasses set the numbers."""

  VOCAB_SIZE = 8000  # lingvo_pipe.tasks.mt.vocab.DEFAULT_VOCAB_SIZE: the prepared model.
  MAX_LEN = 64  # Pieces per side, EOS included.
  MODEL_DIM = 256
  NUM_HEADS = 4
  HIDDEN_DIM = 1024
  NUM_ENCODER_LAYERS = 3
  NUM_DECODER_LAYERS = 3
  DROPOUT = 0.1
  FFN_INIT_SCALE = 1.0
  LOGITS_ABS_MAX = 0.0
  FPROP_DTYPE = None  # Compute dtype; None = float32 (variables: float32).
  # One table for source and target embeddings and the softmax (the
  # vocabulary is joint); False: three tables.
  TIE_EMBEDDINGS = True
  BATCH_SIZE = 64  # Sentence pairs per step.
  # Length buckets ((padded length, pairs per step), ...); () = every batch
  # [BATCH_SIZE, MAX_LEN]. With buckets, BATCH_SIZE is the mean pairs per
  # step (what the trainer's examples/s counts).
  BUCKETS = ()
  EVAL_BATCH_SIZE = 128
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 4
  RECOMPUTE = 'always'
  LEARNING_RATE = 1e-3  # Peak, after the warm-up; then 1/sqrt(step).
  WARMUP_STEPS = 200
  MAX_STEPS = 1000
  SAVE_INTERVAL_STEPS = 100

  def _Input(self, split: str, batch_size: int):
    return input_generator.BibleTranslationInput.Params().Set(
        name=f'bible_{split}', split=split, batch_size=batch_size,
        max_len=self.MAX_LEN)

  def Train(self):
    p = self._Input('train', self.BATCH_SIZE)
    p.bucket_upper_bounds = [bound for bound, _ in self.BUCKETS]
    p.bucket_batch_sizes = [size for _, size in self.BUCKETS]
    return p

  def Dev(self):
    return self._Input('validation', self.EVAL_BATCH_SIZE)

  def Test(self):
    return self._Input('test', self.EVAL_BATCH_SIZE)

  def Task(self):
    p = model.TranslationTask.Params().Set(
        name='translator', max_decode_len=self.MAX_LEN)
    layers = model.transformer_layers(
        vocab_size=self.VOCAB_SIZE, model_dim=self.MODEL_DIM,
        num_heads=self.NUM_HEADS, hidden_dim=self.HIDDEN_DIM,
        num_encoder_layers=self.NUM_ENCODER_LAYERS,
        num_decoder_layers=self.NUM_DECODER_LAYERS,
        dropout_prob=self.DROPOUT, ffn_init_scale=self.FFN_INIT_SCALE,
        logits_abs_max=self.LOGITS_ABS_MAX, fprop_dtype=self.FPROP_DTYPE,
        share_embedding=self.TIE_EMBEDDINGS)
    p.pipeline.Set(
        name='transformer', layers=layers, num_stages=self.NUM_STAGES,
        num_micro_batches=self.NUM_MICRO_BATCHES, recompute=self.RECOMPUTE,
        tied_weights=model.softmax_ties() if self.TIE_EMBEDDINGS else [])
    if self.BUCKETS:  # Several shapes: costs at the longest bucket.
      p.pipeline.costs = model.layer_costs(layers, self.BUCKETS[-1][1],
                                           self.BUCKETS[-1][0])
    else:
      p.pipeline.input_shapes = model.input_shapes(self.BATCH_SIZE,
                                                   self.MAX_LEN)
    p.train.Set(
        optimizer='adam', adam_beta1=0.9, adam_beta2=0.98, epsilon=1e-9,
        learning_rate=self.LEARNING_RATE, lr_schedule='rsqrt',
        lr_warmup_steps=self.WARMUP_STEPS, clip_gradient_norm=1.0,
        max_steps=self.MAX_STEPS,
        save_interval_steps=self.SAVE_INTERVAL_STEPS,
        summary_interval_steps=10)
    return p


@model_registry.RegisterSingleTaskModel
class TransformerSmall(_BibleTransformer):
  """3+3 layers, d=256, 4 heads, ffn 1024; K=2 stages, M=4.

  Length buckets of ~4k padded tokens per step: verses average 33 pieces,
  so one [64, 64] shape would spend half of every step on padding. An epoch
  is then 262 steps (108 + 98 + 56) instead of 422, about 1.6× faster.
  """

  BUCKETS = ((32, 128), (48, 96), (64, 64))
  BATCH_SIZE = 103  # 27,003 pairs / 262 steps per epoch.
  # M=8 without recompute: on a 2-core Xeon (AVX512-BF16, no AMX), steady
  # steps of 2.32 s on 2 stage processes and 2.63 s in one process, against
  # 3.36 s and 3.07 s at M=4 with recompute (the bubble falls from 1/5 to
  # 1/9; recompute was a quarter of each stage's busy time, and these
  # activations fit easily). 2026-11-26: the median of steps 9-16 of
  # `--max_steps=16` runs, with `--model_params_override=
  # task.pipeline.num_micro_batches: 4; task.pipeline.recompute: 'always'`
  # for the old setting.
  NUM_MICRO_BATCHES = 8
  RECOMPUTE = 'never'


@model_registry.RegisterSingleTaskModel
class TransformerSmallBf16(TransformerSmall):
  """TransformerSmall computing in bfloat16 (weights, norms, softmax, loss
  stay float32): on CPUs with AMX/AVX512-BF16 (oneDNN) steps took 0.5–0.75×
  the time, with the same loss per step. Slower on CPUs without them."""

  FPROP_DTYPE = tf.bfloat16


@model_registry.RegisterSingleTaskModel
class TransformerDeep(_BibleTransformer):
  """GPipe's deep Transformer: 24+24 layers, K=8 stages, M=32."""

  MODEL_DIM = 1024
  NUM_HEADS = 16
  HIDDEN_DIM = 4096
  NUM_ENCODER_LAYERS = 24
  NUM_DECODER_LAYERS = 24
  FFN_INIT_SCALE = 48 ** -0.5  # ~1/sqrt(layers): keeps residual sums O(1).
  LOGITS_ABS_MAX = 20.0
  BATCH_SIZE = 256
  NUM_STAGES = 8
  NUM_MICRO_BATCHES = 32
  LEARNING_RATE = 5e-4
  WARMUP_STEPS = 4000
  MAX_STEPS = 100000
  SAVE_INTERVAL_STEPS = 1000
