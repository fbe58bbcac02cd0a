"""The guides' code runs as printed.

docs/custom_layer.md, docs/porting_from_lingvo.md and docs/keras_users.md
show whole files: a ```python block whose first line is `# <name>.py` is
that file. They are written into a temporary directory, imported from
there, and every `test_*` function in them runs, so a guide cannot drift
from the API. README's "Pipelining a Keras model" block runs as printed.
"""

import importlib
import inspect
import pathlib
import re
import sys

import numpy as np
import pytest

_DOCS = pathlib.Path(__file__).resolve().parents[2] / 'docs'
_BLOCK = re.compile(r'```python\n# (\w+)\.py\n(.*?)```', re.S)


def guide_files(guide: str) -> dict[str, str]:
  """{module name: source} of the files a guide prints."""
  text = (_DOCS / guide).read_text(encoding='utf-8')
  return {name: f'# {name}.py\n{body}' for name, body in _BLOCK.findall(text)}


@pytest.fixture
def guide_dir(tmp_path, monkeypatch):
  """Writes a guide's files into tmp_path and puts it on sys.path."""
  written = []

  def _write(guide: str) -> dict[str, str]:
    files = guide_files(guide)
    for name, source in files.items():
      (tmp_path / f'{name}.py').write_text(source, encoding='utf-8')
      written.append(name)
    monkeypatch.syspath_prepend(str(tmp_path))
    return files

  yield _write
  for name in written:
    sys.modules.pop(name, None)


def _run_tests_of(module_name: str) -> list[str]:
  module = importlib.import_module(module_name)
  ran = []
  for name, fn in inspect.getmembers(module, inspect.isfunction):
    if name.startswith('test_') and fn.__module__ == module_name:
      fn()
      ran.append(name)
  return ran


def test_custom_layer_guide(guide_dir):
  files = guide_dir('custom_layer.md')
  assert set(files) == {'gated_ff', 'test_gated_ff'}
  ran = _run_tests_of('test_gated_ff')
  assert 'test_pipelined_gradients_equal_the_unpipelined_ones' in ran
  assert len(ran) == 5


def test_porting_guide(guide_dir):
  files = guide_dir('porting_from_lingvo.md')
  assert set(files) == {'lenet5'}  # Lingvo's side is not importable here.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core import fprop_context  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core import model_registry  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core.nested_map import NestedMap  # pylint: disable=g-import-not-at-top
  try:
    params = model_registry.get_params('lenet5.LeNet5', 'Train')
    assert params.input.split == 'train'
    task = params.task.Instantiate()
    batch = NestedMap(image=tf.random.uniform([64, 28, 28, 1]),
                      label=tf.range(64) % 10)
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=1):
        metrics = task.FProp(task.theta, batch)
    grads = tape.gradient(metrics['loss'][0], task.trainable_variables)
    assert all(g is not None for g in grads)
    assert 0.0 <= float(metrics['accuracy'][0]) <= 1.0
    assert 'stage' in task.Inspect()
  finally:
    model_registry._MODELS.pop('lenet5.LeNet5', None)  # pylint: disable=protected-access


def test_readme_keras_example(capsys):
  text = (_DOCS.parent / 'README.md').read_text(encoding='utf-8')
  m = re.search(r'<!-- keras example[^>]*-->\s*```python\n(.*?)```', text,
                re.S)
  assert m, 'README lost its "Pipelining a Keras model" example'
  namespace = {'__name__': 'readme_keras_example'}
  code = compile(m.group(1), 'README.md (keras example)', 'exec')
  exec(code, namespace)  # pylint: disable=exec-used
  net, model = namespace['net'], namespace['model']
  assert net.plan.num_stages == 2 and 'stage' in capsys.readouterr().out
  for layer in net.children.layers:  # The trained weights are in Keras.
    target = model.get_layer(layer.keras_layer.name)
    for w, key in zip(target.weights, layer.weight_keys):
      np.testing.assert_array_equal(w.value, layer.theta[key])


def test_keras_guide(guide_dir):
  files = guide_dir('keras_users.md')
  assert set(files) == {'keras_mlp', 'test_keras_mlp'}
  from lingvo_pipe.core import model_registry  # pylint: disable=g-import-not-at-top
  try:
    ran = _run_tests_of('test_keras_mlp')
  finally:
    model_registry._MODELS.pop('keras_mlp.KerasMlp', None)  # pylint: disable=protected-access
  assert len(ran) == 3
