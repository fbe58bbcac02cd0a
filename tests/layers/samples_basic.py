"""Conformance samples for the basic layers (see test_conformance.py).

`SAMPLES` maps each layer class to a list of `(params, input_shapes,
input_maker)`: `input_shapes` are full shapes (batch dim first, possibly
nested like the FProp inputs); `input_maker(shapes, rng)` builds the inputs
when random floats won't do (None = random floats).

Optional sets read by the suite:
  NO_COMPUTE: classes whose FPropMeta flops are legitimately 0.
  FLOPS_NOT_LINEAR_IN_BATCH: classes whose flops do not double with the batch.
"""

import tensorflow as tf

from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.layers import conv
from lingvo_pipe.layers import dropout
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import normalization
from lingvo_pipe.layers import pooling
from lingvo_pipe.layers import sequential
from lingvo_pipe.layers import shape

S = tf.TensorShape


def _fc(din, dout, **kwargs):
  return linear.FCLayer.Params().Set(input_dim=din, output_dim=dout, **kwargs)


def _conv(cls, filter_shape, **kwargs):
  return cls.Params().Set(filter_shape=filter_shape, **kwargs)


SAMPLES = {
    linear.FCLayer: [
        (_fc(4, 3), (S([2, 4]),), None),
        (_fc(4, 5, activation='GELU', has_bias=False), (S([2, 3, 4]),), None),
        (_fc(6, 2, activation='TANH', fprop_dtype=tf.float32),
         (S([2, 2, 3, 6]),), None),
    ],
    conv.Conv2DLayer: [
        (_conv(conv.Conv2DLayer, (3, 3, 2, 4)), (S([2, 6, 5, 2]),), None),
        (_conv(conv.Conv2DLayer, (3, 2, 2, 3), filter_stride=(2, 1),
               padding='VALID', activation='RELU'), (S([2, 7, 6, 2]),), None),
        (_conv(conv.Conv2DLayer, (3, 3, 2, 2), dilation_rate=(2, 2),
               has_bias=False), (S([1, 8, 8, 2]),), None),
    ],
    conv.DepthwiseConv2DLayer: [
        (_conv(conv.DepthwiseConv2DLayer, (3, 3, 3, 2)), (S([2, 5, 5, 3]),),
         None),
        (_conv(conv.DepthwiseConv2DLayer, (3, 3, 2, 1), filter_stride=(2, 2),
               padding='VALID'), (S([2, 7, 8, 2]),), None),
    ],
    conv.SeparableConv2DLayer: [
        (_conv(conv.SeparableConv2DLayer, (3, 3, 3, 4), relu_first=True),
         (S([2, 6, 6, 3]),), None),
        (_conv(conv.SeparableConv2DLayer, (5, 5, 2, 3), channel_multiplier=2,
               filter_stride=(2, 2), activation='RELU6'),
         (S([1, 9, 9, 2]),), None),
    ],
    pooling.PoolingLayer: [
        (pooling.PoolingLayer.Params(), (S([2, 6, 5, 3]),), None),
        (pooling.PoolingLayer.Params().Set(
            pooling_type='AVG', window_shape=(3, 3), window_stride=(2, 1),
            padding='VALID'), (S([2, 7, 6, 2]),), None),
    ],
    pooling.GlobalPoolingLayer: [
        (pooling.GlobalPoolingLayer.Params(), (S([2, 4, 3, 5]),), None),
        (pooling.GlobalPoolingLayer.Params().Set(pooling_type='MAX'),
         (S([3, 2, 2, 4]),), None),
    ],
    normalization.BatchNormLayer: [
        (normalization.BatchNormLayer.Params().Set(dim=3),
         (S([4, 5, 5, 3]),), None),
        (normalization.BatchNormLayer.Params().Set(dim=6, decay=0.9),
         (S([8, 6]),), None),
    ],
    normalization.LayerNormLayer: [
        (normalization.LayerNormLayer.Params().Set(input_dim=5),
         (S([2, 3, 5]),), None),
    ],
    dropout.DropoutLayer: [
        (dropout.DropoutLayer.Params().Set(dropout_rate=0.5),
         (S([4, 3, 6]),), None),
        (dropout.DropoutLayer.Params(), (S([2, 3]),), None),
    ],
    sequential.SequentialLayer: [
        (sequential.SequentialLayer.Params().Set(sub=[
            _fc(4, 6, activation='RELU'),
            dropout.DropoutLayer.Params().Set(dropout_rate=0.2),
            _fc(6, 2)]), (S([3, 4]),), None),
        (sequential.SequentialLayer.Params().Set(sub=[
            _conv(conv.Conv2DLayer, (3, 3, 2, 4)),
            normalization.BatchNormLayer.Params().Set(dim=4),
            pooling.PoolingLayer.Params(),
            shape.FlattenLayer.Params(),
            _fc(36, 3)]), (S([2, 6, 6, 2]),), None),
    ],
    sequential.RepeatLayer: [
        (sequential.RepeatLayer.Params().Set(
            body=_fc(5, 5, activation='SWISH'), repeat=3), (S([2, 5]),),
         None),
    ],
    shape.IdentityLayer: [
        (shape.IdentityLayer.Params(), (S([2, 3]),), None),
        # Nested structures pass through untouched.
        (shape.IdentityLayer.Params(),
         (NestedMap(x=S([2, 3]), y=S([2, 4, 1])), S([2])), None),
    ],
    shape.FlattenLayer: [
        (shape.FlattenLayer.Params(), (S([2, 3, 4, 5]),), None),
    ],
    shape.ReshapeLayer: [
        (shape.ReshapeLayer.Params().Set(shape=[4, -1]), (S([2, 3, 8]),),
         None),
    ],
}

NO_COMPUTE = {shape.IdentityLayer, shape.FlattenLayer, shape.ReshapeLayer}

FLOPS_NOT_LINEAR_IN_BATCH: set = set()
