"""The run description the trainer writes for TensorBoard: hparams chosen
from the params, text summaries, and no HParams without TensorBoard."""

import sys

import tensorflow as tf

from lingvo_pipe.core import model_registry
from lingvo_pipe.core import run_summaries
from lingvo_pipe.core import summaries


def _params():
  return model_registry.get_params('synthetic.regression.MlpRegression',
                                   'Train')


def test_hparams_are_training_and_pipeline_settings():
  hp = run_summaries.hparams_of(_params())
  assert hp['model'] == 'synthetic.regression.MlpRegression'
  assert hp['task.train.learning_rate'] == 1e-2
  assert hp['task.pipeline.num_stages'] == 2
  assert hp['task.pipeline.num_micro_batches'] == 4
  assert hp['task.pipeline.recompute'] == 'always'
  assert hp['input.batch_size'] == 32
  assert all(isinstance(v, (bool, int, float, str)) for v in hp.values())
  assert not any(k.startswith('task.pipeline.layers') for k in hp)


def test_text_summaries_round_trip(tmp_path):
  writer = tf.summary.create_file_writer(str(tmp_path))
  summaries.text(writer, 3, {'params': 'a : 1\nb : 2'})
  summaries.scalars(writer, 3, {'loss': 0.5})
  writer.close()
  assert summaries.read_texts(str(tmp_path)) == {'params': [(3,
                                                             'a : 1\nb : 2')]}
  assert summaries.read_scalars(str(tmp_path)) == {'loss': [(3, 0.5)]}


def test_without_tensorboard_no_hparams_and_no_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorboard.plugins.hparams', None)
  assert not run_summaries.write_hparams(str(tmp_path), _params())
  assert not list(tmp_path.iterdir())
