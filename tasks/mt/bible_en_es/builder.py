"""TFDS builder of aligned English–Spanish Bible verses, from local files.

Two public-domain Bibles ship as Debian packages: the King James Version
(`sword-text-kjv`, module engKJV2006eb) and the Reina-Valera 1909
(`sword-text-sparv`, module spaRV1909eb). Both use KJV versification, so
verse (book, chapter, verse) of one translates the same verse of the other:
about 30,000 sentence pairs of real parallel text, with no download.

Alignment and cleaning (`aligned_pairs`):
  * Markup is stripped with `sword.clean_osis` (notes and headings dropped).
  * RV1909 follows Spanish verse numbering in a few chapters (Num 13, 1 Sam
    24, Job 39-41, Jonah 2, ...) while filling KJV slots, which leaves an
    empty slot and shifts the rest of the chapter. A chapter is dropped when
    one side has a verse the other lacks (and so is the next chapter of the
    book, into which the shift carries), or when a pair's length ratio
    (Spanish / English characters) is outside [0.4, 2.5], which in these
    texts happens only in shifted chapters (Judg 14, 1 Kgs 22, 1 Chr 21).
    About 800 of the 31,102 verses go; pairs empty on a side never remain.

Splits are whole books, so no verse of a held-out book has a near-duplicate
(a synoptic parallel, a Kings/Chronicles doublet) in training:
  * validation = Ruth, Ecclesiastes, John            (1,186 verses)
  * test = Esther, Daniel, Romans, Hebrews           (1,260 verses)
  * train = every other verse                        (about 28,000)

Features: en, es (text), book (OSIS id, e.g. 'John'), chapter, verse (int32).

The two modules are read from TFDS's manual directory, a SWORD library:

    tfds build lingvo_pipe_bible_en_es --imports=lingvo_pipe \\
        --manual_dir=/usr/share/sword
"""

from __future__ import annotations

import collections
from typing import Any, Iterator

import numpy as np
import tensorflow_datasets as tfds

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.mt import sword
from lingvo_pipe.tasks.mt.versification import VerseRef

EN_MODULE = 'engKJV2006eb'
ES_MODULE = 'spaRV1909eb'
DEV_BOOKS = ('Ruth', 'Eccl', 'John')
TEST_BOOKS = ('Esth', 'Dan', 'Rom', 'Heb')
MIN_LENGTH_RATIO, MAX_LENGTH_RATIO = 0.4, 2.5
SPLITS = ('train', 'validation', 'test')
_CITATION = """\
@misc{crosswire_kjv,
  title  = {King James Version (1769) with Strongs Numbers and Morphology},
  note   = {SWORD module engKJV2006eb, The CrossWire Bible Society},
  url    = {https://www.crosswire.org/sword/modules/ModInfo.jsp?modName=KJV},
}
@misc{crosswire_rv1909,
  title  = {Reina-Valera 1909},
  note   = {SWORD module spaRV1909eb, The CrossWire Bible Society},
  url    = {https://www.crosswire.org/sword/modules/},
}
"""


def split_of(book: str) -> str:
  """'validation', 'test' or 'train': the split holding every verse of
  `book`."""
  if book in DEV_BOOKS:
    return 'validation'
  return 'test' if book in TEST_BOOKS else 'train'


def aligned_pairs(en: dict[VerseRef, str], es: dict[VerseRef, str]
                 ) -> list[tuple[VerseRef, str, str]]:
  """(verse, English, Spanish) of the verses both sides align on.

  Args:
    en: Clean English text of every verse (empty strings allowed), in
      canonical order (as `sword.read_clean_verses` returns it).
    es: Clean Spanish text, same keys.

  Returns:
    Pairs in the order of `en`, without the chapters dropped by the rules of
    the module docstring.
  """
  bad_chapters, both = set(), []
  for ref in en:
    a, b = en[ref], es.get(ref, '')
    if not a and not b:
      continue  # A verse neither module has: nothing shifted.
    if not a or not b:
      bad_chapters.update({(ref.book, ref.chapter),
                           (ref.book, ref.chapter + 1)})
    elif not MIN_LENGTH_RATIO <= len(b) / len(a) <= MAX_LENGTH_RATIO:
      bad_chapters.add((ref.book, ref.chapter))
    else:
      both.append((ref, a, b))
  return [pair for pair in both
          if (pair[0].book, pair[0].chapter) not in bad_chapters]


class LingvoPipeBibleEnEs(tfds.core.GeneratorBasedBuilder):
  """Aligned KJV / RV1909 verses (see the module docstring)."""

  name = 'lingvo_pipe_bible_en_es'
  VERSION = tfds.core.Version('2.0.0')
  RELEASE_NOTES = {
      '1.0.0': 'KJV (engKJV2006eb 14.3) and RV1909 (spaRV1909eb 2.60) from '
               'Debian bookworm.',
      '2.0.0': 'The dev split is named validation, as TFDS names it; '
               'citation and licence; the modules come from manual_dir.',
  }
  MANUAL_DOWNLOAD_INSTRUCTIONS = f"""\
  The manual directory must be a SWORD library (mods.d/ and modules/) that
  holds the modules {EN_MODULE} and {ES_MODULE}. Debian ships them in the
  packages sword-text-kjv and sword-text-sparv (`sudo apt-get install
  sword-text-kjv sword-text-sparv`, then --manual_dir=/usr/share/sword), or
  run `python -m lingvo_pipe.tasks.prepare_data --datasets=bible_en_es`,
  which extracts the packages without root and builds this dataset.
  """

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=('English (King James Version, 1769 text) and Spanish '
                     '(Reina-Valera 1909) Bible verses aligned by KJV '
                     'versification; public domain; from Debian '
                     'sword-text-kjv and sword-text-sparv.'),
        features=tfds.features.FeaturesDict({
            'en': tfds.features.Text(),
            'es': tfds.features.Text(),
            'book': tfds.features.Text(),
            'chapter': tfds.features.Scalar(np.int32),
            'verse': tfds.features.Scalar(np.int32),
        }),
        supervised_keys=('en', 'es'),
        homepage='https://www.crosswire.org/sword/modules/',
        citation=_CITATION,
        license='Public domain (both texts).',
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
    sources = data_paths.SOURCES['bible_en_es']
    library = data_paths.checked_manual_dir(
        dl_manager, [f for source in sources for f in source.files],
        self.MANUAL_DOWNLOAD_INSTRUCTIONS)
    pairs = aligned_pairs(sword.read_clean_verses(library, EN_MODULE),
                          sword.read_clean_verses(library, ES_MODULE))
    by_split = collections.defaultdict(list)
    for pair in pairs:
      by_split[split_of(pair[0].book)].append(pair)
    return {split: self._generate_examples(by_split[split])
            for split in SPLITS}

  def _generate_examples(self, pairs: list[tuple[VerseRef, str, str]]
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
    for ref, en, es in pairs:
      yield f'{ref.book}.{ref.chapter}.{ref.verse}', {
          'en': en, 'es': es, 'book': ref.book, 'chapter': ref.chapter,
          'verse': ref.verse}
