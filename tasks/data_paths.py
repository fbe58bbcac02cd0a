"""Where the data lives: one place, so every error points to the same fix.

The source data comes from Debian packages, because on the machines we train
on PyPI and Debian's mirrors are reachable and dataset hosts are not. A
package is found either extracted under the cache (`<root>/debian/`, done
without root by `python -m lingvo_pipe.tasks.prepare_data`) or installed system-wide with
apt (`/usr/share/...`). Everything derived from it (TFDS records, the
SentencePiece model) goes under the same cache root:

    <root> = $LINGVO_PIPE_DATA_DIR or ~/.cache/lingvo_pipe
    <root>/debian/usr/share/...   extracted Debian packages
    <root>/tfds/                  TFDS data_dir
    <root>/vocab/                 SentencePiece models

The TFDS builders themselves know none of this: they follow TFDS's
manual-download convention and read their sources from `manual_dir` only.
`manual_dir(dataset)` is the directory to give them (it is what
`prepare_data` passes). When a source is missing, `require` and
`manual_dir` raise one `MissingDataError` that names the Debian packages,
the places it looked and the command that fixes it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Sequence

from lingvo_pipe import errors

ENV_VAR = 'LINGVO_PIPE_DATA_DIR'
# Where `apt-get install` puts packages; a module constant so tests can move it.
SYSTEM_ROOT = pathlib.Path('/')


class MissingDataError(errors.LingvoPipeError, FileNotFoundError):
  """Source files of a dataset are not on this machine."""


@dataclasses.dataclass(frozen=True)
class DebianSource:
  """Files a dataset needs from one Debian package.

  Attributes:
    package: Debian package name, e.g. 'dataset-fashion-mnist'.
    rel_dir: Directory inside the package, e.g. 'usr/share/sword'.
    files: Files under `rel_dir` that must all exist.
  """
  package: str
  rel_dir: str
  files: tuple[str, ...]


def _sword_files(module: str) -> tuple[str, ...]:
  data = f'modules/texts/ztext/{module}'
  return (f'mods.d/{module}.conf',) + tuple(
      f'{data}/{t}.{ext}' for t in ('ot', 'nt') for ext in ('bzs', 'bzv',
                                                           'bzz'))


FASHION_MNIST_FILES = ('train-images-idx3-ubyte.gz',
                       'train-labels-idx1-ubyte.gz',
                       't10k-images-idx3-ubyte.gz',
                       't10k-labels-idx1-ubyte.gz')

# dataset name -> the Debian sources it is built from.
SOURCES: dict[str, tuple[DebianSource, ...]] = {
    'fashion_mnist': (DebianSource('dataset-fashion-mnist',
                                   'usr/share/datasets/fashion-mnist',
                                   FASHION_MNIST_FILES),),
    'bible_en_es': (
        DebianSource('sword-text-kjv', 'usr/share/sword',
                     _sword_files('engKJV2006eb')),
        DebianSource('sword-text-sparv', 'usr/share/sword',
                     _sword_files('spaRV1909eb')),
    ),
}


def cache_root() -> pathlib.Path:
  """$LINGVO_PIPE_DATA_DIR, else ~/.cache/lingvo_pipe."""
  env = os.environ.get(ENV_VAR)
  return pathlib.Path(env).expanduser() if env else (
      pathlib.Path.home() / '.cache' / 'lingvo_pipe')


def debian_root() -> pathlib.Path:
  """Where `prepare_data` extracts Debian packages (`dpkg -x` target)."""
  return cache_root() / 'debian'


def tfds_dir() -> pathlib.Path:
  """The TFDS data_dir of our builders."""
  return cache_root() / 'tfds'


def vocab_dir() -> pathlib.Path:
  """Where trained SentencePiece models are saved."""
  return cache_root() / 'vocab'


def _roots() -> list[pathlib.Path]:
  return [debian_root(), SYSTEM_ROOT]


def find(source: DebianSource) -> pathlib.Path | None:
  """`rel_dir` under the first root that holds all of `source.files`."""
  for root in _roots():
    base = root / source.rel_dir
    if all((base / f).is_file() for f in source.files):
      return base
  return None


def _check_dataset(dataset: str) -> tuple[DebianSource, ...]:
  if dataset not in SOURCES:
    raise KeyError(f'Unknown dataset {dataset!r}; known: {sorted(SOURCES)}.')
  return SOURCES[dataset]


def missing_packages(dataset: str) -> list[str]:
  """Debian packages of `dataset` that are found in no root."""
  return [s.package for s in _check_dataset(dataset) if find(s) is None]


def require(dataset: str) -> dict[str, pathlib.Path]:
  """The directory of each Debian package of `dataset`, by package name.

  Raises:
    MissingDataError: one or more packages are missing; the message names
      them, the directories searched and the set-up command.
  """
  found, missing = {}, []
  for source in _check_dataset(dataset):
    base = find(source)
    if base is None:
      missing.append(source)
    else:
      found[source.package] = base
  if missing:
    raise MissingDataError(_missing_message(dataset, missing))
  return found


def manual_dir(dataset: str) -> pathlib.Path:
  """The TFDS `manual_dir` of `dataset`: one directory with all its sources.

  The builders follow TFDS's manual-download convention and read only
  `dl_manager.manual_dir`: the IDX files for fashion_mnist, a SWORD library
  (mods.d/, modules/) holding both Bibles for bible_en_es. This is the first
  root (the cache, then the system) that holds every package of `dataset`.

  Raises:
    MissingDataError: no root holds them all; the message says how to fetch
      them.
  """
  sources = _check_dataset(dataset)
  for root in _roots():
    dirs = {root / s.rel_dir for s in sources}
    if len(dirs) == 1 and all(
        all((root / s.rel_dir / f).is_file() for f in s.files)
        for s in sources):
      return dirs.pop()
  missing = [s for s in sources if find(s) is None]
  if missing:
    raise MissingDataError(_missing_message(dataset, missing))
  raise MissingDataError(
      f'The Debian packages of dataset {dataset!r} are split between '
      f'{debian_root()} and {SYSTEM_ROOT}; run `python -m '
      f'lingvo_pipe.tasks.prepare_data --datasets={dataset}`, which extracts '
      f'the rest into {debian_root()}.')


def checked_manual_dir(dl_manager: Any, files: Sequence[str],
                       instructions: str) -> pathlib.Path:
  """A builder's `dl_manager.manual_dir`, checked to hold `files`.

  Raises:
    MissingDataError: the directory is missing, empty or lacks some of
      `files`; the message names them and repeats `instructions`.
  """
  try:
    path = pathlib.Path(str(dl_manager.manual_dir))
  except AssertionError as e:  # TFDS: missing or empty manual directory.
    raise MissingDataError(' '.join(str(e).split())) from None
  missing = [f for f in files if not (path / f).is_file()]
  if missing:
    raise MissingDataError(
        f'Manual directory {path} lacks {", ".join(missing)}. '
        f'{" ".join(instructions.split())}')
  return path


def packages_to_fetch(dataset: str) -> list[str]:
  """Packages to extract into the cache so that `manual_dir` finds them all.

  Nothing when one root already holds every package; else those the cache
  lacks.
  """
  try:
    manual_dir(dataset)
    return []
  except MissingDataError:
    cache = debian_root()
    return [s.package for s in _check_dataset(dataset)
            if not all((cache / s.rel_dir / f).is_file() for f in s.files)]


def _missing_message(dataset: str, missing: list[DebianSource]) -> str:
  packages = ' '.join(s.package for s in missing)
  places = '; '.join(
      f'{root / s.rel_dir} (need {", ".join(s.files[:2])}'
      f'{", ..." if len(s.files) > 2 else ""})' for s in missing
      for root in _roots())
  return (f'Source data of dataset {dataset!r} not found: Debian package(s) '
          f'{packages} missing. Looked in: {places}. Fix: run `python -m '
          f'lingvo_pipe.tasks.prepare_data --datasets={dataset}` (or `bash '
          'tools/setup.sh`, which runs it) to fetch and extract them into '
          f'{debian_root()} without root, or `sudo apt-get install '
          f'{packages}`. Set ${ENV_VAR} to use another cache root.')
