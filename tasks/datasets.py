"""Loads our TFDS datasets into memory, preparing them from local files first.

Both datasets are small (Fashion-MNIST is 55 MB of pixels, the Bible 10 MB
of text), so a split is returned as a dict of numpy arrays and the input
generators batch from memory; TFDS is the on-disk format and the place that
records splits and versions. Preparing never downloads: the builders read
only the Debian packages' files, given to them as TFDS's `manual_dir` (see
`tasks.data_paths`), and the download config below forbids TFDS's own GCS
shortcut.

>>> train = load('fashion_mnist', 'train')
>>> train['image'].shape, train['label'].dtype
((60000, 28, 28, 1), dtype('int64'))
>>> dev = load('bible_en_es', 'validation')
>>> type(dev['en'][0]).__name__
'str'
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import pathlib
from typing import Any, Iterator

import numpy as np
import tensorflow_datasets as tfds

from lingvo_pipe.tasks import data_paths

# Short name -> (package that defines the builder, registered name).
_BUILDERS = {
    'fashion_mnist': ('lingvo_pipe.tasks.image.fashion_mnist',
                      'lingvo_pipe_fashion_mnist'),
    'bible_en_es': ('lingvo_pipe.tasks.mt.bible_en_es',
                    'lingvo_pipe_bible_en_es'),
}
NAMES = tuple(_BUILDERS)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Silences TFDS's info logs and prints for the duration (and turns its
  progress bars off for good).

  TFDS prints 'Downloading and preparing dataset ...' even though ours read
  local files only; our callers print what they did instead.
  """
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  tfds.disable_progress_bar()
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      yield
  finally:
    absl_logger.setLevel(level)


def builder(name: str, data_dir: str | pathlib.Path | None = None) -> Any:
  """The TFDS builder of dataset `name` ('fashion_mnist' or 'bible_en_es').

  Args:
    name: A short name from `NAMES` (or the registered 'lingvo_pipe_*' name).
    data_dir: TFDS data_dir; default `data_paths.tfds_dir()`.
  """
  short = {full: s for s, (_, full) in _BUILDERS.items()}.get(name, name)
  if short not in _BUILDERS:
    raise KeyError(f'Unknown dataset {name!r}; use one of {NAMES}.')
  package, registered = _BUILDERS[short]
  importlib.import_module(package)  # Registered already if TFDS was loaded.
  with _quiet():
    return tfds.builder(registered,
                        data_dir=str(data_dir or data_paths.tfds_dir()))


def is_prepared(name: str, data_dir: str | pathlib.Path | None = None) -> bool:
  """Whether dataset `name` is already built into data_dir."""
  b = builder(name, data_dir)
  with _quiet():
    return b.is_prepared()


def prepare(name: str, data_dir: str | pathlib.Path | None = None,
            manual_dir: str | pathlib.Path | None = None) -> Any:
  """Builds dataset `name` into data_dir unless it is there; returns builder.

  Args:
    name: A short name from `NAMES`.
    data_dir: TFDS data_dir; default `data_paths.tfds_dir()`.
    manual_dir: TFDS's manual directory, where the builder reads its source
      files; default `data_paths.manual_dir(name)` (the Debian packages).

  Raises:
    data_paths.MissingDataError: the source files are missing.
  """
  b = builder(name, data_dir)
  with _quiet():
    if b.is_prepared():
      return b
  short = {full: s for s, (_, full) in _BUILDERS.items()}.get(name, name)
  config = tfds.download.DownloadConfig(
      try_download_gcs=False,
      manual_dir=str(manual_dir or data_paths.manual_dir(short)))
  with _quiet():
    b.download_and_prepare(
        download_dir=str(pathlib.Path(b.data_dir_root) / 'downloads'),
        download_config=config)
  return b


def load(name: str, split: str, data_dir: str | pathlib.Path | None = None,
         manual_dir: str | pathlib.Path | None = None
        ) -> dict[str, np.ndarray]:
  """All examples of `split` as numpy arrays, one per feature.

  Text features come back as object arrays of Python `str`. The order is
  TFDS's deterministic one (examples are shuffled by key when written).

  Raises:
    data_paths.MissingDataError: not prepared and the sources are missing.
    ValueError: `split` is not a split of the dataset.
  """
  b = prepare(name, data_dir, manual_dir)
  if split not in b.info.splits:
    raise ValueError(f'Dataset {name!r} has splits '
                     f'{sorted(b.info.splits)}, not {split!r}.')
  with _quiet():
    arrays = tfds.as_numpy(b.as_dataset(split=split, batch_size=-1,
                                        shuffle_files=False))
  return {key: _decode(value) for key, value in arrays.items()}


def _decode(value: np.ndarray) -> np.ndarray:
  if value.dtype == object:  # tf.string -> bytes; we hand out str.
    return np.array([v.decode('utf-8') for v in value], dtype=object)
  return value
