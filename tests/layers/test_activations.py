"""Activations by name: values vs numpy, did-you-mean errors."""

import math

import numpy as np
import pytest

from lingvo_pipe.core import base_layer
from lingvo_pipe.layers import activations

_ERF = np.vectorize(math.erf)
_REFERENCE = {
    'NONE': lambda x: x,
    'RELU': lambda x: np.maximum(x, 0),
    'RELU6': lambda x: np.clip(x, 0, 6),
    'GELU': lambda x: 0.5 * x * (1 + _ERF(x / math.sqrt(2))),
    'SIGMOID': lambda x: 1 / (1 + np.exp(-x)),
    'TANH': np.tanh,
    'SWISH': lambda x: x / (1 + np.exp(-x)),
}


def test_every_name_has_a_reference():
  assert set(activations.NAMES) == set(_REFERENCE)


@pytest.mark.parametrize('name', sorted(_REFERENCE))
def test_activation_matches_numpy(name):
  x = np.linspace(-8, 8, 101)
  got = activations.get_activation(name)(x.astype(np.float32))
  np.testing.assert_allclose(np.asarray(got), _REFERENCE[name](x),
                             rtol=1e-5, atol=1e-6)


def test_unknown_name_suggests_the_closest():
  with pytest.raises(base_layer.LayerError,
                     match=r"fc: activation: unknown activation 'relu'. "
                     r"Did you mean 'RELU'"):
    activations.get_activation('relu', 'fc: activation')


def test_flops():
  assert activations.activation_flops('NONE', 10) == 0
  assert activations.activation_flops('TANH', 10) == 10
