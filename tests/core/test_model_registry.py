"""The model registry: names, lazy import, listing, composed params."""

import sys

from absl import flags
import pytest

from lingvo_pipe.core import base_model
from lingvo_pipe.core import model_registry

_NAME = 'synthetic.regression.MlpRegression'
_MODULE = 'lingvo_pipe.params.synthetic.regression'


def test_name_is_module_under_params_plus_class():
  cls = model_registry.get_class(_NAME)
  assert cls.__module__ == _MODULE and cls.__name__ == 'MlpRegression'
  assert model_registry.model_name(cls) == _NAME


def test_lookup_imports_only_the_models_module(monkeypatch):
  monkeypatch.delitem(sys.modules, _MODULE, raising=False)
  monkeypatch.delitem(model_registry._MODELS, _NAME, raising=False)
  assert model_registry.get_class(_NAME).__name__ == 'MlpRegression'
  assert _MODULE in sys.modules


def test_listing_finds_every_module():
  assert _NAME in model_registry.list_models()


@pytest.mark.parametrize('typo', [
    'synthetic.regresion.MlpRegression',  # module typo
    'synthetic.regression.MlpRegresion',  # class typo
    'MlpRegression',  # class name only
])
def test_unknown_name_lists_the_closest(typo):
  with pytest.raises(model_registry.ModelRegistryError) as e:
    model_registry.get_class(typo)
  assert f'Unknown model {typo!r}' in str(e.value)
  assert f'Closest: {_NAME}' in str(e.value)


def test_a_broken_config_module_is_not_called_unknown(tmp_path, monkeypatch):
  # A config that fails to import its own dependency shows that error.
  pkg = tmp_path / 'params' / 'broken'
  pkg.mkdir(parents=True)
  (pkg / '__init__.py').write_text('')
  (pkg / 'cfg.py').write_text('import no_such_dependency_xyz\n')
  from lingvo_pipe import params  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(params, '__path__',
                      list(params.__path__) + [str(tmp_path / 'params')])
  try:
    with pytest.raises(ModuleNotFoundError, match='no_such_dependency_xyz'):
      model_registry.get_class('broken.cfg.Model')
  finally:
    sys.modules.pop('lingvo_pipe.params.broken.cfg', None)
    sys.modules.pop('lingvo_pipe.params.broken', None)


def test_get_params_composes_model_task_and_input():
  p = model_registry.get_params(_NAME, 'Train')
  assert p.model == _NAME
  assert p.input.split == 'train'
  assert model_registry.get_params(_NAME, 'Dev').input.split == 'dev'
  assert model_registry.get_params(_NAME, 'Test').input.split == 'test'
  p.FromText('task.train.learning_rate: 0.1; input.batch_size: 16; '
             'task.pipeline.num_micro_batches: 8')
  assert (p.task.train.learning_rate, p.input.batch_size,
          p.task.pipeline.num_micro_batches) == (0.1, 16, 8)


def test_unknown_dataset():
  with pytest.raises(model_registry.ModelRegistryError, match='Train, Dev'):
    model_registry.get_params(_NAME, 'Validation')


def test_register_rejects_non_configs_and_clashes():
  with pytest.raises(model_registry.ModelRegistryError, match='subclass'):
    model_registry.RegisterSingleTaskModel(int)

  def make():
    class Clash(base_model.SingleTaskModelParams):
      pass
    return Clash

  first = make()
  first.__qualname__ = 'First'
  second = make()
  model_registry.RegisterSingleTaskModel(first)
  try:
    with pytest.raises(model_registry.ModelRegistryError, match='twice'):
      model_registry.RegisterSingleTaskModel(second)
  finally:
    model_registry._MODELS.pop(model_registry.model_name(first))


def test_registry_defines_no_flags():
  # The binaries own the command line; a config or the registry that defined
  # flags would clash with them (and with each other) at import.
  holders = [v for v in vars(model_registry).values()
             if isinstance(v, flags.FlagHolder)]
  assert not holders
  source = open(model_registry.__file__, encoding='utf-8').read()
  assert 'DEFINE_' not in source and 'import flags' not in source
