"""The Transformer LM: blocks of text, a causal tied model, its configs.

The registered configs train here as subclasses with tiny numbers on the
fixture verses (conftest.py); everything else (layer list, tie, pipeline,
optimizer) is the config's own code.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe import trainer as trainer_lib
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import model_registry
from lingvo_pipe.core.hyperparams import Params
from lingvo_pipe.params.lm import bible_en
from lingvo_pipe.tasks.lm import input_generator
from lingvo_pipe.tasks.mt import vocab as vocab_lib

SMALL = 'lm.bible_en.TransformerLmSmall'
UNTIED = 'lm.bible_en.TransformerLmSmallUntied'
DEEP = 'lm.bible_en.TransformerLmDeep'
_TINY = dict(VOCAB_SIZE=96, MAX_LEN=8, MODEL_DIM=16, NUM_HEADS=2,
             HIDDEN_DIM=32, NUM_LAYERS=2, BATCH_SIZE=4, EVAL_BATCH_SIZE=4,
             NUM_MICRO_BATCHES=4)


def test_blocks_predict_every_token_but_the_first_once(lm_data):
  gen = input_generator.BibleLmInput.Params().Set(
      split='test', max_len=8, text_path=lm_data['text'],
      vocab_path=lm_data['vocab'], batch_size=4).Instantiate()
  arrays = gen.Arrays()
  vocab = vocab_lib.Vocab(lm_data['vocab'])
  with open(lm_data['text'], encoding='utf-8') as f:
    stream = [vocab_lib.EOS_ID] + [i for line in f for i in vocab.encode(
        line.strip(), add_eos=False) + [vocab_lib.EOS_ID]]
  kept = arrays['paddings'] == 0
  assert arrays['labels'][kept].tolist() == stream[1:]
  assert arrays['ids'][kept].tolist() == stream[:-1]
  train = gen.params.Copy().Set(split='train').Instantiate().Arrays()
  assert (train['paddings'] == 0).all()  # The partial block is dropped.
  assert len(train['ids']) == (len(stream) - 1) // 8


def _tiny(cls, lm_data, **overrides):
  tiny = type(f'Tiny{cls.__name__}', (cls,), dict(_TINY, **overrides))()
  params = Params()
  params.Define('model', cls.__name__, 'Name.')
  params.Define('task', tiny.Task(), 'Task.')
  params.Define('input', tiny.Train(), 'Input.')
  params.FromText(f'input.text_path : "{lm_data["text"]}"\n'
                  f'input.vocab_path : "{lm_data["vocab"]}"\n')
  return params


@pytest.mark.parametrize('cls', [bible_en.TransformerLmSmall,
                                 bible_en.TransformerLmSmallUntied])
def test_small_configs_train_and_evaluate(cls, lm_data, tmp_path):
  params = _tiny(cls, lm_data)
  params.task.train.max_steps = 3
  run = trainer_lib.Trainer(params, str(tmp_path))
  names = [v.name for v in run.task.trainable_variables]
  tied = cls.TIE_EMBEDDINGS
  assert any('softmax.softmax/w' in n for n in names) != tied
  before = [v.numpy() for v in run.task.trainable_variables]
  assert run.restore() == 0
  writer = tf.summary.create_file_writer(str(tmp_path / 'train'))
  run.train(params.input.Instantiate(), writer)
  writer.close()
  after = [v.numpy() for v in run.task.trainable_variables]
  assert all(not np.array_equal(a, b) for a, b in zip(after, before))
  # The trainer's summaries: log-perplexity and perplexity of the step.
  logged = {v.tag: float(tf.make_ndarray(v.tensor))
            for path in (tmp_path / 'train').glob('events*')
            for event in tf.compat.v1.train.summary_iterator(str(path))
            for v in event.summary.value}
  assert logged['perplexity'] == pytest.approx(math.exp(logged['log_pplx']),
                                               rel=1e-5)
  # Evaluation: the token mean over the split and its exponential.
  gen = params.input.Copy().Set(split='test').Instantiate()
  agg = run.task.CreateEvalAggregator()
  for batch in gen.EvalDataset():
    with fprop_context.scope(training=False):
      agg.Update(batch, run.task.EvalStep(run.task.theta, batch))
  out = agg.Finalize()
  assert out['perplexity'] == pytest.approx(math.exp(out['log_pplx']))
  assert 1 < out['perplexity'] < 2 * 96  # Near uniform after 3 steps.


def test_configs_are_registered_and_round_trip():
  for name in (SMALL, UNTIED, DEEP):
    p = model_registry.get_params(name, 'Train')
    again = model_registry.get_params(name, 'Train')
    again.task.train.learning_rate = 123.0
    again.FromText(p.ToText())
    assert again == p
  assert model_registry.get_params(UNTIED, 'Train').task.pipeline.tied_weights \
      == []
  p = model_registry.get_params(DEEP, 'Train').task.pipeline
  assert (p.num_stages, p.num_micro_batches) == (8, 32)


def test_deep_config_is_planned_beside_gpipes_rows():
  params = model_registry.get_params(DEEP, 'Train')
  text = params.task.cls.InspectParams(params.task)
  assert '8 devices' in text
  assert 'Pipeline-8 103 layers 5.30B' in text
  line = [l for l in text.splitlines() if l.startswith('Parameters:')][0]
  millions = float(line.split()[1].rstrip('M').replace(',', ''))
  assert 5.1e3 < millions < 5.3e3, line  # 103 layers of d=2048, tied.
  assert '103 Transformer layers' in line
