"""Deterministic synthetic regression data: y = tanh(x·W) + noise.

The examples are a pure function of `data_seed` and the split, generated in
numpy float64 and stored as float32, so every process (trainer, evaler,
test) sees the same data with nothing on disk. The three splits share W and
draw their x and noise from independent streams.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.core.nested_map import NestedMap

SPLITS = ('train', 'dev', 'test')


def make_split(data_seed: int, split: str, num_examples: int, input_dim: int,
               output_dim: int, noise_stddev: float) -> dict[str, np.ndarray]:
  """Features x [n, input_dim] and targets y [n, output_dim] of one split."""
  w = np.random.default_rng([data_seed, 0]).normal(
      size=(input_dim, output_dim)) / np.sqrt(input_dim)
  rng = np.random.default_rng([data_seed, 1 + SPLITS.index(split)])
  x = rng.normal(size=(num_examples, input_dim))
  y = np.tanh(x @ w) + noise_stddev * rng.normal(size=(num_examples,
                                                       output_dim))
  return {'x': x.astype(np.float32), 'y': y.astype(np.float32)}


class SyntheticRegressionInput(base_input_generator.InMemoryInputGenerator):
  """Batches NestedMap(x [N, input_dim], y [N, output_dim]) of one split."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('split', 'train', f'Which split, one of {SPLITS}.')
    p.Define('num_examples', 2048, 'Examples in the split.')
    p.Define('input_dim', 16, 'Depth of x.')
    p.Define('output_dim', 4, 'Depth of y.')
    p.Define('noise_stddev', 0.05, 'Stddev of the Gaussian noise on y.')
    p.Define('data_seed', 7, 'Seed of W and of every split\'s examples.')
    p.Define('npz_path', '', 'Optional .npz file with arrays x and y to use '
             'instead of the generated split (e.g. data exported elsewhere).')
    p.Define('nan_at_step', -1, 'Testing aid: the training batch of this '
             'step has NaN features (so the loss is NaN); -1 = never.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    if self.params.split not in SPLITS:
      raise base_input_generator.InputError(
          f'{self.params.name}: split is {self.params.split!r}; use one of '
          f'{SPLITS}.')

  def LoadArrays(self) -> dict[str, np.ndarray]:
    p = self.params
    if p.npz_path:
      with np.load(p.npz_path) as data:  # FileNotFoundError if missing.
        return {'x': data['x'], 'y': data['y']}
    return make_split(p.data_seed, p.split, p.num_examples, p.input_dim,
                      p.output_dim, p.noise_stddev)

  def Preprocess(self, batch: NestedMap, step: tf.Tensor | None) -> NestedMap:
    nan_at = self.params.nan_at_step
    if step is None or nan_at < 0:
      return batch
    poison = tf.where(tf.equal(step, nan_at), np.nan, 0.0)
    batch.x = batch.x + tf.cast(poison, batch.x.dtype)
    return batch
