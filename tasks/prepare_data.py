"""Sets up every dataset offline: Debian packages → TFDS → vocabulary.

    lingvo_pipe_prepare_data [--datasets=fashion_mnist,bible_en_es]
    python -m lingvo_pipe.tasks.prepare_data [...]   # the same

1. Fetches the Debian packages a dataset needs unless already found (in the
   cache or installed system-wide): `apt-get download` into a temporary dir
   and `dpkg -x` into `<root>/debian`. Neither needs root. `--deb_dir` uses
   .deb files downloaded elsewhere instead.
2. Builds the TFDS datasets into `<root>/tfds` from those local files.
3. Trains the joint SentencePiece vocabulary of bible_en_es on its training
   split, into `<root>/vocab`.

Every step is skipped when its output exists, so a second run is a quick
no-op (`--retrain_vocab` forces step 3). `<root>` is $LINGVO_PIPE_DATA_DIR or
~/.cache/lingvo_pipe (`--data_dir` overrides both).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import numpy as np

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks import datasets
from lingvo_pipe.tasks.mt import vocab


def _log(message: str) -> None:
  print(f'[prepare_data] {message}', flush=True)


def _find_deb(package: str, deb_dir: pathlib.Path | None,
              tmp: pathlib.Path) -> pathlib.Path:
  """A .deb of `package`: from deb_dir if it has one, else downloaded to tmp."""
  if deb_dir is not None:
    debs = sorted(deb_dir.glob(f'{package}_*.deb'))
    if debs:
      return debs[-1]
  if shutil.which('apt-get') is None:
    raise data_paths.MissingDataError(
        f'Need Debian package {package} but apt-get is not available. '
        f'Download {package}_*.deb on a Debian/Ubuntu machine and pass '
        '--deb_dir=<its directory>.')
  result = subprocess.run(['apt-get', 'download', package], cwd=tmp,
                          capture_output=True, text=True, check=False)
  debs = sorted(tmp.glob(f'{package}_*.deb'))
  if result.returncode != 0 or not debs:
    raise data_paths.MissingDataError(
        f'`apt-get download {package}` failed ({result.stderr.strip()}). '
        'If the package is unknown, the apt lists are empty: run `sudo '
        'apt-get update`, or fetch the .deb elsewhere and pass --deb_dir.')
  return debs[-1]


def fetch_packages(dataset: str, deb_dir: pathlib.Path | None) -> None:
  """Extracts the missing Debian packages of `dataset` into the cache."""
  missing = data_paths.packages_to_fetch(dataset)
  if not missing:
    _log(f'{dataset}: Debian sources present, nothing to fetch.')
    return
  target = data_paths.debian_root()
  target.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix='lingvo_pipe_deb_') as tmp:
    for package in missing:
      deb = _find_deb(package, deb_dir, pathlib.Path(tmp))
      subprocess.run(['dpkg', '-x', str(deb), str(target)], check=True)
      _log(f'{dataset}: extracted {deb.name} into {target}.')
  data_paths.manual_dir(dataset)  # Fails loudly if a package lacked a file.


def build_tfds(dataset: str) -> None:
  """Builds the TFDS dataset (a no-op when prepared) and prints split sizes."""
  was_prepared = datasets.is_prepared(dataset)
  b = datasets.prepare(dataset)
  sizes = ', '.join(f'{name} {split.num_examples:,}'
                    for name, split in sorted(b.info.splits.items()))
  verb = 'already built' if was_prepared else 'built'
  _log(f'{dataset}: TFDS {b.name} {verb} in {b.data_dir}: {sizes}.')


def train_vocab(vocab_size: int, retrain: bool) -> None:
  """Trains the bible_en_es SentencePiece model on the training split."""
  path = vocab.default_model_path()
  if path.is_file() and not retrain:
    _log(f'vocab: {path} exists ({vocab.Vocab(path).size} pieces).')
    return
  train = datasets.load('bible_en_es', 'train')
  sentences = list(train['en']) + list(train['es'])
  start = time.time()
  vocab.train(sentences, path, vocab_size=vocab_size)
  v = vocab.Vocab(path)
  dev = datasets.load('bible_en_es', 'validation')
  lengths = {lang: np.mean([len(v.encode(s, add_eos=False)) for s in dev[lang]])
             for lang in ('en', 'es')}
  _log(f'vocab: trained {v.size} pieces on {len(sentences):,} training '
       f'sentences in {time.time() - start:.1f}s into {path}; mean pieces '
       f'per dev sentence: en {lengths["en"]:.1f}, es {lengths["es"]:.1f}.')


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  script = os.path.basename(sys.argv[0])
  parser = argparse.ArgumentParser(
      prog=(script if script == 'lingvo_pipe_prepare_data' else
            'python -m lingvo_pipe.tasks.prepare_data'),
      description=__doc__.split('\n\n')[0])
  parser.add_argument('--datasets', default=','.join(datasets.NAMES),
                      help='Comma-separated datasets to prepare.')
  parser.add_argument('--data_dir', default=None,
                      help=f'Cache root (default: ${data_paths.ENV_VAR} or '
                      '~/.cache/lingvo_pipe).')
  parser.add_argument('--deb_dir', default=None,
                      help='Directory of already downloaded .deb files.')
  parser.add_argument('--vocab_size', type=int, default=8000,
                      help='SentencePiece pieces of the bible_en_es vocab.')
  parser.add_argument('--retrain_vocab', action='store_true',
                      help='Train the vocabulary even if it exists.')
  parser.add_argument('-v', '--verbosity', type=int, default=0,
                      help='1 shows TensorFlow\'s start-up banner and logs.')
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(argv)
  if args.data_dir:
    os.environ[data_paths.ENV_VAR] = args.data_dir
  names = [n.strip() for n in args.datasets.split(',') if n.strip()]
  unknown = sorted(set(names) - set(datasets.NAMES))
  if unknown:
    _log(f'unknown dataset(s) {unknown}; choose from {datasets.NAMES}.')
    return 2
  deb_dir = pathlib.Path(args.deb_dir) if args.deb_dir else None
  start = time.time()
  _log(f'cache root {data_paths.cache_root()}')
  for name in names:
    fetch_packages(name, deb_dir)
    build_tfds(name)
  if 'bible_en_es' in names:
    train_vocab(args.vocab_size, args.retrain_vocab)
  _log(f'done in {time.time() - start:.1f}s.')
  return 0


if __name__ == '__main__':
  from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top
  _startup.import_tensorflow(sys.argv)  # Quietly, before TFDS loads it.
  sys.exit(main())
