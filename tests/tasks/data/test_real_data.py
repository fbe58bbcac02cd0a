"""The real Debian data, where it is on this machine (skipped elsewhere).

Run `python -m lingvo_pipe.tasks.prepare_data` first; these tests read the sources with
our readers (no TFDS) and check facts known independently of our code.
"""

import numpy as np
import pytest

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.image.fashion_mnist import idx
from lingvo_pipe.tasks.mt import bible_en_es
from lingvo_pipe.tasks.mt import sword
from lingvo_pipe.tasks.mt.versification import VerseRef


def _source_or_skip(dataset):
  missing = data_paths.missing_packages(dataset)
  if missing:
    pytest.skip(f'Debian data not present ({missing}); run python -m '
                'lingvo_pipe.tasks.prepare_data.')
  return data_paths.require(dataset)


def test_kjv_and_rv1909_align():
  found = _source_or_skip('bible_en_es')
  en = sword.read_clean_verses(found['sword-text-kjv'], 'engKJV2006eb')
  es = sword.read_clean_verses(found['sword-text-sparv'], 'spaRV1909eb')
  assert len(en) == len(es) == 31102
  gen = VerseRef('Gen', 1, 1)
  assert en[gen] == 'In the beginning God created the heaven and the earth.'
  assert es[gen] == 'EN el principio crió Dios los cielos y la tierra.'
  assert en[VerseRef('John', 3, 16)] == (
      'For God so loved the world, that he gave his only begotten Son, that '
      'whosoever believeth in him should not perish, but have everlasting '
      'life.')
  assert es[VerseRef('John', 3, 16)].startswith(
      'Porque de tal manera amó Dios al mundo')
  pairs = bible_en_es.aligned_pairs(en, es)
  assert 30000 <= len(pairs) <= 31102
  assert all(a and b and '<' not in a + b for _, a, b in pairs)
  dev = [p for p in pairs if bible_en_es.split_of(p[0].book) == 'validation']
  test = [p for p in pairs if bible_en_es.split_of(p[0].book) == 'test']
  assert 1000 <= len(dev) <= 1500 and 1000 <= len(test) <= 1500


def test_fashion_mnist_idx():
  found = _source_or_skip('fashion_mnist')['dataset-fashion-mnist']
  for prefix, n in (('train', 60000), ('t10k', 10000)):
    images, labels = idx.read_split(found / f'{prefix}-images-idx3-ubyte.gz',
                                    found / f'{prefix}-labels-idx1-ubyte.gz')
    assert images.shape == (n, 28, 28)
    # Fashion-MNIST is balanced: n / 10 images of every class.
    np.testing.assert_array_equal(np.bincount(labels, minlength=10),
                                  [n // 10] * 10)
