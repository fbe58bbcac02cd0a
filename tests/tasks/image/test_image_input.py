"""The Fashion-MNIST input generator: preprocessing, augmentation, missing data.

Arrays come from a tiny in-memory stand-in for the dataset (the real one is
prepared by tools/setup.sh, which these tests do not need).
"""

import numpy as np
import pytest

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.image import input_generator

_N = 12


def _arrays():
  rng = np.random.default_rng(5)
  return {'image': rng.integers(0, 256, size=(_N, 28, 28, 1), dtype=np.uint8),
          'label': (np.arange(_N) % 10).astype(np.int32)}


class _FakeInput(input_generator.FashionMnistInput):

  def LoadArrays(self):
    return _arrays()


def _gen(**kwargs):
  return _FakeInput.Params().Set(batch_size=5, **kwargs).Instantiate()


def _normalized(pixels):
  return (pixels.astype(np.float64) / 255 - input_generator.PIXEL_MEAN) / (
      input_generator.PIXEL_STDDEV)


def test_eval_batches_are_normalized_in_order_with_a_partial_last_batch():
  batches = list(_gen(split='test').EvalDataset())
  assert [int(b.label.shape[0]) for b in batches] == [5, 5, 2]
  image = np.concatenate([b.image.numpy() for b in batches])
  label = np.concatenate([b.label.numpy() for b in batches])
  assert image.dtype == np.float32 and label.dtype == np.int32
  np.testing.assert_allclose(image, _normalized(_arrays()['image']),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(label, _arrays()['label'])


def _shifts(original):
  """Every pad-2 crop and its mirror of one [28, 28] image."""
  padded = np.pad(original, 2)
  for dy in range(5):
    for dx in range(5):
      crop = padded[dy:dy + 28, dx:dx + 28]
      yield crop
      yield crop[:, ::-1]


def test_augmentation_is_a_shift_or_flip_and_a_function_of_the_step():
  gen = _gen(augment=True)
  indices = base_input_generator.train_indices(3, 5, _N, gen.params.seed)
  first = next(iter(gen.TrainDataset(3)))
  again = next(iter(_gen(augment=True).TrainDataset(3)))
  np.testing.assert_array_equal(first.image.numpy(), again.image.numpy())
  later = next(iter(gen.TrainDataset(4)))
  assert not np.array_equal(first.image.numpy(), later.image.numpy())
  pixels = _arrays()['image'][indices.numpy(), :, :, 0].astype(np.float64)
  for got, raw in zip(first.image.numpy()[..., 0], pixels):
    candidates = [_normalized(c) for c in _shifts(raw)]
    assert min(np.max(np.abs(got - c)) for c in candidates) < 1e-5


def test_image_size_resizes():
  batch = next(iter(_gen(image_size=40).TrainDataset(0)))
  assert batch.image.shape.as_list() == [5, 40, 40, 1]


def test_bad_split_names_the_param():
  with pytest.raises(base_input_generator.InputError, match='input.split'):
    _gen(split='validation')


def test_missing_data_is_one_message_with_the_fix(tmp_path, monkeypatch):
  monkeypatch.setenv(data_paths.ENV_VAR, str(tmp_path / 'cache'))
  monkeypatch.setattr(data_paths, 'SYSTEM_ROOT', tmp_path / 'root')
  gen = input_generator.FashionMnistInput.Params().Set(
      name='fashion_mnist_train').Instantiate()
  with pytest.raises(base_input_generator.DataUnavailableError) as e:
    gen.CheckAvailable()
  message = str(e.value)
  assert message.startswith('fashion_mnist_train: data not available')
  assert 'dataset-fashion-mnist' in message
  assert 'python -m lingvo_pipe.tasks.prepare_data' in message
  assert '\n' not in message
