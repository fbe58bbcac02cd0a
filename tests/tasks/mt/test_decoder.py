"""Greedy and beam search: consistent with the teacher-forced model, and
beam search finds what exhaustive search finds on a hand-made distribution."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import collective
from lingvo_pipe.pipeline import placement
from lingvo_pipe.tasks.mt import decoder
from lingvo_pipe.tasks.mt import model
from lingvo_pipe.tasks.mt import vocab

PAD, EOS, BOS = vocab.PAD_ID, vocab.EOS_ID, vocab.BOS_ID


def _source(rng, batch, length, vocab_size):
  lengths = np.array([length, length - 3, 2][:batch])
  ids = rng.integers(4, vocab_size, size=(batch, length))
  paddings = (np.arange(length)[None] >= lengths[:, None])
  ids[paddings] = PAD
  return tf.constant(ids, tf.int32), tf.constant(paddings, tf.float32)


def _randomise(task, seed=0):
  """Larger random weights: sharper, input-dependent distributions."""
  rng = np.random.default_rng(seed)
  for var in task.trainable_variables:
    var.assign(rng.normal(scale=0.5, size=var.shape))
  return task


def _teacher_forced(task, src_ids, src_paddings, hyp):
  """Log-probs [B, T, V] of the full (non-incremental) net fed `hyp`."""
  hyp = np.asarray(hyp)
  lengths = np.array([list(r).index(EOS) + 1 if EOS in r else len(r)
                      for r in hyp])
  tgt_ids = np.concatenate([np.full((len(hyp), 1), BOS), hyp[:, :-1]], 1)
  paddings = (np.arange(hyp.shape[1])[None] >= lengths[:, None])
  batch = NestedMap(src_ids=src_ids, src_paddings=src_paddings,
                    tgt_ids=tf.constant(tgt_ids, tf.int32),
                    tgt_paddings=tf.constant(paddings, tf.float32))
  logits = task.ComputePredictions(task.theta, batch)
  return tf.nn.log_softmax(logits).numpy(), lengths


@pytest.mark.parametrize('tied', [False, True])
def test_greedy_equals_argmax_of_teacher_forced_fprop(tiny_task_params, tied):
  """Also with the softmax tied to the embedding: decoding reads the table
  transposed, as the pipeline's forward does."""
  p = tiny_task_params(max_len=10)
  p.pipeline.tied_weights = model.softmax_ties() if tied else []
  task = _randomise(p.Instantiate())
  src_ids, src_paddings = _source(np.random.default_rng(1), 3, 10,
                                  task.params.pipeline.layers[0].vocab_size)
  hyp = task.Decode(task.theta, src_ids, src_paddings).numpy()
  log_probs, lengths = _teacher_forced(task, src_ids, src_paddings, hyp)
  assert lengths.max() >= 4  # A real sequence, not an immediate EOS.
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(log_probs[row, :n].argmax(-1),
                                  hyp[row, :n])
    assert (hyp[row, n:] == PAD).all()


def test_beam_of_one_is_greedy_and_scores_are_log_probs(tiny_task_params):
  task = _randomise(tiny_task_params(max_len=10).Instantiate(), seed=2)
  src_ids, src_paddings = _source(np.random.default_rng(3), 3, 10,
                                  task.params.pipeline.layers[0].vocab_size)
  dec = decoder.PipelineDecoder(task.children.pipeline)
  theta = task.theta.pipeline
  memory = dec.encode(theta, src_ids, src_paddings)
  step_fn, state = dec.step_fn(theta, memory, src_paddings, 10)
  greedy = decoder.greedy_search(step_fn, state, 3, 10).numpy()
  beam = decoder.beam_search(step_fn, state, 3, 1, 10, length_penalty=0.0)
  np.testing.assert_array_equal(beam.ids.numpy(), greedy)
  log_probs, lengths = _teacher_forced(task, src_ids, src_paddings, greedy)
  for row, n in enumerate(lengths):
    want = log_probs[row, np.arange(n), greedy[row, :n]].sum()
    assert beam.scores.numpy()[row] == pytest.approx(want, rel=1e-4)


# A second-order distribution over 6 ids (PAD, EOS, BOS, a, b, c) where
# greedy goes wrong: a (.5) is likelier than b (.4) first, but "b c EOS"
# (.4 × .9 × .95) beats every continuation of "a". The state carries the
# token before the previous one, so it only works if beams reorder it.
A, B_, C = 3, 4, 5
V = 6


