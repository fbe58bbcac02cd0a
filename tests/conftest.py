"""Test set-up: 4 logical CPU devices (so pipeline tests need no GPU), seeds."""

import os
import random

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# tools/bench/memory.py reads the BFC allocator's stats; it asks for that
# allocator itself, but TF creates it once, at the first op, which a test
# module may run while pytest collects (tests/pipeline/test_microbatch.py
# does). With oneDNN off (AMD CI) the default CPU allocator keeps no stats.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top
_startup.import_tensorflow(['pytest'])  # Without Keras's pyplot: less start-up.

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest
import tensorflow as tf

from lingvo_pipe.pipeline import devices

NUM_TEST_DEVICES = 4
devices.configure_logical_cpus(NUM_TEST_DEVICES)


@pytest.fixture(autouse=True)
def _reset_seeds():
  random.seed(0)
  np.random.seed(0)
  tf.random.set_seed(0)
  yield
