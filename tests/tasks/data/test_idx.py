"""The IDX reader: exact round trip, and clear errors on damaged files."""

import gzip

import numpy as np
import pytest

from lingvo_pipe.tasks.image.fashion_mnist import idx


def test_round_trip(tmp_path, idx_writer):
  images = np.arange(3 * 28 * 28, dtype=np.int64).reshape(3, 28, 28) % 256
  idx_writer(tmp_path / 'i.gz', images)
  out = idx.read_idx(tmp_path / 'i.gz', ndim=3)
  assert out.dtype == np.uint8 and out.shape == (3, 28, 28)
  np.testing.assert_array_equal(out, images)


def test_magic_is_checked(tmp_path, idx_writer):
  idx_writer(tmp_path / 'labels.gz', np.zeros(4, np.uint8))
  with pytest.raises(idx.IdxFormatError, match='rank 3'):
    idx.read_idx(tmp_path / 'labels.gz', ndim=3)
  with gzip.open(tmp_path / 'float.gz', 'wb') as f:
    f.write(bytes([0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0]))
  with pytest.raises(idx.IdxFormatError, match='magic 00000d01'):
    idx.read_idx(tmp_path / 'float.gz', ndim=1)


def test_short_payload_is_an_error(tmp_path):
  with gzip.open(tmp_path / 'short.gz', 'wb') as f:
    f.write(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2, 3]))  # Declares 5, has 3.
  with pytest.raises(idx.IdxFormatError, match='5 bytes but 3 bytes follow'):
    idx.read_idx(tmp_path / 'short.gz', ndim=1)


def test_truncated_gzip_names_file_and_fix(tmp_path, idx_writer):
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  idx_writer(path, np.ones((10, 28, 28), np.uint8))
  path.write_bytes(path.read_bytes()[:-20])
  with pytest.raises(idx.IdxFormatError) as e:
    idx.read_idx(path, ndim=3)
  assert str(path) in str(e.value)
  assert 'prepare_data' in str(e.value)


def test_split_checks_counts_and_labels(tmp_path, idx_writer):
  idx_writer(tmp_path / 'i.gz', np.zeros((3, 28, 28), np.uint8))
  idx_writer(tmp_path / 'l.gz', np.zeros(2, np.uint8))
  with pytest.raises(idx.IdxFormatError, match='3 images but .* 2 labels'):
    idx.read_split(tmp_path / 'i.gz', tmp_path / 'l.gz')
  idx_writer(tmp_path / 'l.gz', np.array([0, 1, 10], np.uint8))
  with pytest.raises(idx.IdxFormatError, match='label 10'):
    idx.read_split(tmp_path / 'i.gz', tmp_path / 'l.gz')
