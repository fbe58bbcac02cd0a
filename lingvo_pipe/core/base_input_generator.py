"""Input generators whose training order is a pure function of the step.

A trainer killed at any moment must, once restarted from its last checkpoint
at step s, see exactly the batches the uninterrupted run saw from step s on.
Iterator state in a checkpoint would do that only for the iterator it was
saved from; instead the order is *computed*:

    position p of the endless stream = s·N + i        (i < N, N = batch_size)
    epoch e = p // E,  offset = p % E                  (E = number of examples)
    example  = permutation(seed, e)[offset]

each epoch's permutation drawn by a stateless shuffle seeded by (seed, e).
`TrainDataset(start_step)` therefore needs nothing but the step, and two
datasets started at different steps agree wherever they overlap.

The real datasets (Fashion-MNIST, a Bible corpus) fit in memory, so an
`InMemoryInputGenerator` loads every example once (`LoadArrays`) and gathers
batches from it; `Preprocess(batch, step)` adds stateless augmentation.

`EvalDataset()` reads the split once in file order, every example exactly
once. The last batch is kept even when it is smaller than N (the evaler runs
the model without micro-batching, so any batch size works), and no padding
is needed: the evaler weights every metric by its example count.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap


class InputError(errors.LingvoPipeError):
  """Input params or arrays that cannot make batches; names the param."""


class DataUnavailableError(errors.LingvoPipeError, RuntimeError):
  """The data of an input generator is missing; the message says the fix."""


def _is_missing_data(e: Exception) -> bool:
  """Whether `e` says "the data is not there" (vs. a bug in a loader)."""
  if isinstance(e, (DataUnavailableError, FileNotFoundError,
                    tf.errors.NotFoundError)):
    return True
  # TFDS: unprepared datasets raise AssertionError('... could not find data
  # in ...'); unknown builders DatasetNotFoundError.
  text = f'{type(e).__name__}: {e}'
  return ('DatasetNotFoundError' in text or 'could not find data' in text or
          'not prepared' in text.lower())


class BaseInputGenerator:
  """Batches of NestedMaps for the trainer and the evaler.

  Subclasses implement `TrainDataset` and `EvalDataset` (or use
  `InMemoryInputGenerator`).
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = InstantiableParams(cls)
    p.Define('name', 'input', 'Name used in messages.')
    p.Define('batch_size', 32, 'Global mini-batch size N: examples per '
             'training step, before splitting into micro-batches.')
    p.Define('seed', 301, 'Seed of the training order (and augmentation).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    self._params = params.Copy().Freeze()
    if params.batch_size < 1:
      raise InputError(f'{params.name}: batch_size must be ≥ 1, got '
                       f'{params.batch_size}; set input.batch_size.')

  @property
  def params(self) -> InstantiableParams:
    return self._params

  def CheckAvailable(self) -> None:
    """Raises DataUnavailableError (one line, with the fix) if data is missing.

    The binaries call this before they write anything.
    """

  def TrainDataset(self, start_step: int) -> tf.data.Dataset:
    """Endless batches; the first is that of step `start_step`."""
    raise NotImplementedError(f'{type(self).__name__}.TrainDataset')

  def TrainBatchSizes(self) -> list[int]:
    """Every batch size TrainDataset makes (length buckets may make several).

    The trainer checks each against the model before it writes anything.
    """
    return [self.params.batch_size]

  def TrainBatchSpecs(self, element_spec: Any) -> list[tuple[int, Any]]:
    """(batch size, spec of those batches) of every shape TrainDataset
    makes, from its `element_spec`: the batch dimension set to each of
    TrainBatchSizes(). A generator whose batches take several shapes says
    which (length buckets: one each), so that every process of a run knows
    the shapes it will exchange before the first step."""
    def _with(spec: tf.TensorSpec, n: int) -> tf.TensorSpec:
      if spec.shape.rank is None or spec.shape.rank == 0:
        return spec
      return tf.TensorSpec([n] + spec.shape.as_list()[1:], spec.dtype)
    return [(n, tf.nest.map_structure(lambda s, n=n: _with(s, n),
                                      element_spec))
            for n in self.TrainBatchSizes()]

  def EvalDataset(self) -> tf.data.Dataset:
    """One pass over the split in a fixed order, the last batch kept."""
    raise NotImplementedError(f'{type(self).__name__}.EvalDataset')


class InMemoryInputGenerator(BaseInputGenerator):
  """All examples in memory; the order is a pure function of the step.

  Subclasses implement `LoadArrays()` and optionally `Preprocess`:

      class Squares(InMemoryInputGenerator):
        def LoadArrays(self):
          x = np.arange(10, dtype=np.float32)
          return {'x': x, 'y': x * x}

      gen = Squares.Params().Set(batch_size=4).Instantiate()
      batches = gen.TrainDataset(start_step=3)   # step 3: positions 12..15
  """

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self._arrays: dict[str, np.ndarray] | None = None

  def LoadArrays(self) -> dict[str, np.ndarray]:
    """Every example of the split: equal-length arrays, keyed by feature."""
    raise NotImplementedError(f'{type(self).__name__}.LoadArrays')

  def Preprocess(self, batch: NestedMap, step: tf.Tensor | None) -> NestedMap:
    """Maps a batch of raw arrays to model inputs (inside tf.data).

    Args:
      batch: NestedMap of tensors gathered from `LoadArrays()`.
      step: The training step (int64 scalar) for stateless augmentation, or
        None in evaluation (augment nothing then).
    """
    del step
    return batch

  # ---- Data ----------------------------------------------------------------
  def Arrays(self) -> dict[str, np.ndarray]:
    """`LoadArrays()`, loaded once and checked."""
    if self._arrays is None:
      self.CheckAvailable()
    if self._arrays is None:
      raise InputError(
          f'{self.params.name}: {type(self).__name__}.CheckAvailable() loaded '
          'no arrays; an override must call super().CheckAvailable().')
    return self._arrays

  @property
  def num_examples(self) -> int:
    return len(next(iter(self.Arrays().values())))

  def CheckAvailable(self) -> None:
    if self._arrays is not None:
      return
    name = self.params.name
    try:
      arrays = self.LoadArrays()
    except Exception as e:  # pylint: disable=broad-except
      if not _is_missing_data(e):
        raise
      line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
      fix = ('' if ('prepare_data' in line or 'setup' in line) else
             ' Fix: run `bash tools/setup.sh` (or `python -m '
             'lingvo_pipe.tasks.prepare_data`).')
      raise DataUnavailableError(
          f'{name}: data not available: {line}{fix}') from None
    self._arrays = self._CheckArrays(arrays)

  def _CheckArrays(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    p = self.params
    if not arrays:
      raise InputError(f'{p.name}: LoadArrays() returned no arrays.')
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
      raise InputError(f'{p.name}: LoadArrays() arrays differ in length: '
                       f'{sizes}; every array needs one row per example.')
    n = next(iter(sizes.values()))
    if n < 1:
      raise DataUnavailableError(f'{p.name}: the split has no examples.')
    return arrays

  # ---- Datasets -----------------------------------------------------------
  def _Tensors(self) -> dict[str, tf.Tensor]:
    with tf.device('/device:CPU:0'):
      return {k: tf.constant(v) for k, v in self.Arrays().items()}

  def TrainDataset(self, start_step: int) -> tf.data.Dataset:
    p = self.params
    n, size = p.batch_size, self.num_examples
    if n > size:
      raise InputError(
          f'{p.name}: batch_size {n} exceeds the {size} examples of the '
          f'split; set input.batch_size ≤ {size}.')
    tensors = self._Tensors()
    seed = int(p.seed)

    def batch(step: tf.Tensor) -> NestedMap:
      indices = train_indices(step, n, size, seed)
      batch = NestedMap({k: tf.gather(v, indices) for k, v in
                         tensors.items()})
      return self.Preprocess(batch, step)

    ds = tf.data.Dataset.counter(start=int(start_step), dtype=tf.int64)
    ds = ds.map(batch, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)

  def EvalDataset(self) -> tf.data.Dataset:
    def batch(batch: dict[str, tf.Tensor]) -> NestedMap:
      return self.Preprocess(NestedMap(batch), None)

    ds = tf.data.Dataset.from_tensor_slices(self._Tensors())
    ds = ds.batch(self.params.batch_size, drop_remainder=False)
    ds = ds.map(batch, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def without_autotune_thread(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` with tf.data's autotuning model thread turned off.

  The binaries iterate their datasets through this. On TF 2.21 that
  thread can outlive its iterator by up to a minute: it sleeps between
  optimizations (10 ms doubling up to 60 s), and the iterator's deletion
  wakes it before the cancellation it waits for is marked done, so it
  sleeps out the rest of the period. The trainer's last `break` then took
  18-58 s (py-spy: `RootDataset::Iterator::~Iterator`), in one process
  or in stage processes. AUTOTUNE arguments still work without it: a
  parallel map runs min(16, the threads it may use) calls at once, and a
  prefetch buffer grows while its consumer waits.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


def train_batch_shapes(generator: BaseInputGenerator
                       ) -> Callable[[int], tuple[tuple[int, ...], ...]] | None:
  """Step (counted from 1) → its training batch's shapes; None if every
  step's are the same. The batches are a function of the step, so this
  builds the dataset from that step and reads its first batch."""
  specs = generator.TrainBatchSpecs(generator.TrainDataset(0).element_spec)
  if len(specs) == 1 and all(
      s.shape.is_fully_defined() for s in tf.nest.flatten(specs[0][1])):
    return None

  @functools.lru_cache(maxsize=None)
  def shapes(step: int) -> tuple[tuple[int, ...], ...]:
    batch = next(iter(without_autotune_thread(
        generator.TrainDataset(step - 1))))
    return tuple(tuple(x.shape) for x in tf.nest.flatten(batch))

  return shapes


def train_indices(step: tf.Tensor, batch_size: int, num_examples: int,
                  seed: int) -> tf.Tensor:
  """Example indices of training step `step` (see the module docstring).

  Requires batch_size ≤ num_examples, so a step spans at most two epochs.

  Returns:
    int64 [batch_size].
  """
  step = tf.cast(step, tf.int64)
  first = step * batch_size  # Position of the step's first example.
  epoch = first // num_examples
  two_epochs = tf.concat([_permutation(seed, epoch, num_examples),
                          _permutation(seed, epoch + 1, num_examples)], 0)
  start = first - epoch * num_examples
  return two_epochs[start:start + batch_size]


def _permutation(seed: int, epoch: tf.Tensor, num_examples: int) -> tf.Tensor:
  """The order of epoch `epoch`: a permutation of range(num_examples)."""
  return tf.random.experimental.stateless_shuffle(
      tf.range(num_examples, dtype=tf.int64),
      seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
