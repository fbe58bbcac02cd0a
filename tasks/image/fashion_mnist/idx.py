"""Reads the IDX files of (Fashion-)MNIST with gzip and numpy only.

IDX is a tiny big-endian format: a 4-byte magic (two zero bytes, a type code,
the number of dimensions), one u32 per dimension, then the values. We read it
ourselves rather than through TFDS's `fashion_mnist`, because Debian's
`.gz` files carry different gzip headers from upstream's, so TFDS's recorded
checksums never match; the *content* is the same, and that is what we check:
the magic, the type, the shape and the exact byte count. A corrupt or
truncated file is an `IdxFormatError` naming the file and the fix, never a
silently short array.
"""

from __future__ import annotations

import gzip
import pathlib
import struct
import zlib

import numpy as np

from lingvo_pipe import errors

_UBYTE = 0x08  # The only IDX element type (M)NIST uses.


class IdxFormatError(errors.LingvoPipeError):
  """A file is not a well-formed IDX file of the expected kind."""


def read_idx(path: str | pathlib.Path, ndim: int) -> np.ndarray:
  """The uint8 array stored in the gzipped IDX file `path`.

  Args:
    path: A `*-idx{ndim}-ubyte.gz` file.
    ndim: Expected number of dimensions (3 for images, 1 for labels).

  Returns:
    A uint8 array of the shape the header declares.

  Raises:
    IdxFormatError: bad gzip data, bad magic, other type or rank, or a
      payload shorter or longer than the header declares.
  """
  path = pathlib.Path(path)
  fix = ('Re-extract the Debian package dataset-fashion-mnist: delete the '
         'file and run `python -m lingvo_pipe.tasks.prepare_data --datasets='
         'fashion_mnist`.')
  try:
    with gzip.open(path, 'rb') as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:
    raise IdxFormatError(f'{path}: not a complete gzip file ({e}). {fix}') \
        from e
  if len(data) < 4:
    raise IdxFormatError(f'{path}: {len(data)} bytes, too short for an IDX '
                         f'header. {fix}')
  zero, dtype, rank = struct.unpack_from('>HBB', data)
  if zero != 0 or dtype != _UBYTE or rank != ndim:
    raise IdxFormatError(
        f'{path}: magic {data[:4].hex()} is not an unsigned-byte IDX file of '
        f'rank {ndim} (expected 000008{ndim:02x}). {fix}')
  header = 4 + 4 * rank
  if len(data) < header:
    raise IdxFormatError(f'{path}: header truncated. {fix}')
  shape = struct.unpack_from(f'>{rank}I', data, 4)
  size = int(np.prod(shape))
  if len(data) - header != size:
    raise IdxFormatError(
        f'{path}: header declares shape {tuple(shape)} = {size} bytes but '
        f'{len(data) - header} bytes follow. {fix}')
  return np.frombuffer(data, np.uint8, size, header).reshape(shape)


def read_split(image_path: str | pathlib.Path,
               label_path: str | pathlib.Path,
               num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
  """Images [N, H, W] and labels [N] of one split, checked against each other.

  Raises:
    IdxFormatError: the files disagree on N, or a label is ≥ num_classes.
  """
  images = read_idx(image_path, ndim=3)
  labels = read_idx(label_path, ndim=1)
  if images.shape[0] != labels.shape[0]:
    raise IdxFormatError(
        f'{image_path} holds {images.shape[0]} images but {label_path} '
        f'holds {labels.shape[0]} labels; the files come from different '
        'splits or one is damaged.')
  if labels.size and labels.max() >= num_classes:
    raise IdxFormatError(f'{label_path}: label {labels.max()} is not in '
                         f'[0, {num_classes}).')
  return images, labels
