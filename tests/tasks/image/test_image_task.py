"""The image task: metrics, exact eval accuracy, and one training step of
every registered image config (shrunk by overrides, on stand-in data).
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import learning_rate
from lingvo_pipe.core import model_registry
from lingvo_pipe.core import optimizer
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks.image import input_generator
from lingvo_pipe.tasks.image import model

_TINY_NET = ('task.network.num_cells: 3; task.network.filters: 4; '
             'task.network.stem_filters: 4')


def _tiny_task(**pipeline):
  p = model.ImageClassifierTask.Params().Set(name='image')
  p.network.Set(num_cells=3, filters=4, stem_filters=4,
                image_shape=(8, 8, 1), num_classes=5)
  p.pipeline.Set(**{'num_stages': 2, 'num_micro_batches': 2, **pipeline})
  return p


def _xent(logits, labels, eps):
  """Label-smoothed cross-entropy per example, in float64."""
  logits = logits.astype(np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  v = logits.shape[-1]
  target = np.full(logits.shape, eps / (v - 1))
  target[np.arange(len(labels)), labels] = 1 - eps
  return -(target * logp).sum(-1)


def test_metrics_match_numpy():
  task = _tiny_task().Instantiate()
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(6, 5)).astype(np.float32)
  labels = np.array([0, 1, 2, 3, 4, 0], np.int32)
  metrics = task.ComputeLoss(task.theta, tf.constant(logits),
                             NestedMap(label=tf.constant(labels)))
  accuracy = np.mean(logits.argmax(-1) == labels)
  np.testing.assert_allclose(metrics['loss'][0],
                             _xent(logits, labels, 0.1).mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics['accuracy'][0], accuracy, rtol=1e-6)
  np.testing.assert_allclose(metrics['top1_error'][0], 1 - accuracy,
                             rtol=1e-6)
  assert all(float(w) == 6 for _, w in metrics.values())


def test_eval_accuracy_is_exact_over_uneven_batches():
  task = _tiny_task().Instantiate()
  rng = np.random.default_rng(3)
  images = rng.normal(size=(7, 8, 8, 1)).astype(np.float32)
  labels = rng.integers(0, 5, size=7).astype(np.int32)
  agg = task.CreateEvalAggregator()
  predicted = []
  for lo, hi in ((0, 4), (4, 7)):  # 4 + 3 examples.
    batch = NestedMap(image=tf.constant(images[lo:hi]),
                      label=tf.constant(labels[lo:hi]))
    with fprop_context.scope(training=False):
      out = task.EvalStep(task.theta, batch)
      logits = task.ComputePredictions(task.theta, batch)
    predicted.append(logits.numpy().argmax(-1))
    agg.Update(batch, tf.nest.map_structure(np.asarray, out))
  result = agg.Finalize()
  want = np.mean(np.concatenate(predicted) == labels)
  assert result['accuracy'] == want  # Exact: counted, not averaged.
  assert result['top1_error'] == 1 - want
  assert result['num_examples'] == 7


def test_summaries_and_inspect_describe_the_pipeline():
  task = _tiny_task(num_micro_batches=4).Instantiate()
  summaries = task.Summaries()
  assert summaries['pipeline/bubble_fraction'] == pytest.approx(1 / 5)
  assert summaries['pipeline/partition_imbalance'] >= 1.0
  assert 'imbalance' in task.Inspect() and '0:stem' in task.Inspect()


@pytest.mark.parametrize('pipeline, match', [
    (dict(input_shapes=[[4, 28, 28, 1]]),
     r'input_shapes = \[\[4, 28, 28, 1\]\] but task.network.image_shape = '
     r'\(8, 8, 1\)'),
    (dict(layers=[base_layer.BaseLayer.Params()]),
     'task.pipeline.layers is set'),
])
def test_pipeline_params_that_contradict_the_network_are_refused(
    pipeline, match):
  with pytest.raises(base_layer.LayerError, match=match):
    _tiny_task(**pipeline).Instantiate()


# ---- One training step of each registered config ------------------------
class _StandInInput(input_generator.FashionMnistInput):
  """Random uint8 images in place of the dataset."""

  def LoadArrays(self):
    rng = np.random.default_rng(4)
    return {'image': rng.integers(0, 256, (64, 28, 28, 1), dtype=np.uint8),
            'label': (np.arange(64) % 10).astype(np.int32)}


_OVERRIDES = {
    'image.fashion_mnist.AmoebaNetGPipe':
        f'{_TINY_NET}; input.batch_size: 8; '
        'task.pipeline.input_shapes: [[8, 28, 28, 1]]; '
        'task.pipeline.num_micro_batches: 2',
    # Keeps K = 8 and the ImageNet stem; 8 stages on the 4 test devices.
    'image.fashion_mnist.KerasCnn':
        'input.batch_size: 8; task.pipeline.input_shapes: [[8, 28, 28, 1]]; '
        'task.pipeline.num_micro_batches: 2',
    'image.fashion_mnist.AmoebaNetD18x256':
        f'{_TINY_NET}; task.network.filters: 8; input.batch_size: 8; '
        'input.image_size: 16; task.network.image_shape: (16, 16, 1); '
        'task.pipeline.input_shapes: [[8, 16, 16, 1]]; '
        'task.pipeline.num_micro_batches: 2; task.pipeline.devices: ['
        + ', '.join(f"'/device:CPU:{i % 4}'" for i in range(8)) + ']',
}


def test_every_registered_image_config_is_tested():
  names = [n for n in model_registry.list_models() if n.startswith('image.')]
  assert sorted(names) == sorted(_OVERRIDES)


@pytest.mark.parametrize('name', sorted(_OVERRIDES))
def test_one_training_step(name):
  params = model_registry.get_params(name, 'Train')
  params.FromText(_OVERRIDES[name])
  params.input.cls = _StandInInput
  batch = next(iter(params.input.Instantiate().TrainDataset(0)))
  task = params.task.Instantiate()
  train = params.task.train
  variables = task.trainable_variables
  opt = optimizer.from_params(train)
  opt.build(variables)
  before = [v.numpy() for v in task.variables]

  @tf.function(autograph=False)
  def _step(batch):
    stats = fprop_context.StatsCollector()
    with fprop_context.scope(training=True, step=0, stats=stats):
      with tf.GradientTape() as tape:
        metrics = task.FProp(task.theta, batch)
      grads = tape.gradient(metrics['loss'][0], variables)
    opt.apply(grads, variables, learning_rate.learning_rate(train, 0), 0)
    task.UpdateStats(stats.stats)
    return metrics, grads

  metrics, grads = _step(batch)
  assert np.isfinite(float(metrics['loss'][0]))
  assert all(g is not None and np.all(np.isfinite(g)) for g in grads)
  assert float(tf.linalg.global_norm(grads)) > 0
  changed = {v.name: not np.array_equal(b, v.numpy())
             for b, v in zip(before, task.variables)}
  # The paper recipe warms up for 3 epochs, so its first update is tiny;
  # some weights may not move in float32. The step did apply:
  assert any(c for name, c in changed.items() if 'moving' not in name)
  moving = [c for name, c in changed.items() if 'moving' in name]
  assert moving and all(moving)  # BatchNorm statistics were folded.
