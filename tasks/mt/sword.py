"""A small pure-Python reader of SWORD zText Bible modules.

Debian ships public-domain Bibles as SWORD modules (`sword-text-*`); reading
them directly needs no libsword and no network. A zText module keeps each
testament in three files:

    <t>.bzs  block index:  per block  u32 offset, u32 size, u32 raw size
    <t>.bzv  verse index:  per slot   u32 block, u32 offset, u16 size
    <t>.bzz  the blocks, each compressed on its own with zlib

all little-endian, so a slot's text is
`zlib.decompress(bzz[offset:offset + size])[voffset:voffset + vsize]`.
Slots are in the order of the module's versification (`versification.py`);
heading slots (module, book, chapter) are skipped. The text is OSIS XML;
`clean_osis` turns it into plain text for translation.

>>> from lingvo_pipe.tasks import data_paths
>>> library = data_paths.manual_dir('bible_en_es')  # e.g. /usr/share/sword
>>> module = ZTextModule.from_library(library, 'engKJV2006eb')
>>> verses = module.verses()  # {VerseRef('Gen', 1, 1): '<w ...>', ...}
>>> clean_osis(verses[VerseRef('Gen', 1, 1)])
'In the beginning God created the heaven and the earth.'
"""

from __future__ import annotations

import html
import pathlib
import re
import struct
import zlib

from lingvo_pipe import errors
from lingvo_pipe.tasks.mt import versification
from lingvo_pipe.tasks.mt.versification import VerseRef

_BLOCK = struct.Struct('<III')  # offset, compressed size, raw size
_SLOT = struct.Struct('<IIH')  # block, offset in the raw block, size


class SwordFormatError(errors.LingvoPipeError):
  """A module's files are not the zText layout this reader understands."""


def _read_conf(path: pathlib.Path) -> tuple[str, dict[str, str]]:
  """The module name ('[name]') and `key=value` entries of a .conf file."""
  name, entries = '', {}
  for line in path.read_text(encoding='utf-8', errors='replace').splitlines():
    line = line.strip()
    if line.startswith('[') and line.endswith(']') and not name:
      name = line[1:-1]
    elif '=' in line and not line.startswith('#'):
      key, value = line.split('=', 1)
      entries.setdefault(key.strip(), value.strip())
  return name, entries


class ZTextModule:
  """The verse texts of one zText module (see the module docstring)."""

  def __init__(self, data_dir: str | pathlib.Path, name: str = '') -> None:
    """Args: data_dir holds ot.bz{s,v,z} and nt.bz{s,v,z}; name is for errors."""
    self._dir = pathlib.Path(data_dir)
    self._name = name or self._dir.name

  @classmethod
  def from_library(cls, library: str | pathlib.Path,
                   module: str) -> 'ZTextModule':
    """Opens `module` of a SWORD library dir (holding mods.d/, modules/).

    Raises:
      SwordFormatError: no .conf declares `module`, or it is not a
        zlib-compressed zText module with KJV versification.
    """
    library = pathlib.Path(library)
    for conf in sorted((library / 'mods.d').glob('*.conf')):
      name, entries = _read_conf(conf)
      if name.lower() == module.lower():
        break
    else:
      raise SwordFormatError(
          f'No {library / "mods.d"}/*.conf declares module [{module}]; is '
          'the Debian package extracted there?')
    expected = {'ModDrv': 'zText', 'CompressType': 'ZIP',
                'Versification': 'KJV'}
    for key, want in expected.items():
      # SWORD's default versification, when a .conf names none, is KJV.
      got = entries.get(key, 'KJV' if key == 'Versification' else '')
      if got.lower() != want.lower():
        raise SwordFormatError(
            f'{conf}: {key}={got!r}, but this reader handles only {key}='
            f'{want}; pick a module with that layout.')
    if 'DataPath' not in entries:
      raise SwordFormatError(f'{conf}: no DataPath= entry.')
    return cls(library / entries['DataPath'], name)

  def slots(self, testament: str) -> list[str]:
    """The raw text of every index slot of 'ot' or 'nt' (headings too)."""
    bzs, bzv, bzz = (self._path(testament, ext).read_bytes()
                     for ext in ('bzs', 'bzv', 'bzz'))
    expected = len(versification.layout(testament))
    if len(bzv) != expected * _SLOT.size or len(bzs) % _BLOCK.size:
      raise SwordFormatError(
          f'{self._path(testament, "bzv")}: {len(bzv)} bytes, expected '
          f'{expected} slots × {_SLOT.size} bytes = {expected * _SLOT.size} '
          f'for KJV versification (and .bzs a multiple of {_BLOCK.size}, got '
          f'{len(bzs)}). The module is truncated or not KJV-versified.')
    blocks = [_BLOCK.unpack_from(bzs, i) for i in range(0, len(bzs),
                                                         _BLOCK.size)]
    raw: dict[int, bytes] = {}
    out = []
    for i in range(expected):
      block, offset, size = _SLOT.unpack_from(bzv, i * _SLOT.size)
      if size == 0:
        out.append('')
        continue
      if block not in raw:
        raw[block] = self._block(testament, blocks, block, bzz)
      text = raw[block][offset:offset + size]
      if len(text) != size:
        raise SwordFormatError(
            f'{self._name} {testament} slot {i}: bytes {offset}..'
            f'{offset + size} are past the end of block {block} '
            f'({len(raw[block])} bytes).')
      out.append(text.decode('utf-8'))
    return out

  def verses(self) -> dict[VerseRef, str]:
    """Raw OSIS text of every verse of both testaments, in canonical order."""
    out = {}
    for testament in versification.TESTAMENTS:
      for ref, text in zip(versification.layout(testament),
                           self.slots(testament)):
        if ref is not None:
          out[ref] = text
    return out

  def _path(self, testament: str, ext: str) -> pathlib.Path:
    return self._dir / f'{testament}.{ext}'

  def _block(self, testament: str, blocks: list[tuple[int, int, int]],
             block: int, bzz: bytes) -> bytes:
    where = f'{self._path(testament, "bzz")} block {block}'
    if block >= len(blocks):
      raise SwordFormatError(f'{where}: the .bzs lists only {len(blocks)} '
                             'blocks.')
    offset, size, raw_size = blocks[block]
    try:
      data = zlib.decompress(bzz[offset:offset + size])
    except zlib.error as e:
      raise SwordFormatError(f'{where}: not zlib data ({e}); the file is '
                             'corrupt, extract the package again.') from e
    if len(data) != raw_size:
      raise SwordFormatError(f'{where}: {len(data)} bytes after '
                             f'decompression, the .bzs says {raw_size}.')
    return data


