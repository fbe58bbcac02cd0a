"""The TFDS builders on fixture files: splits and examples, never a download."""

import numpy as np
import pytest

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks import datasets
from lingvo_pipe.tasks.mt import bible_en_es
from lingvo_pipe.tasks.mt.versification import VerseRef


def _as_set(images, labels):
  return sorted((int(l), i.tobytes()) for i, l in zip(images, labels))


def test_fashion_mnist_splits_equal_the_idx_files(tmp_path, fashion_dir):
  source, expected = fashion_dir
  data_dir = tmp_path / 'tfds'
  for split, (images, labels) in expected.items():
    got = datasets.load('fashion_mnist', split, data_dir=data_dir,
                        manual_dir=source)
    assert got['image'].shape == (len(labels), 28, 28, 1)
    assert got['image'].dtype == np.uint8
    assert _as_set(got['image'][..., 0], got['label']) == _as_set(
        images, labels)
  b = datasets.builder('fashion_mnist', data_dir=data_dir)
  assert b.is_prepared()  # Later loads need no source at all.
  assert b.info.features['label'].names[9] == 'Ankle boot'
  with pytest.raises(ValueError, match="not 'dev'"):
    datasets.load('fashion_mnist', 'dev', data_dir=data_dir)


def _fixture_pairs(bible_verses):
  """Expected (book, chapter, verse, en, es) per split, from the table."""
  out = {'train': [], 'validation': [], 'test': []}
  for ref, _, _, en, es in bible_verses:
    if en is not None:  # None marks a verse of a dropped chapter.
      out[bible_en_es.split_of(ref.book)].append(
          (ref.book, ref.chapter, ref.verse, en, es))
  return out


def test_bible_splits_hold_the_aligned_verses(tmp_path, sword_library,
                                              bible_verses):
  expected = _fixture_pairs(bible_verses)
  assert all(expected.values())  # The fixture covers every split.
  for split, rows in expected.items():
    got = datasets.load('bible_en_es', split, data_dir=tmp_path / 'tfds',
                        manual_dir=sword_library)
    records = sorted(zip(got['book'], got['chapter'].tolist(),
                         got['verse'].tolist(), got['en'], got['es']))
    assert records == sorted(rows), split


def test_alignment_drops_shifted_chapters():
  v = VerseRef
  en = {v('Num', 12, 1): 'a b c', v('Num', 12, 2): 'a b c',
        v('Num', 13, 1): 'a b c', v('Num', 14, 1): 'a b c',
        v('Judg', 1, 1): 'a b c', v('Judg', 1, 2): 'x' * 100,
        v('Judg', 2, 1): 'a b c', v('Gen', 1, 1): ''}
  es = dict(en)
  es[v('Num', 12, 2)] = ''  # Shift: drops Num 12 and Num 13, not Num 14.
  es[v('Judg', 1, 2)] = 'x' * 39  # Ratio 0.39: drops Judg 1 only.
  pairs = bible_en_es.aligned_pairs(en, es)
  assert [p[0] for p in pairs] == [v('Num', 14, 1), v('Judg', 2, 1)]


def test_held_out_books_are_disjoint():
  assert not set(bible_en_es.DEV_BOOKS) & set(bible_en_es.TEST_BOOKS)
  assert bible_en_es.split_of('Gen') == 'train'
  assert {bible_en_es.split_of(b)
          for b in bible_en_es.DEV_BOOKS} == {'validation'}


def test_missing_sources_raise_before_building(tmp_path, empty_data_root):
  for name, package in (('fashion_mnist', 'dataset-fashion-mnist'),
                        ('bible_en_es', 'sword-text-kjv')):
    with pytest.raises(data_paths.MissingDataError, match=package):
      datasets.load(name, 'train', data_dir=tmp_path / 'tfds')


def test_builders_carry_citation_licence_and_manual_instructions(tmp_path):
  for name, words in (('fashion_mnist', ('xiao2017', 'MIT')),
                      ('bible_en_es', ('Reina-Valera', 'Public domain'))):
    b = datasets.builder(name, data_dir=tmp_path)
    assert words[0] in b.info.citation
    assert words[1] in b.info.redistribution_info.license
    assert 'prepare_data' in b.MANUAL_DOWNLOAD_INSTRUCTIONS


def test_a_manual_dir_without_the_sources_names_the_files(tmp_path):
  manual = tmp_path / 'manual'
  manual.mkdir()
  (manual / 'README').write_text('not the data')
  with pytest.raises(data_paths.MissingDataError,
                     match=r'lacks train-images-idx3-ubyte.gz.*apt-get'):
    datasets.prepare('fashion_mnist', tmp_path / 'tfds', manual_dir=manual)
  with pytest.raises(data_paths.MissingDataError, match='does not exist'):
    datasets.prepare('fashion_mnist', tmp_path / 'tfds',
                     manual_dir=tmp_path / 'nowhere')
