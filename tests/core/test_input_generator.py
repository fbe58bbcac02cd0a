"""Input order as a pure function of the step; eval passes; missing data."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_input_generator as big
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks.synthetic import input_generator as synthetic


class _Range(big.InMemoryInputGenerator):
  """Example i is the number i (so a batch shows which examples it holds)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_examples', 10, 'Examples.')
    return p

  def LoadArrays(self):
    n = self.params.num_examples
    return {'id': np.arange(n, dtype=np.int64),
            'twice': 2 * np.arange(n, dtype=np.int64)}


def _gen(**kwargs):
  return _Range.Params().Set(**kwargs).Instantiate()


def _ids(ds, num_batches):
  return [b.id.numpy() for b in ds.take(num_batches)]


def test_every_epoch_is_a_permutation_and_batches_are_contiguous():
  n, size, steps = 4, 10, 15  # 60 positions = 6 epochs, some steps span two.
  stream = np.concatenate(_ids(_gen(batch_size=n).TrainDataset(0), steps))
  epochs = stream.reshape(-1, size)
  for epoch in epochs:
    assert sorted(epoch) == list(range(size))
  assert len({tuple(e) for e in epochs}) > 1  # Reshuffled per epoch.


def test_without_autotune_thread_keeps_the_batches_and_drops_the_thread():
  # The binaries iterate through it: TF 2.21's autotune thread made the
  # trainer's last `break` wait up to a minute (see the function).
  gen = _gen(batch_size=3, seed=5)
  plain = gen.TrainDataset(2)
  assert plain.options().autotune.enabled is not False
  quiet = big.without_autotune_thread(plain)
  assert quiet.options().autotune.enabled is False
  assert np.array_equal(_ids(quiet, 7), _ids(plain, 7))
  evals = big.without_autotune_thread(gen.EvalDataset())
  assert np.array_equal(np.concatenate([b.id.numpy() for b in evals]),
                        np.arange(10))


def test_restart_at_step_s_gives_the_same_batches():
  gen = _gen(batch_size=3, seed=11)
  full = _ids(gen.TrainDataset(0), 12)
  for start in (1, 3, 7):
    resumed = _ids(_gen(batch_size=3, seed=11).TrainDataset(start),
                   12 - start)
    for a, b in zip(full[start:], resumed):
      np.testing.assert_array_equal(a, b)


def test_features_stay_aligned_and_batches_are_nested_maps():
  batch = next(iter(_gen(batch_size=4).TrainDataset(5)))
  assert isinstance(batch, NestedMap)
  np.testing.assert_array_equal(batch.twice.numpy(), 2 * batch.id.numpy())


def test_seed_changes_the_order():
  a = np.concatenate(_ids(_gen(batch_size=5, seed=1).TrainDataset(0), 2))
  b = np.concatenate(_ids(_gen(batch_size=5, seed=2).TrainDataset(0), 2))
  assert sorted(a) == sorted(b) and list(a) != list(b)


def test_eval_is_one_ordered_pass_keeping_the_last_partial_batch():
  batches = [b.id.numpy() for b in _gen(batch_size=4).EvalDataset()]
  assert [len(b) for b in batches] == [4, 4, 2]
  np.testing.assert_array_equal(np.concatenate(batches), np.arange(10))


class _StepStamped(_Range):

  def Preprocess(self, batch, step):
    batch.step = (tf.fill(tf.shape(batch.id), step) if step is not None else
                  tf.fill(tf.shape(batch.id), tf.constant(-1, tf.int64)))
    return batch


def test_preprocess_sees_the_training_step_and_none_in_eval():
  gen = _StepStamped.Params().Set(batch_size=2).Instantiate()
  for step, batch in zip(range(4, 7), gen.TrainDataset(4)):
    np.testing.assert_array_equal(batch.step.numpy(), [step, step])
  for batch in gen.EvalDataset():
    np.testing.assert_array_equal(batch.step.numpy(), -1)


def test_batch_larger_than_split_names_the_param():
  with pytest.raises(big.InputError, match='input.batch_size'):
    _gen(batch_size=11).TrainDataset(0)


class _Missing(_Range):

  def LoadArrays(self):
    raise FileNotFoundError('/data/train.npz: no such file\nmore detail')


class _Buggy(_Range):

  def LoadArrays(self):
    raise KeyError('a bug, not missing data')


def test_missing_data_is_one_line_with_the_fix():
  gen = _Missing.Params().Set(name='mnist_train').Instantiate()
  with pytest.raises(big.DataUnavailableError) as e:
    gen.CheckAvailable()
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith('mnist_train: data not available: /data/train')
  assert 'lingvo_pipe.tasks.prepare_data' in message


def test_a_loader_bug_is_not_reported_as_missing_data():
  with pytest.raises(KeyError):
    _Buggy.Params().Instantiate().CheckAvailable()


def test_synthetic_splits_are_deterministic_and_distinct():
  def split(split):
    p = synthetic.SyntheticRegressionInput.Params().Set(
        split=split, num_examples=50, batch_size=10)
    return p.Instantiate().Arrays()
  a, b = split('train'), split('train')
  np.testing.assert_array_equal(a['x'], b['x'])
  assert not np.array_equal(a['x'], split('dev')['x'])
  # y = tanh(x·W) + noise: the noise is small next to the signal.
  assert np.abs(a['y']).max() < 1.5


def test_synthetic_nan_at_step_poisons_only_that_step():
  p = synthetic.SyntheticRegressionInput.Params().Set(
      num_examples=40, batch_size=8, nan_at_step=2)
  batches = list(p.Instantiate().TrainDataset(0).take(4))
  assert [bool(np.isnan(b.x.numpy()).any()) for b in batches] == [
      False, False, True, False]