# ---- OSIS markup to plain text ----------------------------------------------
# Notes (footnotes, cross references) are not part of the verse, nor are
# editorial headings. Titles are dropped except those that are text: canonical
# ones and psalm superscriptions ('A Psalm of David, ...'), and subscriptions
# after a book's last chapter ('Written to the Hebrews from Italy ...'). The
# Spanish module has both inline in the verse, so dropping them on one side
# would leave the pair misaligned.
_NOTE = re.compile(r'<note\b[^>]*>.*?</note\s*>', re.S)
_TITLE = re.compile(r'<title\b([^>]*)>(.*?)</title\s*>', re.S)
_TEXT_TITLE = re.compile(r'canonical="true"|type="(?:psalm|acrostic)"')
_CHAPTER_END = re.compile(r'<chapter\b[^>]*\beID=')
# RV1909 marks words with <w> and translator additions with <transChange>
# and writes no space where the two meet; KJV has mid-word </w> ('give</w>n').
_WORD_SEAMS = (re.compile(r'</w>(?=<transChange\b)'),
               re.compile(r'</transChange>(?=<w\b)'))
# Tags that separate words (lines, paragraphs, milestones) become a space,
# inline ones (<w>, <transChange>, <divineName>, <q>, ...) vanish.
_BREAK_TAG = re.compile(r'</?(?:l|lb|lg|div|chapter|milestone|p|title|verse)'
                        r'\b[^>]*>')
_TAG = re.compile(r'<[^>]*>')
_SPACE = re.compile(r'\s+')
_PILCROW = '\u00b6'  # KJV paragraph mark, markup rather than text.


def _title_text(m: re.Match) -> str:
  keep = (_TEXT_TITLE.search(m.group(1)) or
          _CHAPTER_END.search(m.string, 0, m.start()))
  return f' {m.group(2)} ' if keep else ' '


def clean_osis(markup: str) -> str:
  """Plain text of one verse: tags stripped, notes and headings dropped.

  >>> clean_osis('In the <w lemma="strong:H7225">beginning</w>.<note>or, '
  ...            'first</note> <l eID="x"/>')
  'In the beginning.'
  """
  text = _TITLE.sub(_title_text, _NOTE.sub(' ', markup))
  for seam in _WORD_SEAMS:
    text = seam.sub(' ', text)
  text = _TAG.sub('', _BREAK_TAG.sub(' ', text))
  text = html.unescape(text).replace(_PILCROW, ' ')
  return _SPACE.sub(' ', text).strip()


def read_clean_verses(library: str | pathlib.Path,
                      module: str) -> dict[VerseRef, str]:
  """Plain text of every verse of `module` (empty verses kept as '')."""
  verses = ZTextModule.from_library(library, module).verses()
  return {ref: clean_osis(text) for ref, text in verses.items()}
