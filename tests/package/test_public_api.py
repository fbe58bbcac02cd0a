"""The public API: what README, the guides and a user's model code import.

Pinned here, as Sonnet's api_test pins `snt`: removing or renaming any of
these names breaks users, so it fails this test first; a refactor that
moves a module keeps its old path importable with a warning naming the
new one (`lingvo_pipe._moved`). Every `from lingvo_pipe… import …` line of
README and docs/ must be covered by this list.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import warnings

import pytest

from lingvo_pipe import _moved

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

API = {
    'lingvo_pipe': ['LingvoPipeError', '__version__'],
    'lingvo_pipe.errors': ['LingvoPipeError'],
    'lingvo_pipe.extras': ['require'],
    # The layer contract, models, training.
    'lingvo_pipe.core.base_layer': [
        'BaseLayer', 'LayerError', 'LayerMeta', 'WeightInit', 'WeightParams',
        'stable_seed'],
    'lingvo_pipe.core.base_model': ['BaseTask', 'SingleTaskModelParams'],
    'lingvo_pipe.core.base_input_generator': [
        'BaseInputGenerator', 'InMemoryInputGenerator'],
    'lingvo_pipe.core.fprop_context': ['StatsCollector', 'current', 'scope'],
    'lingvo_pipe.core.gpipe': ['PipeliningLayer'],
    'lingvo_pipe.core.hyperparams': ['InstantiableParams', 'Params'],
    'lingvo_pipe.core.model_registry': [
        'RegisterSingleTaskModel', 'get_params', 'list_models'],
    'lingvo_pipe.core.nested_map': ['NestedMap'],
    'lingvo_pipe.core.pipelined_task': ['PipelinedTask'],
    'lingvo_pipe.core.optimizer': ['Adam', 'RmsProp', 'SgdMomentum'],
    'lingvo_pipe.core.learning_rate': ['learning_rate'],
    # The pipeline: schedules, prediction, measurement, checks.
    'lingvo_pipe.pipeline.schedule': [
        'Action', 'RECOMPUTE_POLICIES', 'SCHEDULES', 'Schedule',
        'ScheduleError', 'clock_cycles', 'emission_order', 'gpipe_schedule',
        'interleaved_schedule', 'make_schedule', 'one_f_one_b_schedule',
        'run_times'],
    'lingvo_pipe.pipeline.schedule_text': ['from_text', 'to_text',
                                           'validate'],
    'lingvo_pipe.pipeline.simulator': ['SimResult', 'StageCost', 'simulate',
                                       'stage_costs_from_layers'],
    'lingvo_pipe.pipeline.step_gaps': ['Gaps', 'gaps', 'predicted_with_gaps'],
    'lingvo_pipe.pipeline.timeline': [
        'Record', 'StepRecorder', 'calibrated_costs', 'plot_gantt',
        'record_step', 'write_chrome_trace'],
    'lingvo_pipe.pipeline.transparency': ['check_transparency',
                                          'discrepancy'],
    'lingvo_pipe.pipeline.partitioner': ['partition', 'make_report'],
    'lingvo_pipe.pipeline.memory': ['check_budget', 'choose_micro_batches',
                                    'predict'],
    'lingvo_pipe.pipeline.microbatch': ['split', 'concat'],
    'lingvo_pipe.pipeline.devices': ['configure_logical_cpus',
                                     'default_devices'],
    'lingvo_pipe.pipeline.engine': ['Stage', 'run', 'run_with_loss'],
    # The layer library.
    'lingvo_pipe.layers.activations': ['get_activation'],
    'lingvo_pipe.layers.attention': ['MultiHeadAttention'],
    'lingvo_pipe.layers.conv': ['Conv2DLayer', 'DepthwiseConv2DLayer',
                                'SeparableConv2DLayer'],
    'lingvo_pipe.layers.dropout': ['DropoutLayer'],
    'lingvo_pipe.layers.embedding': ['EmbeddingLayer',
                                     'PositionalEmbeddingLayer'],
    'lingvo_pipe.layers.linear': ['FCLayer'],
    'lingvo_pipe.layers.normalization': ['BatchNormLayer', 'LayerNormLayer'],
    'lingvo_pipe.layers.pooling': ['GlobalPoolingLayer', 'PoolingLayer'],
    'lingvo_pipe.layers.sequential': ['RepeatLayer', 'SequentialLayer'],
    'lingvo_pipe.layers.shape': ['FlattenLayer', 'IdentityLayer',
                                 'ReshapeLayer'],
    'lingvo_pipe.layers.softmax': ['SoftmaxLayer'],
    'lingvo_pipe.layers.keras_layer': ['KerasLayer'],
    'lingvo_pipe.keras': ['KerasLayer', 'from_keras', 'layer_params',
                          'to_keras'],
    'lingvo_pipe.layers.transformer': [
        'TransformerDecoderLayer', 'TransformerEncoderLayer',
        'TransformerFeedForwardLayer'],
}
# Imported by the docs but part of the tasks and tools, not the library's
# API (they change with the demos).
_NOT_API = re.compile(r'^lingvo_pipe\.(tasks|params|_startup)\b')


@pytest.mark.parametrize('module', sorted(API))
def test_the_public_names_are_there(module):
  mod = importlib.import_module(module)
  missing = [name for name in API[module] if not hasattr(mod, name)]
  assert not missing, f'{module} lost public names {missing}'


def _doc_imports() -> set[tuple[str, str]]:
  pairs = set()
  paths = [os.path.join(ROOT, 'README.md')] + [
      os.path.join(ROOT, 'docs', f) for f in os.listdir(
          os.path.join(ROOT, 'docs')) if f.endswith('.md')]
  for path in paths:
    with open(path, encoding='utf-8') as f:
      text = f.read()
    for module, names in re.findall(
        r'from (lingvo_pipe[\w.]*) import ([\w, ]+)', text):
      for name in names.split(','):
        pairs.add((module, name.split(' as ')[0].strip()))
  return pairs


def test_the_docs_import_only_the_public_api():
  outside = []
  for module, name in sorted(_doc_imports()):
    if _NOT_API.match(module) or _NOT_API.match(f'{module}.{name}'):
      continue
    if f'{module}.{name}' in API:  # A module imported from its package.
      continue
    if name not in API.get(module, []):
      outside.append(f'from {module} import {name}')
  assert not outside, ('README or docs import names that are not pinned as '
                       f'public API here: {outside}')


@pytest.mark.parametrize('old', sorted(_moved.MOVED))
def test_an_old_import_path_still_works_and_names_the_new_one(old):
  package, _, leaf = old.rpartition('.')
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    module = getattr(importlib.import_module(package), leaf, None)
    if module is None or not hasattr(module, '__getattr__'):
      module = importlib.import_module(old)
  new = importlib.import_module(_moved.MOVED[old])
  public = [n for n in dir(new) if not n.startswith('_')]
  assert public and all(getattr(module, n) is getattr(new, n)
                        for n in public)
  if caught:  # Warned once, when first imported in this process.
    assert _moved.MOVED[old] in str(caught[0].message)


def test_wave_one_partitioner_import_works_with_a_warning():
  # What a user wrote against wave 1, in a fresh interpreter.
  proc = subprocess.run(
      [sys.executable, '-c', 'from lingvo_pipe.core import partitioner\n'
       'print(partitioner.partition([1.0, 1.0], 2))'],
      capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == '[0, 1, 2]'
  assert ('MovedModuleWarning: lingvo_pipe.core.partitioner moved to '
          'lingvo_pipe.pipeline.partitioner' in proc.stderr), proc.stderr


@pytest.mark.parametrize('old', sorted(_moved.RETIRED))
def test_a_retired_module_says_what_replaced_it(old):
  with pytest.raises(ImportError, match='was retired: '):
    importlib.import_module(old)
