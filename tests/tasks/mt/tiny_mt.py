"""TransformerSmall with tiny numbers, registered for stage processes.

The launcher's workers find `tiny_mt.TinyTransformerSmall` on PYTHONPATH
(tests/tasks/mt/test_mt_stage_processes.py sets it); its data, vocabulary
and length buckets come in as overrides, as a user's would.
"""

from lingvo_pipe.core import model_registry
from lingvo_pipe.params.mt import bible_en_es


@model_registry.RegisterSingleTaskModel
class TinyTransformerSmall(bible_en_es.TransformerSmall):
  """1+1 layers of d=16; 3 buckets of 4 pairs (set by the test), M=2."""

  VOCAB_SIZE = 160
  MAX_LEN = 32
  MODEL_DIM = 16
  NUM_HEADS = 2
  HIDDEN_DIM = 32
  NUM_ENCODER_LAYERS = 1
  NUM_DECODER_LAYERS = 1
  BUCKETS = ((32, 4),)
  BATCH_SIZE = 4
  EVAL_BATCH_SIZE = 4
  NUM_MICRO_BATCHES = 2
  DROPOUT = 0.0  # Dropout masks are the same anyway; keep the test simple.
