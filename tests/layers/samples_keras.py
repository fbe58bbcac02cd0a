"""Conformance samples of KerasLayer: Keras layers wrapped (issue 28).

Dense, Conv2D, LayerNormalization, BatchNormalization, MultiHeadAttention
(two inputs), Embedding (int inputs), Dropout, and `Gated`, a keras.Layer
subclass of a user's own, each through `lingvo_pipe.keras.layer_params`.
"""

import keras
import numpy as np
import tensorflow as tf

from lingvo_pipe import keras as lp_keras
from lingvo_pipe.layers import keras_layer

S = tf.TensorShape


@keras.saving.register_keras_serializable(package='lingvo_pipe_tests')
class Gated(keras.layers.Layer):
  """A user's layer: x · sigmoid(x·W_g) + x·W_v, two weights named 'kernel'
  in two sub-layers."""

  def __init__(self, units=4, **kwargs):
    super().__init__(**kwargs)
    self.units = units
    self.gate = keras.layers.Dense(units, name='gate')
    self.value = keras.layers.Dense(units, use_bias=False, name='value')

  def build(self, input_shape):
    self.gate.build(input_shape)
    self.value.build(input_shape)

  def call(self, x):
    return keras.ops.sigmoid(self.gate(x)) * self.value(x)

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.units,)

  def get_config(self):
    return {**super().get_config(), 'units': self.units}


def _built(layer, *shapes):
  layer.build(*shapes)
  return layer


def _ids(shapes, rng):
  return [tf.constant(rng.integers(0, 11, s.as_list()), tf.int32)
          for s in shapes]


def _p(layer, input_shape=None, **kwargs):
  return lp_keras.layer_params(layer, input_shape, **kwargs)


SAMPLES = {
    keras_layer.KerasLayer: [
        (_p(keras.layers.Dense(3, activation='relu'), (None, 4)),
         (S([2, 4]),), None),
        (_p(_built(keras.layers.Dense(5), (None, 3, 6))),  # Its own weights.
         (S([2, 3, 6]),), None),
        (_p(keras.layers.Conv2D(4, 3, strides=2, padding='same'),
            (None, 7, 7, 2)), (S([2, 7, 7, 2]),), None),
        (_p(keras.layers.LayerNormalization(), (None, 5, 6)),
         (S([2, 5, 6]),), None),
        (_p(keras.layers.BatchNormalization(), (None, 4, 4, 3)),
         (S([4, 4, 4, 3]),), None),
        (_p(_built(keras.layers.MultiHeadAttention(2, 4), (None, 5, 8),
                   (None, 5, 8))), (S([2, 5, 8]), S([2, 5, 8])), None),
        (_p(keras.layers.Embedding(11, 6), (None, 7)), (S([2, 7]),), _ids),
        (_p(keras.layers.Dropout(0.3), (None, 6)), (S([4, 6]),), None),
        (_p(keras.layers.Dense(3, dtype='mixed_bfloat16'), (None, 4)),
         (S([2, 4]),), None),
        (_p(Gated(4), (None, 3, 5)), (S([2, 3, 5]),), None),
    ],
}
