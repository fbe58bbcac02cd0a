"""The Keras config through the binaries, as a user runs it (issue 28).

`image.fashion_mnist.KerasCnn` (a Keras Sequential, pipelined) trains and is
scored like any registered model, and its checkpoint goes back into a Keras
model; a Keras layer the pipeline would train differently from Keras ends
the trainer before the first step with one line naming it, exit 2, nothing
written.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import binary_runner as br
from lingvo_pipe import keras as lp_keras
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import params_text
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.image import input_generator

_MODEL = 'image.fashion_mnist.KerasCnn'
_SMALL = ('input.batch_size: 16; task.pipeline.input_shapes: '
          '[[16, 28, 28, 1]]; task.pipeline.num_micro_batches: 2')


def _regularized_logits() -> str:
  """The text of KerasCnn's last layer with an L2 regularizer added."""
  dense = keras.layers.Dense(10, name='logits', kernel_regularizer='l2')
  config = keras.saving.serialize_keras_object(dense)
  return params_text.value_to_text('', config)


def test_a_refused_keras_layer_ends_the_trainer_before_it_writes(tmp_path):
  logdir = tmp_path / 'log'
  rc, out, err = br.run(
      'trainer', f'--model={_MODEL}', f'--logdir={logdir}',
      f'--model_params_override={_SMALL}; '
      f'task.pipeline.layers[12].keras_layer: {_regularized_logits()}')
  lines = err.strip().splitlines()
  assert rc == 2 and len(lines) == 1, err
  assert lines[0].startswith('trainer: error: ')
  assert "Keras layer Dense 'logits' cannot be pipelined faithfully" in (
      lines[0]) and 'regularizer' in lines[0]
  assert not out and not logdir.exists()


def test_keras_cnn_trains_and_is_scored(tmp_path):
  try:
    input_generator.load_split('test')
  except data_paths.MissingDataError:
    pytest.skip('Fashion-MNIST is not prepared here (python -m '
                'lingvo_pipe.tasks.prepare_data).')
  logdir = tmp_path / 'log'
  rc, _, err = br.run('trainer', f'--model={_MODEL}', f'--logdir={logdir}',
                      '--max_steps=2', f'--model_params_override={_SMALL}; '
                      'task.train.lr_warmup_steps: 0')
  assert rc == 0, err
  assert 'KerasLayer' in (logdir / 'params.txt').read_text()
  rc, _, err = br.run('evaler', f'--logdir={logdir}', '--eval_dataset=Test',
                      '--mode=latest')
  assert rc == 0, err
  score = json.loads((logdir / 'eval_test' / 'ckpt-2.json').read_text())
  assert score['num_examples'] == 10000
  assert 0.0 <= score['metrics']['accuracy'] <= 1.0
  # The trained weights go back into Keras, for model.evaluate or serving.
  params = model_registry.get_params(_MODEL, 'Test').FromText(_SMALL)
  task, fresh = params.task.Instantiate(), params.task.Instantiate()
  tf.train.Checkpoint(task=task).read(str(logdir / 'ckpt-2')).expect_partial()
  keras_model = lp_keras.to_keras(task)
  images = tf.random.stateless_uniform([4, 28, 28, 1], seed=[1, 2])
  np.testing.assert_allclose(
      keras_model(images), task.ComputePredictions(
          task.theta, NestedMap(image=images)), rtol=1e-5, atol=1e-5)
  assert not np.allclose(keras_model.get_layer('logits').kernel,
                         fresh.theta.pipeline.layers[-1].kernel)
