"""data_paths: where sources are found, and the one error when they are not."""

import pathlib

import pytest

from lingvo_pipe.tasks import data_paths


def test_cache_layout_follows_env(tmp_path, monkeypatch):
  monkeypatch.setenv(data_paths.ENV_VAR, str(tmp_path))
  assert data_paths.cache_root() == tmp_path
  assert data_paths.debian_root() == tmp_path / 'debian'
  assert data_paths.tfds_dir() == tmp_path / 'tfds'
  assert data_paths.vocab_dir() == tmp_path / 'vocab'


def test_default_root_is_user_cache(monkeypatch):
  monkeypatch.delenv(data_paths.ENV_VAR, raising=False)
  assert data_paths.cache_root() == (
      pathlib.Path.home() / '.cache' / 'lingvo_pipe')


def test_missing_error_names_packages_and_fix(empty_data_root):
  with pytest.raises(data_paths.MissingDataError) as e:
    data_paths.require('bible_en_es')
  message = str(e.value)
  assert 'sword-text-kjv' in message and 'sword-text-sparv' in message
  assert 'python -m lingvo_pipe.tasks.prepare_data --datasets=bible_en_es' in message
  assert 'tools/setup.sh' in message
  assert str(empty_data_root / 'debian' / 'usr/share/sword') in message
  assert data_paths.missing_packages('bible_en_es') == [
      'sword-text-kjv', 'sword-text-sparv']


def _touch_fashion(base: pathlib.Path) -> None:
  base.mkdir(parents=True)
  for name in data_paths.FASHION_MNIST_FILES:
    (base / name).write_bytes(b'')


def test_finds_cache_then_system_location(empty_data_root, tmp_path):
  rel = 'usr/share/datasets/fashion-mnist'
  system = tmp_path / 'system' / rel
  _touch_fashion(system)
  assert data_paths.require('fashion_mnist') == {
      'dataset-fashion-mnist': system}
  cached = empty_data_root / 'debian' / rel
  _touch_fashion(cached)  # The cache wins over the system-wide install.
  assert data_paths.require('fashion_mnist')['dataset-fashion-mnist'] == cached


def test_partial_package_counts_as_missing(empty_data_root):
  base = empty_data_root / 'debian' / 'usr/share/datasets/fashion-mnist'
  base.mkdir(parents=True)
  (base / data_paths.FASHION_MNIST_FILES[0]).write_bytes(b'')
  assert data_paths.missing_packages('fashion_mnist') == [
      'dataset-fashion-mnist']


def test_unknown_dataset():
  with pytest.raises(KeyError, match='fashion_mnist'):
    data_paths.require('mnist')
