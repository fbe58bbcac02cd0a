"""Fashion-MNIST batches for the image classifier, from memory.

The whole split (60k or 10k 28×28 uint8 images, 47 MB for train) is loaded
once per process through `tasks.datasets` and kept as uint8; batches are
gathered in the order `InMemoryInputGenerator` computes from the step, then
`Preprocess` turns them into model inputs inside tf.data:

    image = (pixels / 255 − 0.2860) / 0.3530     # train-split mean and std
    [train, augment]  pad 2 px, random 28×28 crop, random horizontal flip
    [image_size ≠ 28] bilinear resize (the paper-shaped config's 224 px)

The augmentation's randomness is stateless, seeded by (seed, step), so a
restarted trainer sees the same augmented batch at the same step.

If the data is not prepared and its source files are missing, `tasks.
datasets` raises `data_paths.MissingDataError`, and the binaries turn it
into one line that names the fix (`CheckAvailable`).
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks import datasets

DATASET = 'lingvo_pipe_fashion_mnist'
SPLITS = ('train', 'test')
# Mean and stddev of the train split's pixels scaled to [0, 1].
PIXEL_MEAN, PIXEL_STDDEV = 0.2860, 0.3530
_PAD = 2  # Pixels of padding before the random crop.

# (split, TFDS dir) → arrays: the trainer's and the evaler's generators (and
# tests) in one process load each split once.
_CACHE: dict[tuple[str, str], dict[str, np.ndarray]] = {}
_LOCK = threading.Lock()


def load_split(split: str) -> dict[str, np.ndarray]:
  """{'image': uint8 [N, 28, 28, 1], 'label': int32 [N]} of `split`, cached.

  Raises:
    data_paths.MissingDataError: not prepared and no source files.
  """
  key = (split, str(data_paths.tfds_dir()))
  with _LOCK:
    if key not in _CACHE:
      arrays = datasets.load(DATASET, split)
      _CACHE[key] = {'image': arrays['image'],
                     'label': arrays['label'].astype(np.int32)}
    return _CACHE[key]


class FashionMnistInput(base_input_generator.InMemoryInputGenerator):
  """Batches NestedMap(image=float32 [N, S, S, 1], label=int32 [N])."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('split', 'train', f'Which split, one of {SPLITS}.')
    p.Define('image_size', 28, 'Side S of the images fed to the model; ≠ 28 '
             'resizes bilinearly (e.g. 224 for the paper-shaped config).')
    p.Define('augment', False, 'Training only: random 2-pixel-shift crops '
             'and horizontal flips, seeded by (seed, step).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    if p.split not in SPLITS:
      raise base_input_generator.InputError(
          f'{p.name}: split is {p.split!r}; Fashion-MNIST has {SPLITS}. Set '
          'input.split.')
    if not isinstance(p.image_size, int) or p.image_size < 1:
      raise base_input_generator.InputError(
          f'{p.name}: image_size must be a positive int, got '
          f'{p.image_size!r}; set input.image_size (28 = as stored).')

  def LoadArrays(self) -> dict[str, np.ndarray]:
    return load_split(self.params.split)

  def Preprocess(self, batch: NestedMap, step: tf.Tensor | None) -> NestedMap:
    p = self.params
    image = tf.cast(batch.image, tf.float32) / 255.0  # [N, 28, 28, 1]
    if step is not None and p.augment:
      image = _augment(image, tf.stack([tf.constant(p.seed, tf.int64),
                                        tf.cast(step, tf.int64)]))
    if p.image_size != image.shape[1]:
      image = tf.image.resize(image, [p.image_size, p.image_size])
    image = (image - PIXEL_MEAN) / PIXEL_STDDEV
    return NestedMap(image=image, label=tf.cast(batch.label, tf.int32))


def _augment(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """Per-example random shift (pad 2, crop back) and horizontal flip.

  Args:
    image: [N, H, W, C] in [0, 1]; padding is 0, the images' background.
    seed: [2] int64 stateless seed.
  """
  n, h, w = tf.shape(image)[0], image.shape[1], image.shape[2]
  shift_seed, flip_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 2))
  padded = tf.pad(image, [[0, 0], [_PAD, _PAD], [_PAD, _PAD], [0, 0]])
  offsets = tf.random.stateless_uniform([n, 2], shift_seed, 0, 2 * _PAD + 1,
                                        dtype=tf.int32)
  rows = offsets[:, :1] + tf.range(h)[None, :]  # [N, H]
  cols = offsets[:, 1:] + tf.range(w)[None, :]  # [N, W]
  image = tf.gather(padded, rows, axis=1, batch_dims=1)  # [N, H, W+4, C]
  image = tf.gather(image, cols, axis=2, batch_dims=1)  # [N, H, W, C]
  flip = tf.random.stateless_uniform([n], flip_seed) < 0.5
  return tf.where(flip[:, None, None, None], tf.reverse(image, [2]), image)
