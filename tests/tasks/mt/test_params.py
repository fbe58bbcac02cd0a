"""The registered translation configs: structure, and one training step each.

The registered configs are too big to train in a test, so each is trained
as a subclass with tiny numbers (depth, width, batch) on the fixture data;
everything else (layer list, pipeline, schedule, optimizer) is the
config's own code.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe import trainer as trainer_lib
from lingvo_pipe.core import gpipe
from lingvo_pipe.core import model_registry
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.params.mt import bible_en_es
from lingvo_pipe.tasks.mt import layers as mt_layers

from mt_testdata import PAIRS  # pylint: disable=g-bad-import-order

SMALL = 'mt.bible_en_es.TransformerSmall'
SMALL_BF16 = 'mt.bible_en_es.TransformerSmallBf16'
DEEP = 'mt.bible_en_es.TransformerDeep'


def test_both_configs_are_registered():
  assert {SMALL, SMALL_BF16, DEEP} <= set(model_registry.list_models())
  params = model_registry.get_params(SMALL, 'Dev')
  assert params.input.split == 'validation'
  assert params.task.pipeline.num_stages == 2  # task.pipeline.* overrides.


def test_deep_config_is_gpipes_recipe():
  p = model_registry.get_params(DEEP, 'Train').task
  kinds = [lp.cls for lp in p.pipeline.layers]
  assert kinds.count(mt_layers.EncoderLayer) == 24
  assert kinds.count(mt_layers.DecoderLayer) == 24
  assert (p.pipeline.num_stages, p.pipeline.num_micro_batches) == (8, 32)
  assert p.pipeline.layers[-1].logits_abs_max > 0
  assert p.pipeline.layers[1].ffn_init_scale < 1
  # Shapes check out over all 51 layers without building them.
  metas = gpipe.layer_metas(list(p.pipeline.layers), p.pipeline.input_shapes)
  assert metas[-1].out_shapes[0].as_list() == [256, 64, 8000]


@pytest.mark.parametrize('name', [SMALL, SMALL_BF16, DEEP])
def test_params_round_trip_through_text(name):
  p = model_registry.get_params(name, 'Train')
  again = model_registry.get_params(name, 'Train')
  again.task.train.learning_rate = 123.0
  again.FromText(p.ToText())
  assert again == p


_TINY = dict(VOCAB_SIZE=160, MAX_LEN=32, MODEL_DIM=16, NUM_HEADS=2,
             HIDDEN_DIM=32, BATCH_SIZE=8, EVAL_BATCH_SIZE=4)


def test_small_config_trains_on_length_buckets():
  p = model_registry.get_params(SMALL, 'Train')
  assert p.input.bucket_upper_bounds[-1] == p.input.max_len
  # Several shapes: no single input_shapes, the partition uses costs.
  assert p.task.pipeline.input_shapes is None
  assert len(p.task.pipeline.costs) == len(p.task.pipeline.layers)
  m = p.task.pipeline.num_micro_batches
  assert all(n % m == 0 for n in p.input.bucket_batch_sizes)


def _fixture_buckets(mt_vocab):
  """Two buckets of the fixture pairs, split at the median length."""
  lengths = sorted(max(len(mt_vocab.encode(en)), len(mt_vocab.encode(es)))
                   for en, es in PAIRS)
  return ((lengths[len(lengths) // 2], 4), (_TINY['MAX_LEN'], 4))


@pytest.mark.parametrize('cls,overrides', [
    # Buckets of 4 pairs: M 8 → 4.
    (bible_en_es.TransformerSmall, dict(NUM_ENCODER_LAYERS=1,
                                        NUM_DECODER_LAYERS=1,
                                        BUCKETS='fixture',
                                        NUM_MICRO_BATCHES=4)),
    (bible_en_es.TransformerSmallBf16, dict(NUM_ENCODER_LAYERS=1,
                                            NUM_DECODER_LAYERS=1,
                                            BUCKETS='fixture',
                                            NUM_MICRO_BATCHES=4)),
    # K=8 kept (over the 4 test devices, two stages each); M 32 → 4.
    (bible_en_es.TransformerDeep, dict(NUM_ENCODER_LAYERS=4,
                                       NUM_DECODER_LAYERS=4,
                                       NUM_MICRO_BATCHES=4)),
])
def test_one_training_step(cls, overrides, mt_data, mt_vocab, tmp_path):
  if overrides.get('BUCKETS') == 'fixture':
    overrides = dict(overrides, BUCKETS=_fixture_buckets(mt_vocab))
  tiny = type(f'Tiny{cls.__name__}', (cls,), dict(_TINY, **overrides))()
  params = Params()
  params.Define('model', cls.__name__, 'Name.')
  params.Define('task', tiny.Task(), 'Task.')
  params.Define('input', tiny.Train(), 'Input.')
  stages = params.task.pipeline.num_stages
  params.FromText(
      f'input.tsv_path : "{mt_data["train"]}"\n'
      f'input.vocab_path : "{mt_data["vocab"]}"\n'
      f'task.vocab_path : "{mt_data["vocab"]}"\n'
      'task.train.max_steps : 1\n')
  params.task.pipeline.devices = [f'/device:CPU:{k % 4}'
                                  for k in range(stages)]
  run = trainer_lib.Trainer(params, str(tmp_path))
  before = [v.numpy() for v in run.task.trainable_variables]
  assert run.restore() == 0
  writer = tf.summary.create_file_writer(str(tmp_path / 'train'))
  run.train(params.input.Instantiate(), writer)
  writer.close()
  assert int(run.step.numpy()) == 1
  after = [v.numpy() for v in run.task.trainable_variables]
  assert all(np.isfinite(a).all() for a in after)
  changed = [not np.array_equal(a, b) for a, b in zip(after, before)]
  assert all(changed), 'every weight gets a gradient'
  assert run.latest_checkpoint is not None
