"""Fixture data in the real on-disk formats, written by our own writers.

`write_idx_gz` writes gzipped IDX files as (Fashion-)MNIST ships them;
`write_ztext` writes a SWORD zText module (.conf, .bzs/.bzv/.bzz) with the
full KJV slot layout but text only in the verses a test chooses. Neither uses
the readers under test, so a round trip checks the readers against the format
as documented, not against themselves.
"""

from __future__ import annotations

import gzip
import pathlib
import struct
import zlib

import numpy as np
import pytest

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.mt import versification
from lingvo_pipe.tasks.mt.versification import VerseRef


def write_idx_gz(path: pathlib.Path, array: np.ndarray) -> None:
  """array (uint8) as a gzipped IDX file: magic 0x0000 08 <ndim>, dims, data."""
  header = struct.pack('>HBB', 0, 0x08, array.ndim)
  header += struct.pack(f'>{array.ndim}I', *array.shape)
  path.parent.mkdir(parents=True, exist_ok=True)
  with gzip.open(path, 'wb') as f:
    f.write(header + array.astype(np.uint8).tobytes())


def write_ztext(library: pathlib.Path, module: str,
                verses: dict[VerseRef, str],
                versification_name: str = 'KJV') -> pathlib.Path:
  """Writes module `module` into SWORD library dir `library`.

  Each book is one zlib block (BlockType=BOOK, as Debian's modules are);
  headings get a book/chapter marker like the real ones, verses not in
  `verses` are empty slots. Returns the module's data directory.
  """
  data_dir = library / 'modules' / 'texts' / 'ztext' / module
  data_dir.mkdir(parents=True, exist_ok=True)
  (library / 'mods.d').mkdir(parents=True, exist_ok=True)
  (library / 'mods.d' / f'{module}.conf').write_text(
      f'[{module}]\nDataPath=./modules/texts/ztext/{module}/\nModDrv=zText\n'
      f'SourceType=OSIS\nEncoding=UTF-8\nCompressType=ZIP\nBlockType=BOOK\n'
      f'Versification={versification_name}\n', encoding='utf-8')
  for testament in versification.TESTAMENTS:
    blocks: list[bytearray] = [bytearray()]
    entries = []
    book_index = 0
    for slot, ref in enumerate(versification.layout(testament)):
      text = ''
      if slot == 1:
        text = '<milestone type="x-importer"/>'
      elif slot >= 2 and ref is None:
        nxt = versification.layout(testament)[slot + 1]
        if nxt is None:  # Book heading: a new block.
          blocks.append(bytearray())
          book_index += 1
          text = f'<div type="book" sID="b{book_index}"/>'
        else:
          text = f'<chapter sID="{nxt.book}.{nxt.chapter}"/> '
      elif ref is not None:
        text = verses.get(ref, '')
      raw = text.encode('utf-8')
      block = len(blocks) - 1
      entries.append(struct.pack('<IIH', block, len(blocks[block]), len(raw)))
      blocks[block] += raw
    bzz, bzs = bytearray(), bytearray()
    for raw in blocks:
      packed = zlib.compress(bytes(raw))
      bzs += struct.pack('<III', len(bzz), len(packed), len(raw))
      bzz += packed
    (data_dir / f'{testament}.bzs').write_bytes(bytes(bzs))
    (data_dir / f'{testament}.bzv').write_bytes(b''.join(entries))
    (data_dir / f'{testament}.bzz').write_bytes(bytes(bzz))
  return data_dir


