"""TranslationTask: the loss against numpy, BLEU against sacrebleu, EvalStep."""

import math

import numpy as np
import pytest
import sacrebleu
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks.mt import input_generator
from lingvo_pipe.tasks.mt import model


def _np_smoothed_xent(logits, labels, weights, eps):
  """float64 reference: target 1−ε on the label, ε/(V−1) elsewhere."""
  logits = logits.astype(np.float64)
  v = logits.shape[-1]
  log_p = logits - logits.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  target = np.full(logits.shape, eps / (v - 1))
  np.put_along_axis(target, labels[..., None], 1.0 - eps, axis=-1)
  xent = -(target * log_p).sum(-1)
  return (xent * weights).sum() / weights.sum()


def test_loss_is_the_token_mean_of_smoothed_xent(tiny_task_params):
  task = tiny_task_params().Instantiate()
  rng = np.random.default_rng(0)
  logits = rng.normal(scale=3.0, size=(3, 5, 11)).astype(np.float32)
  labels = rng.integers(0, 11, size=(3, 5))
  paddings = np.zeros((3, 5), np.float32)
  paddings[1, 2:] = paddings[2, 4:] = 1.0
  batch = NestedMap(tgt_labels=tf.constant(labels, tf.int32),
                    tgt_paddings=tf.constant(paddings))
  metrics = task.ComputeLoss(task.theta, tf.constant(logits), batch)
  weights = 1.0 - paddings
  loss, num_tokens = (float(x) for x in metrics['loss'])
  assert num_tokens == weights.sum() == 11
  assert loss == pytest.approx(
      _np_smoothed_xent(logits, labels, weights, 0.1), rel=1e-5)
  assert float(metrics['log_pplx'][0]) == pytest.approx(
      _np_smoothed_xent(logits, labels, weights, 0.0), rel=1e-5)
  hits = (logits.argmax(-1) == labels) * weights
  assert float(metrics['token_accuracy'][0]) == pytest.approx(
      hits.sum() / weights.sum())


def test_bleu_aggregator_equals_sacrebleu(mt_data, mt_vocab):
  hyps = ['Y dijo Dios: Sea la luz.', 'Jehová es mi pastor.',
          'La gracia sea con vosotros.', 'Orad sin cesar.', '']
  refs = ['Y dijo Dios: Sea la luz.', 'Jehová es mi buen pastor.',
          'La gracia sea con todos vosotros. Amén.', 'Orad siempre.',
          'Y lloró Jesús.']
  agg = model.BleuAggregator(mt_data['vocab'])
  for lo, hi in ((0, 2), (2, 5)):  # Two eval batches of unequal size.
    ids = np.zeros((hi - lo, 24), np.int32)
    for row, text in enumerate(hyps[lo:hi]):
      encoded = mt_vocab.encode(text)
      ids[row, :len(encoded)] = encoded
    refs_bytes = np.array([r.encode('utf-8') for r in refs[lo:hi]], object)
    agg.Update(NestedMap(tgt_text=refs_bytes), NestedMap(
        hyp_ids=ids, loss=(np.float32(2.0 + lo), np.float32(hi - lo)),
        log_pplx=(np.float32(1.0 + lo), np.float32(hi - lo))))
  result = agg.Finalize()
  assert agg.hypotheses == hyps and agg.references == refs
  assert result['bleu'] == sacrebleu.corpus_bleu(hyps, [refs]).score
  assert 0 < result['bleu'] < 100
  assert result['loss'] == pytest.approx((2.0 * 2 + 4.0 * 3) / 5)
  assert result['perplexity'] == pytest.approx(
      math.exp((1.0 * 2 + 3.0 * 3) / 5))
  assert result['num_sentences'] == 5


@pytest.mark.parametrize('beam_size,fprop_dtype', [(1, None), (2, None),
                                                   (2, tf.bfloat16)])
def test_eval_step_decodes_every_dev_sentence(mt_data, tiny_task_params,
                                              beam_size, fprop_dtype):
  gen = input_generator.BibleTranslationInput.Params().Set(
      split='validation', batch_size=4, max_len=32, tsv_path=mt_data['dev'],
      vocab_path=mt_data['vocab']).Instantiate()
  task = tiny_task_params(batch_size=4, max_len=32, beam_size=beam_size,
                          fprop_dtype=fprop_dtype).Instantiate()

  @tf.function(reduce_retracing=True)  # As the evaler runs it.
  def eval_step(batch):
    with fprop_context.scope(training=False):
      return task.EvalStep(task.theta, batch)

  agg = task.CreateEvalAggregator()
  for batch in gen.EvalDataset():  # 11 pairs: batches of 4, 4 and 3.
    out = eval_step(batch)
    assert out.hyp_ids.shape == (batch.src_ids.shape[0], 32)
    agg.Update(tf.nest.map_structure(lambda t: t.numpy(), batch),
               tf.nest.map_structure(lambda t: t.numpy(), out))
  result = agg.Finalize()
  assert result['num_sentences'] == gen.num_examples == 11
  assert 0.0 <= result['bleu'] <= 100.0
  assert np.isfinite(result['loss']) and result['perplexity'] > 1.0
  assert set(result) >= {'loss', 'log_pplx', 'token_accuracy', 'bleu'}


def test_bad_decoding_params_name_the_fix(tiny_task_params):
  with pytest.raises(base_layer.LayerError, match='beam_size'):
    tiny_task_params(beam_size=0).Instantiate()


def test_summaries_and_inspect(tiny_task_params):
  task = tiny_task_params().Instantiate()
  assert set(task.Summaries()) == {'pipeline/partition_imbalance',
                                   'pipeline/bubble_fraction'}
  assert 'bubble' in task.Inspect()
