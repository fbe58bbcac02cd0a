"""A Transformer language model of the Bible's English side (KJV).

Data: the English verses of `bible_en_es` (the same held-out books: Ruth,
Ecclesiastes and John for validation; Esther, Daniel, Romans and Hebrews
for test), its joint 8k SentencePiece vocabulary, cut into blocks of 128
tokens (`lingvo_pipe.tasks.lm.input_generator`).

TransformerLmSmall is the 2-core quickstart model: 6 causal pre-LN layers,
d=256, the embedding tied to the softmax, K=2 stages × M=8 micro-batches of
32 blocks (4,096 tokens a step) without recompute. Sized for a 60-minute
run on 2 stage processes:

    python -m lingvo_pipe.launch --num_stages=2 -- \\
        --model=lm.bible_en.TransformerLmSmall --logdir=/tmp/lm \\
        --max_train_minutes=60

TransformerLmSmallUntied is the same with a separate softmax matrix (the
comparison a tie should not lose). TransformerLmDeep is GPipe's Pipeline-8
Transformer-L as a decoder-only LM: 103 layers of d=2048, K=8 stages × M=32
(`--mode=inspect_params` plans it and prints its parameters beside the
paper's rows); it is for accelerators, not this CPU.
"""

from lingvo_pipe.core import base_model
from lingvo_pipe.core import model_registry
from lingvo_pipe.tasks.lm import input_generator
from lingvo_pipe.tasks.lm import layers
from lingvo_pipe.tasks.lm import model


class _BibleLm(base_model.SingleTaskModelParams):
  """Shared recipe; the registered subclasses set the numbers."""

  VOCAB_SIZE = 8000  # lingvo_pipe.tasks.mt.vocab.DEFAULT_VOCAB_SIZE.
  MAX_LEN = 128  # Tokens per block (~4 verses of context).
  MODEL_DIM = 256
  NUM_HEADS = 4
  HIDDEN_DIM = 1024
  NUM_LAYERS = 6
  DROPOUT = 0.1
  FFN_INIT_SCALE = 1.0
  LOGITS_ABS_MAX = 0.0
  TIE_EMBEDDINGS = True  # Softmax weights = embedding table ᵀ.
  BATCH_SIZE = 32  # Blocks per step.
  EVAL_BATCH_SIZE = 64
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 4
  RECOMPUTE = 'always'
  LEARNING_RATE = 1e-3  # Peak, after the warm-up; then 1/sqrt(step).
  WARMUP_STEPS = 200
  MAX_STEPS = 3000  # More than 60 minutes on 2 cores: the clock stops it.
  SAVE_INTERVAL_STEPS = 100

  def _Input(self, split: str, batch_size: int):
    return input_generator.BibleLmInput.Params().Set(
        name=f'bible_en_{split}', split=split, batch_size=batch_size,
        max_len=self.MAX_LEN)

  def Train(self):
    return self._Input('train', self.BATCH_SIZE)

  def Dev(self):
    return self._Input('validation', self.EVAL_BATCH_SIZE)

  def Test(self):
    return self._Input('test', self.EVAL_BATCH_SIZE)

  def Task(self):
    p = model.LanguageModelTask.Params().Set(name='lm')
    p.pipeline.Set(
        name='transformer', num_stages=self.NUM_STAGES,
        num_micro_batches=self.NUM_MICRO_BATCHES, recompute=self.RECOMPUTE,
        input_shapes=[[self.BATCH_SIZE, self.MAX_LEN]] * 2,
        tied_weights=model.lm_ties() if self.TIE_EMBEDDINGS else [],
        layers=layers.lm_layers(
            vocab_size=self.VOCAB_SIZE, model_dim=self.MODEL_DIM,
            num_heads=self.NUM_HEADS, hidden_dim=self.HIDDEN_DIM,
            num_layers=self.NUM_LAYERS, dropout_prob=self.DROPOUT,
            ffn_init_scale=self.FFN_INIT_SCALE,
            logits_abs_max=self.LOGITS_ABS_MAX))
    p.train.Set(
        optimizer='adam', adam_beta1=0.9, adam_beta2=0.98, epsilon=1e-9,
        learning_rate=self.LEARNING_RATE, lr_schedule='rsqrt',
        lr_warmup_steps=self.WARMUP_STEPS, clip_gradient_norm=1.0,
        max_steps=self.MAX_STEPS,
        save_interval_steps=self.SAVE_INTERVAL_STEPS,
        summary_interval_steps=10)
    return p


@model_registry.RegisterSingleTaskModel
class TransformerLmSmall(_BibleLm):
  """6 causal layers, d=256, 4 heads, ffn 1024, tied; K=2, M=8, no
  recompute."""

  # On 2 stage processes of a 2-core Xeon (no AMX), steps 9-16: 1.7 s at
  # M=8 without recompute, 3.0 s at M=4 with it, the same loss (8.4172 at
  # step 16); the activations fit easily (2026-11-26).
  NUM_MICRO_BATCHES = 8
  RECOMPUTE = 'never'


@model_registry.RegisterSingleTaskModel
class TransformerLmSmallUntied(TransformerLmSmall):
  """TransformerLmSmall with its own softmax matrix (2M more weights)."""

  TIE_EMBEDDINGS = False


@model_registry.RegisterSingleTaskModel
class TransformerLmDeep(_BibleLm):
  """GPipe's Transformer-L of Pipeline-8 (Table 1) as a decoder-only LM:
  103 layers, d=2048, 32 heads, ffn 8192, a 32k vocabulary (the paper's;
  the prepared one uses its first 8k ids); K=8, M=32, scaled-down
  feed-forward init and clipped logits (GPipe's deep recipe)."""

  VOCAB_SIZE = 32000
  MAX_LEN = 256
  MODEL_DIM = 2048
  NUM_HEADS = 32
  HIDDEN_DIM = 8192
  NUM_LAYERS = 103
  FFN_INIT_SCALE = 103 ** -0.5  # ~1/sqrt(layers): keeps residual sums O(1).
  LOGITS_ABS_MAX = 20.0
  BATCH_SIZE = 256
  NUM_STAGES = 8
  NUM_MICRO_BATCHES = 32
  LEARNING_RATE = 5e-4
  WARMUP_STEPS = 4000
  MAX_STEPS = 100000
  SAVE_INTERVAL_STEPS = 1000