V = VerseRef
# (ref, English markup, Spanish markup, expected clean English, Spanish).
# Expected texts are written by hand from the markup.
BIBLE_VERSES = [
    (V('Gen', 1, 1),
     'In the <w lemma="strong:H7225">beginning</w> <w lemma="strong:H0430">'
     'God</w> created the heaven and the earth. ',
     '<w lemma="strong:H7225">EN el principio</w> <w lemma="strong:H1254">'
     'crió</w> Dios los cielos y la tierra. ',
     'In the beginning God created the heaven and the earth.',
     'EN el principio crió Dios los cielos y la tierra.'),
    (V('Gen', 1, 2),
     '<div type="x-milestone" subType="x-preverse" sID="pv1"/><div sID="g4" '
     'type="x-p"/> <div type="x-milestone" subType="x-preverse" eID="pv1"/>'
     '\u00b6 And the earth was <transChange type="added">without</transChange>'
     ' form.<note placement="foot"><reference type="annotateRef">1.2 '
     '</reference>or, waste</note> <l eID="x" level="1"/>',
     'Y la tierra <w lemma="strong:H1961">estaba</w><transChange type="added">'
     'desordenada</transChange> y vacía.',
     'And the earth was without form.',
     'Y la tierra estaba desordenada y vacía.'),
    (V('Num', 12, 15), 'And Miriam was shut out.', 'Así María fué echada.',
     None, None),
    (V('Num', 12, 16), 'And afterward the people removed.', '', None, None),
    (V('Num', 13, 1), 'And the LORD spake unto Moses.',
     'Y Jehová habló á Moisés.', None, None),
    (V('Judg', 14, 18), 'And the men of the city said unto him.',
     'Y los de la ciudad le dijeron.', None, None),
    (V('Judg', 14, 19),
     'And the Spirit of the LORD came upon him, and he went down to Ashkelon, '
     'and slew thirty men of them.', 'Y él les respondió.', None, None),
    (V('Ruth', 1, 1), 'Now it came to pass in the days when the judges ruled.',
     'Y ACONTECIÓ en los días que gobernaban los jueces.',
     'Now it came to pass in the days when the judges ruled.',
     'Y ACONTECIÓ en los días que gobernaban los jueces.'),
    (V('Esth', 1, 1), 'Now it came to pass in the days of Ahasuerus.',
     'Y ACONTECIÓ en los días de Assuero.',
     'Now it came to pass in the days of Ahasuerus.',
     'Y ACONTECIÓ en los días de Assuero.'),
    (V('Ps', 3, 1),
     '<div type="x-milestone" subType="x-preverse" sID="pv2"/><title '
     'canonical="true" type="psalm">A <w lemma="strong:H4210">Psalm</w> of '
     'David.</title> <lg sID="g1"/> <l level="1" sID="g2"/> <div type='
     '"x-milestone" subType="x-preverse" eID="pv2"/><divineName>LORD'
     '</divineName>, how are they increased!',
     'Salmo de David. ¡OH Jehová, cuánto se han multiplicado!',
     'A Psalm of David. LORD, how are they increased!',
     'Salmo de David. ¡OH Jehová, cuánto se han multiplicado!'),
    (V('Ps', 119, 9),
     '<div type="x-milestone" subType="x-preverse" sID="pv3"/><title><foreign>'
     '\u05d1 BETH.</foreign></title> <div type="x-milestone" '
     'subType="x-preverse" eID="pv3"/>Wherewithal shall a young man cleanse '
     'his way?',
     '¿Con qué limpiará el joven su camino?',
     'Wherewithal shall a young man cleanse his way?',
     '¿Con qué limpiará el joven su camino?'),
    (V('John', 3, 16),
     '<q marker="" who="Jesus"><w lemma="strong:G1063">For</w> God so loved '
     'the world.</q>', 'Porque de tal manera amó Dios al mundo.',
     'For God so loved the world.', 'Porque de tal manera amó Dios al mundo.'),
    (V('Heb', 13, 25),
     'Grace <transChange type="added">be</transChange> with you all. Amen. '
     '<chapter eID="Heb.13"/> <title>Written to the Hebrews.</title> <div '
     'eID="b58" type="book"/>',
     'La gracia sea con todos vosotros. Amén. Fué escrita á los Hebreos.',
     'Grace be with you all. Amen. Written to the Hebrews.',
     'La gracia sea con todos vosotros. Amén. Fué escrita á los Hebreos.'),
    (V('Rev', 22, 21), 'The grace of our Lord be with you all. Amen.',
     'La gracia de nuestro Señor sea con todos vosotros. Amén.',
     'The grace of our Lord be with you all. Amen.',
     'La gracia de nuestro Señor sea con todos vosotros. Amén.'),
]


@pytest.fixture
def idx_writer():
  """`write_idx_gz`, for tests that write their own IDX files."""
  return write_idx_gz


@pytest.fixture
def ztext_writer():
  """`write_ztext`, for tests that write their own modules."""
  return write_ztext


@pytest.fixture
def bible_verses():
  """BIBLE_VERSES: (ref, en markup, es markup, clean en, clean es) rows."""
  return BIBLE_VERSES


@pytest.fixture
def sword_library(tmp_path: pathlib.Path) -> pathlib.Path:
  """A SWORD library holding fixture engKJV2006eb and spaRV1909eb modules."""
  library = tmp_path / 'sword'
  write_ztext(library, 'engKJV2006eb', {r: en for r, en, *_ in BIBLE_VERSES})
  write_ztext(library, 'spaRV1909eb',
              {r: es for r, _, es, *_ in BIBLE_VERSES})
  return library


@pytest.fixture
def fashion_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
  """IDX files of 5 train and 3 test images; returns (dir, {split: arrays})."""
  rng = np.random.default_rng(0)
  source = tmp_path / 'fashion'
  splits = {}
  for split, prefix, n in (('train', 'train', 5), ('test', 't10k', 3)):
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, (n,), dtype=np.uint8)
    write_idx_gz(source / f'{prefix}-images-idx3-ubyte.gz', images)
    write_idx_gz(source / f'{prefix}-labels-idx1-ubyte.gz', labels)
    splits[split] = (images, labels)
  return source, splits


@pytest.fixture
def empty_data_root(tmp_path: pathlib.Path,
                    monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
  """An empty cache root and system root: no Debian data anywhere."""
  root = tmp_path / 'cache'
  monkeypatch.setenv(data_paths.ENV_VAR, str(root))
  monkeypatch.setattr(data_paths, 'SYSTEM_ROOT', tmp_path / 'system')
  return root
