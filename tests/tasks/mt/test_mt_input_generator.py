"""Verse pairs to fixed-shape id batches: shifting, padding, long pairs."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.tasks.mt import input_generator
from lingvo_pipe.tasks.mt import vocab

from mt_testdata import LONG_PAIR, PAIRS  # pylint: disable=g-bad-import-order

MAX_LEN = 32


def _gen(mt_data, split, **kwargs):
  values = dict(split=split, batch_size=4, max_len=MAX_LEN,
                tsv_path=mt_data['dev' if split == 'validation' else 'train'],
                vocab_path=mt_data['vocab'])
  values.update(kwargs)
  return input_generator.BibleTranslationInput.Params().Set(
      **values).Instantiate()


def test_fixture_lengths(mt_vocab):
  """Guards the other tests: only LONG_PAIR exceeds MAX_LEN."""
  for en, es in PAIRS:
    assert max(len(mt_vocab.encode(en)), len(mt_vocab.encode(es))) <= MAX_LEN
  assert len(mt_vocab.encode(LONG_PAIR[0])) > MAX_LEN


def test_training_arrays_shift_pad_and_drop(mt_data, mt_vocab):
  gen = _gen(mt_data, 'train')
  arrays = gen.Arrays()
  assert gen.num_dropped == 1 and gen.num_examples == len(PAIRS)
  for key in ('src_ids', 'src_paddings', 'tgt_ids', 'tgt_labels',
              'tgt_paddings'):
    assert arrays[key].shape == (len(PAIRS), MAX_LEN), key
  for row, (en, es) in enumerate(PAIRS):
    labels = arrays['tgt_labels'][row]
    n = len(mt_vocab.encode(es))
    assert labels[n - 1] == vocab.EOS_ID and (labels[n:] == 0).all()
    assert arrays['tgt_ids'][row, 0] == vocab.BOS_ID
    np.testing.assert_array_equal(arrays['tgt_ids'][row, 1:n],
                                  labels[:n - 1])
    np.testing.assert_array_equal(arrays['tgt_paddings'][row],
                                  np.arange(MAX_LEN) >= n)
    assert mt_vocab.decode(arrays['src_ids'][row]) == en
    assert arrays['src_paddings'][row].sum() == MAX_LEN - len(
        mt_vocab.encode(en))
    assert arrays['tgt_text'][row] == es


def test_eval_keeps_and_cuts_long_pairs(mt_data):
  gen = _gen(mt_data, 'validation')
  arrays = gen.Arrays()
  assert gen.num_truncated == 1 and gen.num_examples == 11
  row = list(arrays['tgt_text']).index(LONG_PAIR[1])  # Full reference.
  assert arrays['src_ids'][row, -1] == vocab.EOS_ID
  assert arrays['src_paddings'][row].sum() == 0


def test_train_batches_are_fixed_and_a_function_of_the_step(mt_data):
  gen = _gen(mt_data, 'train')
  from_0 = [b for _, b in zip(range(8), gen.TrainDataset(0))]
  from_5 = next(iter(gen.TrainDataset(5)))
  for batch in from_0:
    assert 'tgt_text' not in batch
    assert {tuple(v.shape) for v in batch.values()} == {(4, MAX_LEN)}
  for key, value in from_5.items():
    np.testing.assert_array_equal(value.numpy(), from_0[5][key].numpy())


def test_eval_batches_carry_the_references(mt_data):
  batches = list(_gen(mt_data, 'validation').EvalDataset())
  assert [b.src_ids.shape[0] for b in batches] == [4, 4, 3]
  assert batches[0].tgt_text.numpy()[0].decode() == PAIRS[0][1]


def test_bad_tsv_line_is_named(tmp_path, mt_data):
  path = tmp_path / 'bad.tsv'
  path.write_text('one\ttwo\nno tab here\n', encoding='utf-8')
  with pytest.raises(base_input_generator.InputError, match='line 2'):
    _gen(mt_data, 'train', tsv_path=str(path)).Arrays()


@pytest.mark.parametrize('values,match', [(dict(split='valid'), 'split'),
                                          (dict(max_len=1), 'max_len')])
def test_bad_params_are_named(mt_data, values, match):
  p = _gen(mt_data, 'train').params.Copy().Set(**values)
  with pytest.raises(base_input_generator.InputError, match=match):
    p.Instantiate()


def _bucket_gen(mt_data, mt_vocab):
  """Two buckets split at the median pair length of the fixture."""
  lengths = sorted(max(len(mt_vocab.encode(en)), len(mt_vocab.encode(es)))
                   for en, es in PAIRS)
  bound = lengths[len(lengths) // 2]
  return _gen(mt_data, 'train', bucket_upper_bounds=[bound, MAX_LEN],
              bucket_batch_sizes=[4, 2]), bound


def test_buckets_have_fixed_shapes_and_whole_epochs(mt_data, mt_vocab):
  gen, bound = _bucket_gen(mt_data, mt_vocab)
  full = gen.Arrays()
  length = MAX_LEN - np.minimum(full['src_paddings'].sum(1),
                                full['tgt_paddings'].sum(1))
  small = int((length <= bound).sum())
  steps = [small // 4, (len(PAIRS) - small) // 2]
  cycle = input_generator.bucket_cycle(steps)
  assert sorted(cycle.tolist()) == [0] * steps[0] + [1] * steps[1]
  seen = {0: [], 1: []}
  for step, batch in zip(range(len(cycle)), gen.TrainDataset(0)):
    b = int(cycle[step])
    width = (bound, MAX_LEN)[b]
    assert {tuple(v.shape) for v in batch.values()} == {((4, 2)[b], width)}
    for row in batch.src_ids.numpy():
      # Which full example this is: its source ids, cut to the bucket.
      match = [i for i in range(len(PAIRS))
               if (full['src_ids'][i, :width] == row).all()]
      assert len(match) == 1 and (length[match[0]] <= bound) == (b == 0)
      seen[b].append(match[0])
  for b in (0, 1):  # One cycle: no example twice within a bucket.
    assert len(seen[b]) == len(set(seen[b])) == steps[b] * (4, 2)[b]


def test_bucketed_order_is_a_function_of_the_step(mt_data, mt_vocab):
  gen, _ = _bucket_gen(mt_data, mt_vocab)
  from_0 = [b for _, b in zip(range(12), gen.TrainDataset(0))]
  for start in (5, 11):
    again = next(iter(gen.TrainDataset(start)))
    for key, value in again.items():
      np.testing.assert_array_equal(value.numpy(), from_0[start][key].numpy())


@pytest.mark.parametrize('bounds,sizes', [([16, 24], [4, 2]),
                                          ([24, 16, 32], [4, 2, 2]),
                                          ([16, 32], [4])])
def test_bad_buckets_are_named(mt_data, bounds, sizes):
  p = _gen(mt_data, 'train').params.Copy().Set(bucket_upper_bounds=bounds,
                                               bucket_batch_sizes=sizes)
  with pytest.raises(base_input_generator.InputError, match='bucket'):
    p.Instantiate()


def test_train_batch_specs_are_the_shapes_the_buckets_make(mt_data, mt_vocab):
  """What every stage process knows before the first step: one spec per
  bucket, equal to the batches the dataset then makes."""
  gen, bound = _bucket_gen(mt_data, mt_vocab)
  dataset = gen.TrainDataset(0)
  specs = gen.TrainBatchSpecs(dataset.element_spec)
  assert [n for n, _ in specs] == gen.TrainBatchSizes() == [4, 2]
  declared = {tuple(s.shape) for _, spec in specs for s in spec.values()}
  assert declared == {(4, bound), (2, MAX_LEN)}
  made = {tuple(v.shape) for _, batch in zip(range(8), dataset)
          for v in batch.values()}
  assert made == declared


def test_trainer_knows_each_steps_batch_shapes(mt_data, mt_vocab):
  """What --timeline_steps warms a chosen step's function up with."""
  gen, _ = _bucket_gen(mt_data, mt_vocab)
  shapes = base_input_generator.train_batch_shapes(gen)
  batches = [b for _, b in zip(range(6), gen.TrainDataset(0))]
  for step, batch in enumerate(batches, 1):
    assert shapes(step) == tuple(tuple(v.shape)
                                 for v in tf.nest.flatten(batch))
  assert len({shapes(s) for s in range(1, 7)}) == 2
  assert base_input_generator.train_batch_shapes(
      _gen(mt_data, 'train')) is None
