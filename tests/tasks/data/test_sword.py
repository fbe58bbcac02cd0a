"""The zText reader and OSIS cleaning, against modules our own writer wrote."""

import pytest

from lingvo_pipe.tasks.mt import sword
from lingvo_pipe.tasks.mt import versification
from lingvo_pipe.tasks.mt.versification import VerseRef


def test_versification_totals():
  # The published KJV totals, independent of how the table was derived.
  for testament, books, chapters, verses in (('ot', 39, 929, 23145),
                                             ('nt', 27, 260, 7957)):
    table = versification.books(testament)
    assert len(table) == books
    assert sum(len(c) for _, c in table) == chapters
    assert sum(sum(c) for _, c in table) == verses
    layout = versification.layout(testament)
    assert len(layout) == 2 + books + chapters + verses
  assert versification.layout('ot')[4] == VerseRef('Gen', 1, 1)
  assert versification.layout('nt')[-1] == VerseRef('Rev', 22, 21)
  assert dict(versification.books('ot'))['Ps'][118] == 176  # Psalm 119.
  assert len(set(versification.book_ids())) == 66


def test_reader_decodes_written_markup_exactly(sword_library, bible_verses):
  module = sword.ZTextModule.from_library(sword_library, 'engKJV2006eb')
  verses = module.verses()
  assert len(verses) == 31102  # Heading slots are skipped.
  written = {ref: en for ref, en, *_ in bible_verses}
  for ref, text in verses.items():
    assert text == written.get(ref, ''), ref


def test_reader_returns_heading_slots(sword_library):
  slots = sword.ZTextModule.from_library(sword_library,
                                         'spaRV1909eb').slots('nt')
  assert len(slots) == len(versification.layout('nt'))
  assert slots[3].startswith('<chapter sID="Matt.1"')


def test_clean_text(sword_library, bible_verses):
  for module, column in (('engKJV2006eb', 3), ('spaRV1909eb', 4)):
    clean = sword.read_clean_verses(sword_library, module)
    for row in bible_verses:
      if row[column] is not None:
        assert clean[row[0]] == row[column], (module, row[0])


@pytest.mark.parametrize('markup, expected', [
    ('a <w lemma="x">b</w>, c', 'a b, c'),
    ('a<note type="x">gone <reference>1.1</reference></note> b', 'a b'),
    ('<title type="main">Genesis</title>In it', 'In it'),
    ('x. <chapter eID="Rom.16"/> <title>Written to the Romans.</title>',
     'x. Written to the Romans.'),
    ('<w>por</w><transChange type="added">medio</transChange><w>de</w>',
     'por medio de'),
    ('<w>give</w>n &amp; \u00b6 taken', 'given & taken'),
])
def test_clean_osis(markup, expected):
  assert sword.clean_osis(markup) == expected


def test_truncated_index_is_an_error(sword_library):
  bzv = (sword_library / 'modules/texts/ztext/engKJV2006eb/nt.bzv')
  bzv.write_bytes(bzv.read_bytes()[:-10])
  module = sword.ZTextModule.from_library(sword_library, 'engKJV2006eb')
  with pytest.raises(sword.SwordFormatError, match='8246 slots'):
    module.slots('nt')


def test_corrupt_block_is_an_error(sword_library):
  bzz = (sword_library / 'modules/texts/ztext/engKJV2006eb/ot.bzz')
  data = bytearray(bzz.read_bytes())
  data[:8] = b'garbage!'
  bzz.write_bytes(bytes(data))
  module = sword.ZTextModule.from_library(sword_library, 'engKJV2006eb')
  with pytest.raises(sword.SwordFormatError, match='not zlib data'):
    module.slots('ot')


def test_conf_must_declare_kjv_ztext(tmp_path, ztext_writer):
  ztext_writer(tmp_path, 'other', {}, versification_name='Catholic')
  with pytest.raises(sword.SwordFormatError, match='Versification'):
    sword.ZTextModule.from_library(tmp_path, 'other')
  with pytest.raises(sword.SwordFormatError, match='declares module'):
    sword.ZTextModule.from_library(tmp_path, 'absent')
