"""The model registry: registered model names → composed model Params.

A model is a `SingleTaskModelParams` subclass in a module under the
`lingvo_pipe.params` package (the repository's top-level params/ folder),
registered with a decorator:

    # params/image/fashion_mnist.py
    @model_registry.RegisterSingleTaskModel
    class AmoebaNetGPipe(base_model.SingleTaskModelParams):
      ...

Its name is the module path below `params` plus the class name,
`image.fashion_mnist.AmoebaNetGPipe`, so the name says where the config
lives. Looking a name up imports only `lingvo_pipe.params.image.fashion_mnist` (a
registry that imported every config up front would pay for, and break on,
every unrelated model); listing the models imports them all.

A model of your own lives in your own module, as in Lingvo's pip workflow:
`mymodel.py` in the working directory (or anywhere on PYTHONPATH) with a
registered `MyModel` class is `--model=mymodel.MyModel`. A name is looked up
under `lingvo_pipe.params` first, then as a module of its own.

`get_params(name, dataset)` composes what the binaries run, so a single
override syntax reaches everything:

    model : 'image.fashion_mnist.AmoebaNetGPipe'
    task.train.learning_rate : 0.1
    task.pipeline.num_micro_batches : 8
    input.batch_size : 32

The registry defines no flags: the binaries own their command lines.
"""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import sys

from lingvo_pipe import errors
from lingvo_pipe.core import base_model
from lingvo_pipe.core.hyperparams import Params

_PARAMS_PACKAGE = 'lingvo_pipe.params'
DATASETS = ('Train', 'Dev', 'Test')

# Registered name → SingleTaskModelParams subclass.
_MODELS: dict[str, type[base_model.SingleTaskModelParams]] = {}


class ModelRegistryError(errors.LingvoPipeError, LookupError):
  """An unknown or ill-formed model name, or a clash between two models."""


def model_name(cls: type) -> str:
  """The registered name of `cls`: module path below `params.` + class name."""
  module = cls.__module__
  prefix = _PARAMS_PACKAGE + '.'
  if module.startswith(prefix):
    module = module[len(prefix):]
  return f'{module}.{cls.__name__}'


def RegisterSingleTaskModel(
    cls: type[base_model.SingleTaskModelParams]
) -> type[base_model.SingleTaskModelParams]:
  """Class decorator: registers a model config under `model_name(cls)`."""
  if not (isinstance(cls, type) and
          issubclass(cls, base_model.SingleTaskModelParams)):
    raise ModelRegistryError(
        f'RegisterSingleTaskModel got {cls!r}; decorate a subclass of '
        'base_model.SingleTaskModelParams.')
  name = model_name(cls)
  old = _MODELS.get(name)
  if old is not None and old.__qualname__ != cls.__qualname__:
    raise ModelRegistryError(
        f'Model {name!r} is registered twice ({old!r} and {cls!r}); rename '
        'one of the classes.')
  _MODELS[name] = cls  # Re-registering on a module reload replaces it.
  return cls


def _import_module(name: str) -> None:
  """Imports `params.<module part of name>` if it exists."""
  module, _, _ = name.rpartition('.')
  if not module or not all(p.isidentifier() for p in module.split('.')):
    return
  full = f'{_PARAMS_PACKAGE}.{module}'
  try:
    importlib.import_module(full)
  except ModuleNotFoundError as e:
    # Only a missing config module means "unknown name"; a config that fails
    # to import one of *its* dependencies is a bug to show as it is.
    missing = e.name or ''
    if not (full == missing or full.startswith(missing + '.')):
      raise


def _import_user_module(name: str) -> str:
  """Imports the module part of `name` from sys.path plus the working
  directory (where `python -m` would look; a console script's sys.path lacks
  it). Returns '' or a hint for the unknown-model message."""
  module, _, cls_name = name.rpartition('.')
  if not module or not all(p.isidentifier() for p in module.split('.')):
    return ''
  cwd = os.getcwd()
  if '' not in sys.path and cwd not in sys.path:
    sys.path.append(cwd)  # Last: files in cwd do not shadow installed ones.
  try:
    imported = importlib.import_module(module)
  except ModuleNotFoundError as e:
    missing = e.name or ''
    if not (module == missing or module.startswith(missing + '.')):
      raise  # The user's module exists but fails to import something.
    return ''
  if isinstance(getattr(imported, cls_name, None), type):
    return (f' Module {module} ({getattr(imported, "__file__", "?")}) '
            f'defines {cls_name} but does not register it: decorate it with '
            '@model_registry.RegisterSingleTaskModel.')
  return f' Module {module} has no class {cls_name}.'


def _import_all() -> None:
  """Imports every module under the `params` package."""
  try:
    package = importlib.import_module(_PARAMS_PACKAGE)
  except ModuleNotFoundError:
    return
  for info in pkgutil.walk_packages(package.__path__, _PARAMS_PACKAGE + '.'):
    importlib.import_module(info.name)


def list_models() -> list[str]:
  """Every registered model name (imports all of `params`), sorted."""
  _import_all()
  return sorted(_MODELS)


def get_class(name: str) -> type[base_model.SingleTaskModelParams]:
  """The registered class of `name`, importing its module on demand.

  Raises:
    ModelRegistryError: `name` is not registered; the message lists the
      closest registered names.
  """
  if name not in _MODELS:
    _import_module(name)
  user_hint = _import_user_module(name) if name not in _MODELS else ''
  if name in _MODELS:
    return _MODELS[name]
  known = list_models()
  close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
  if not close:  # e.g. only the class name was given.
    tail = name.rpartition('.')[2].lower()
    close = [k for k in known if tail and tail in k.lower()][:3]
  hint = (f' Closest: {", ".join(close)}.' if close else
          f' Registered: {", ".join(known) or "(none)"}.')
  raise ModelRegistryError(
      f'Unknown model {name!r}.{user_hint}{hint} Names are <module under '
      'params/>.<class>, e.g. synthetic.regression.MlpRegression, or '
      '<your module>.<class> with the module on PYTHONPATH or in the '
      'working directory.')


def get_params(name: str, dataset: str) -> Params:
  """The composed Params of model `name` with the input of `dataset`.

  Args:
    name: A registered model name.
    dataset: 'Train', 'Dev' or 'Test' (which of the config's methods gives
      `input`).

  Returns:
    Params with keys `model` (the name), `task` and `input`.
  """
  if dataset not in DATASETS:
    raise ModelRegistryError(
        f'Unknown dataset {dataset!r} for model {name!r}; use one of '
        f'{", ".join(DATASETS)}.')
  config = get_class(name)()
  p = Params()
  p.Define('model', name, 'Registered name of the model.')
  p.Define('task', config.Task(), 'The task (model) Params.')
  p.Define('input', getattr(config, dataset)(),
           f'Input generator Params of the {dataset} split.')
  return p
