"""Identity, Flatten and Reshape layers."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import shape


def _run(p, *inputs):
  layer = p.Instantiate()
  return layer.FProp(layer.theta, *inputs)


def test_identity_returns_one_input_or_a_tuple():
  x, y = tf.ones([2, 3]), tf.zeros([2])
  assert _run(shape.IdentityLayer.Params(), x) is x
  assert _run(shape.IdentityLayer.Params(), x, y) == (x, y)


def test_flatten_keeps_the_batch_dim():
  x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
  p = shape.FlattenLayer.Params()
  np.testing.assert_array_equal(_run(p, x), x.reshape(2, 60))
  traced = tf.function(lambda x: _run(p, x),
                       input_signature=[tf.TensorSpec([None, 3, 4, 5])])
  assert traced.get_concrete_function().structured_outputs.shape.as_list() \
      == [None, 60]
  meta = shape.FlattenLayer.FPropMeta(p, tf.TensorShape([2, 3, 4, 5]))
  assert meta.out_shapes == (tf.TensorShape([2, 60]),) and meta.flops == 0


def test_reshape_infers_minus_one():
  p = shape.ReshapeLayer.Params().Set(name='r', shape=[4, -1])
  x = np.arange(48, dtype=np.float32).reshape(2, 3, 8)
  np.testing.assert_array_equal(_run(p, x), x.reshape(2, 4, 6))
  meta = shape.ReshapeLayer.FPropMeta(p, tf.TensorShape([2, 3, 8]))
  assert meta.out_shapes == (tf.TensorShape([2, 4, 6]),)


def test_errors():
  with pytest.raises(base_layer.LayerError, match='r: shape must be'):
    shape.ReshapeLayer.Params().Set(name='r', shape=[-1, -1]).Instantiate()
  p = shape.ReshapeLayer.Params().Set(name='r', shape=[5, -1])
  with pytest.raises(base_layer.LayerError, match='r: cannot reshape'):
    shape.ReshapeLayer.FPropMeta(p, tf.TensorShape([2, 3, 8]))
  with pytest.raises(base_layer.LayerError, match='rank ≥ 2'):
    _run(shape.FlattenLayer.Params().Set(name='f'), tf.ones([3]))