def _table():
  table = np.full((V, V, V), 0.1)
  table[:, :, EOS] = 0.5
  table[BOS, BOS] = [0.0, 0.0, 0.0, 0.5, 0.4, 0.1]
  table[BOS, A] = [0.0, 0.1, 0.0, 0.34, 0.28, 0.28]
  table[BOS, B_] = [0.0, 0.05, 0.0, 0.0, 0.05, 0.9]
  table[B_, C] = [0.0, 0.95, 0.0, 0.0, 0.05, 0.0]
  table[A, :, EOS] = 0.3
  table = np.maximum(table, 1e-6)
  return table / table.sum(-1, keepdims=True)


def _markov_step_fn(table):
  log_table = tf.constant(np.log(table), tf.float32)

  def step(ids_t, t, state):
    del t
    return tf.gather_nd(log_table, tf.stack([state, ids_t], 1)), ids_t

  return step


def _brute_force(table, max_len, alpha):
  """Best EOS-terminated sequence by log P / lp(n), by enumeration."""
  best, best_score = None, -np.inf
  for n in range(1, max_len + 1):
    for head in itertools.product([i for i in range(V) if i != EOS],
                                  repeat=n - 1):
      prev2, prev, logp = BOS, BOS, 0.0
      for s in head + (EOS,):
        logp += np.log(table[prev2, prev, s])
        prev2, prev = prev, s
      score = logp / ((5.0 + n) / 6.0) ** alpha
      if score > best_score:
        best, best_score = list(head) + [EOS] + [PAD] * (max_len - n), score
  return best, best_score


@pytest.mark.parametrize('alpha', [0.0, 1.0])
def test_beam_search_finds_the_exhaustive_optimum(alpha):
  table, max_len = _table(), 4
  step_fn = _markov_step_fn(table)
  state = tf.fill([2 * 2], BOS)  # 2 sentences × 2 beams.
  out = decoder.beam_search(step_fn, state, 2, 2, max_len, alpha)
  want, score = _brute_force(table, max_len, alpha)
  assert want[:3] == [B_, C, EOS]
  for row in range(2):
    assert out.ids.numpy()[row].tolist() == want
    assert out.scores.numpy()[row] == pytest.approx(score, rel=1e-5)
  scores = out.beam_scores.numpy()
  assert (np.diff(scores, axis=1) <= 0).all()
  greedy = decoder.greedy_search(step_fn, tf.fill([2], BOS), 2, max_len)
  assert greedy.numpy()[0, 0] == A  # Greedy commits to "a" and loses.


def test_greedy_stops_at_eos_and_pads():
  table = np.full((V, V, V), 1e-6)
  table[:, :, A] = 1.0
  table[:, A, EOS] = 2.0  # After "a": EOS.
  table /= table.sum(-1, keepdims=True)
  ids = decoder.greedy_search(_markov_step_fn(table), tf.fill([1], BOS), 1, 5)
  assert ids.numpy().tolist() == [[A, EOS, PAD, PAD, PAD]]


def test_beam_search_rejects_bad_settings():
  with pytest.raises(decoder.DecodeError, match='beam_size'):
    decoder.beam_search(_markov_step_fn(_table()), tf.fill([1], BOS), 1, 0, 4)


def test_decoding_on_a_stage_process_says_where_to_decode(tiny_task_params):
  """A stage process holds one stage: decoding names the evaler, not an
  internal class (it used to stop every task at start-up, naming
  _RemoteLayer)."""
  task = tiny_task_params().Instantiate()
  peers = collective.Peers(task=1, addresses=('127.0.0.1:1', '127.0.0.1:2'))
  task.children.pipeline._placement = placement.Placement(peers, 2)  # pylint: disable=protected-access
  src_ids, src_paddings = _source(np.random.default_rng(1), 2, 16, 20)
  with pytest.raises(decoder.DecodeError,
                     match=r'holds only stage 1 of 2.*decode in one process: '
                     r'the evaler') as e:
    task.Decode(task.theta, src_ids, src_paddings)
  assert '_RemoteLayer' not in str(e.value) and '\n' not in str(e.value)
