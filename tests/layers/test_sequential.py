"""SequentialLayer / RepeatLayer: chaining, tuples, NestedMaps, summed costs."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import sequential
from lingvo_pipe.layers import shape


def _fc(din, dout, **kwargs):
  return linear.FCLayer.Params().Set(input_dim=din, output_dim=dout, **kwargs)


class _PairScale(base_layer.BaseLayer):
  """(x, paddings) → (x · 2 · (1 − paddings), paddings): a tuple layer."""

  def FProp(self, theta, x, paddings):
    return x * 2 * (1 - paddings)[..., None], paddings

  @classmethod
  def FPropMeta(cls, p, x, paddings):
    return base_layer.LayerMeta.build(p, flops=2 * x.num_elements(),
                                      out_shapes=(x, paddings), num_params=0)


class _MapSwap(base_layer.BaseLayer):
  """NestedMap(a, b) → NestedMap(a=b + 1, b=a): a NestedMap layer."""

  def FProp(self, theta, m):
    return NestedMap(a=m.b + 1, b=m.a)

  @classmethod
  def FPropMeta(cls, p, m):
    return base_layer.LayerMeta.build(
        p, flops=m.b.num_elements(), out_shapes=(NestedMap(a=m.b, b=m.a),),
        num_params=0)


def test_sequential_chains_children_in_order():
  p = sequential.SequentialLayer.Params().Set(name='mlp', sub=[
      _fc(4, 6, activation='RELU'), _fc(6, 2)])
  mlp = p.Instantiate()
  assert [c.path for c in mlp.children.sub] == ['mlp.sub[0]', 'mlp.sub[1]']
  x = tf.random.normal([3, 4])
  first, second = mlp.children.sub
  want = second.FProp(mlp.theta.sub[1], first.FProp(mlp.theta.sub[0], x))
  np.testing.assert_allclose(mlp.FProp(mlp.theta, x), want)


def test_fpropmeta_sums_the_children():
  subs = [_fc(4, 6, activation='RELU'), _fc(6, 2, has_bias=False)]
  p = sequential.SequentialLayer.Params().Set(name='mlp', sub=subs)
  x = tf.TensorShape([3, 4])
  metas = [linear.FCLayer.FPropMeta(subs[0], x),
           linear.FCLayer.FPropMeta(subs[1], tf.TensorShape([3, 6]))]
  meta = sequential.SequentialLayer.FPropMeta(p, x)
  assert meta.flops == sum(m.flops for m in metas)
  assert meta.param_bytes == sum(m.param_bytes for m in metas)
  assert meta.out_bytes == sum(m.out_bytes for m in metas)
  assert meta.out_shapes == (tf.TensorShape([3, 2]),)


def test_tuples_are_passed_on_as_positional_inputs():
  p = sequential.SequentialLayer.Params().Set(name='s', sub=[
      _PairScale.Params(), _PairScale.Params()])
  layer = p.Instantiate()
  x, pad = tf.ones([2, 3, 4]), tf.constant([[0., 0., 1.], [0., 1., 1.]])
  y, pad_out = layer.FProp(layer.theta, x, pad)
  np.testing.assert_allclose(y, 4 * x * (1 - pad)[..., None])
  np.testing.assert_array_equal(pad_out, pad)
  meta = sequential.SequentialLayer.FPropMeta(p, x.shape, pad.shape)
  assert meta.out_shapes == (x.shape, pad.shape)
  assert meta.flops == 2 * 2 * x.shape.num_elements()


def test_nested_maps_flow_through_and_trace():
  p = sequential.SequentialLayer.Params().Set(name='s', sub=[
      _MapSwap.Params(), shape.IdentityLayer.Params(), _MapSwap.Params()])
  layer = p.Instantiate()
  m = NestedMap(a=tf.zeros([2, 3]), b=tf.ones([2, 1]))
  traced = tf.function(lambda theta, m: layer.FProp(theta, m))
  for out in (layer.FProp(layer.theta, m), traced(layer.theta, m)):
    assert isinstance(out, NestedMap)
    np.testing.assert_array_equal(out.a, m.a + 1)
    np.testing.assert_array_equal(out.b, m.b + 1)
  meta = sequential.SequentialLayer.FPropMeta(
      p, NestedMap(a=m.a.shape, b=m.b.shape))
  assert meta.out_shapes == (NestedMap(a=m.a.shape, b=m.b.shape),)


def test_repeat_makes_independent_copies_and_chains_them():
  p = sequential.RepeatLayer.Params().Set(name='rep', body=_fc(3, 3),
                                          repeat=3)
  rep = p.Instantiate()
  assert [c.path for c in rep.children.body] == [
      'rep.body[0]', 'rep.body[1]', 'rep.body[2]']
  w = [t.w.numpy() for t in rep.theta.body]
  assert not np.allclose(w[0], w[1])
  x = np.random.randn(2, 3)
  want = x
  for t in rep.theta.body:
    want = want @ t.w.numpy().astype(np.float64) + t.b.numpy()
  np.testing.assert_allclose(rep.FProp(rep.theta, tf.constant(x, tf.float32)),
                             want, rtol=1e-5, atol=1e-5)
  one = linear.FCLayer.FPropMeta(_fc(3, 3), tf.TensorShape([2, 3]))
  meta = sequential.RepeatLayer.FPropMeta(p, tf.TensorShape([2, 3]))
  assert (meta.flops, meta.param_bytes) == (3 * one.flops,
                                            3 * one.param_bytes)


def test_errors_name_the_layer_and_param():
  with pytest.raises(base_layer.LayerError, match='s: sub must be a non-empty'):
    sequential.SequentialLayer.Params().Set(name='s').Instantiate()
  with pytest.raises(base_layer.LayerError, match=r's: sub\[1\] must hold'):
    sequential.SequentialLayer.Params().Set(
        name='s', sub=[_fc(2, 2), 'fc']).Instantiate()
  with pytest.raises(base_layer.LayerError, match='rep: body must hold'):
    sequential.RepeatLayer.Params().Set(name='rep').Instantiate()
  with pytest.raises(base_layer.LayerError, match='rep: repeat must be'):
    sequential.RepeatLayer.Params().Set(name='rep', body=_fc(2, 2),
                                        repeat=0).Instantiate()
  p = sequential.SequentialLayer.Params().Set(name='s', sub=[_fc(2, 2)])
  with pytest.raises(base_layer.LayerError, match=r's.sub\[0\]: FCLayer'):
    sequential.SequentialLayer.FPropMeta(p, tf.TensorShape([1, 3]))
