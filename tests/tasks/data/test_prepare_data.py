"""prepare_data wiring: builds from sources already in the cache, offline."""

import pytest

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks import prepare_data


def test_builds_from_cached_sources_without_fetching(
    empty_data_root, fashion_dir, monkeypatch, capsys):
  source, _ = fashion_dir
  target = empty_data_root / 'debian' / 'usr/share/datasets/fashion-mnist'
  target.parent.mkdir(parents=True)
  source.rename(target)

  def no_subprocess(*args, **kwargs):
    raise AssertionError(f'Sources are present; ran {args}.')
  monkeypatch.setattr(prepare_data.subprocess, 'run', no_subprocess)

  assert prepare_data.main(['--datasets=fashion_mnist']) == 0
  out = capsys.readouterr().out
  assert 'nothing to fetch' in out and 'test 3, train 5' in out
  assert (data_paths.tfds_dir() / 'lingvo_pipe_fashion_mnist').is_dir()
  assert prepare_data.main(['--datasets=fashion_mnist']) == 0
  assert 'already built' in capsys.readouterr().out


def test_unknown_dataset_is_refused(empty_data_root, capsys):
  assert prepare_data.main(['--datasets=mnist']) == 2
  assert 'mnist' in capsys.readouterr().out


def test_missing_apt_get_names_the_package(empty_data_root, monkeypatch):
  monkeypatch.setattr(prepare_data.shutil, 'which', lambda _: None)
  with pytest.raises(data_paths.MissingDataError,
                     match='dataset-fashion-mnist'):
    prepare_data.main(['--datasets=fashion_mnist'])
