"""--model=module.Class: a user's own model module, as in Lingvo's pip
workflow (issue 12: it used to say "Unknown model")."""

import sys
import textwrap

import pytest

from lingvo_pipe.core import model_registry

_MODEL = textwrap.dedent('''
    from lingvo_pipe.core import base_model, model_registry

    @model_registry.RegisterSingleTaskModel
    class Mine(base_model.SingleTaskModelParams):
      pass

    class Unregistered(base_model.SingleTaskModelParams):
      pass
    ''')


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
  """tmp_path as the working directory, holding my_models_xyz.py; sys.path
  without the working directory (as a console script's)."""
  (tmp_path / 'my_models_xyz.py').write_text(_MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, 'path', [p for p in sys.path
                                    if p not in ('', str(tmp_path))])
  yield tmp_path
  sys.modules.pop('my_models_xyz', None)
  model_registry._MODELS.pop('my_models_xyz.Mine', None)  # pylint: disable=protected-access


def test_a_module_in_the_working_directory_is_found(user_dir):
  cls = model_registry.get_class('my_models_xyz.Mine')
  assert cls.__name__ == 'Mine' and model_registry.model_name(cls) == (
      'my_models_xyz.Mine')
  assert str(user_dir) == sys.path[-1]  # Appended: shadows nothing.


def test_an_unregistered_class_names_the_decorator(user_dir):
  with pytest.raises(model_registry.ModelRegistryError,
                     match='does not register it.*RegisterSingleTaskModel'):
    model_registry.get_class('my_models_xyz.Unregistered')


def test_a_missing_class_or_module_is_unknown(user_dir):
  with pytest.raises(model_registry.ModelRegistryError,
                     match='has no class Nope.*PYTHONPATH'):
    model_registry.get_class('my_models_xyz.Nope')
  with pytest.raises(model_registry.ModelRegistryError, match='Unknown model'):
    model_registry.get_class('no_such_module_xyz.Model')


def test_registered_names_come_first(user_dir):
  pkg = user_dir / 'synthetic'
  pkg.mkdir()
  (pkg / '__init__.py').write_text('raise RuntimeError("shadowed")\n')
  cls = model_registry.get_class('synthetic.regression.MlpRegression')
  assert cls.__module__ == 'lingvo_pipe.params.synthetic.regression'


def test_a_user_module_that_fails_to_import_shows_its_error(user_dir):
  (user_dir / 'broken_xyz.py').write_text('import no_such_dependency_xyz\n')
  with pytest.raises(ModuleNotFoundError, match='no_such_dependency_xyz'):
    model_registry.get_class('broken_xyz.Model')
