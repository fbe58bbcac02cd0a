"""Tests of lingvo_pipe.pipeline.devices: which device each pipeline stage gets.

conftest.py has already split the CPU into 4 logical devices, so these tests
also check that the split a pipeline test relies on is really in place.
"""

from types import SimpleNamespace

import pytest
import tensorflow as tf

from lingvo_pipe.pipeline import devices

_NUM_TEST_DEVICES = 4  # What tests/conftest.py configures.


def _require_cpu_only():
  if (tf.config.list_logical_devices('GPU') or
      tf.config.list_logical_devices('TPU')):
    pytest.skip('Expectations below are for a machine without accelerators.')


def _cpu_names() -> list[str]:
  return [d.name for d in tf.config.list_logical_devices('CPU')]


def test_conftest_split_the_cpu_into_four_logical_devices():
  names = _cpu_names()
  assert len(names) == _NUM_TEST_DEVICES
  assert len(set(names)) == _NUM_TEST_DEVICES


@pytest.mark.parametrize('num_stages', [1, 2, 3, 4])
def test_default_devices_gives_stage_k_the_kth_logical_cpu(num_stages):
  _require_cpu_only()
  assert devices.default_devices(num_stages) == _cpu_names()[:num_stages]


def test_default_devices_places_ops_on_distinct_devices():
  _require_cpu_only()
  placed = []
  for name in devices.default_devices(_NUM_TEST_DEVICES):
    with tf.device(name):
      result = tf.math.add(tf.ones([2]), 1.0)
    placed.append(tf.DeviceSpec.from_string(result.device))
  assert [d.device_type for d in placed] == ['CPU'] * _NUM_TEST_DEVICES
  assert [d.device_index for d in placed] == list(range(_NUM_TEST_DEVICES))


def test_more_stages_than_devices_names_the_fix():
  _require_cpu_only()
  with pytest.raises(devices.DeviceError) as e:
    devices.default_devices(_NUM_TEST_DEVICES + 1)
  message = str(e.value)
  assert f'{_NUM_TEST_DEVICES + 1} stages' in message
  assert f'configure_logical_cpus({_NUM_TEST_DEVICES + 1})' in message


def test_single_cpu_runs_every_stage_on_it(monkeypatch):
  """With one device and no split, all stages share it (still exact)."""
  only = SimpleNamespace(name='/job:localhost/replica:0/task:0/device:CPU:0')
  monkeypatch.setattr(devices.tf.config, 'list_logical_devices',
                      lambda kind: [only] if kind == 'CPU' else [])
  assert devices.default_devices(3) == [only.name] * 3


def test_configure_after_start_is_a_no_op_when_enough_devices():
  _cpu_names()  # Make sure the runtime has started.
  devices.configure_logical_cpus(2)
  devices.configure_logical_cpus(_NUM_TEST_DEVICES)
  assert len(_cpu_names()) == _NUM_TEST_DEVICES


def test_configure_after_start_asking_for_more_raises():
  _cpu_names()
  with pytest.raises(devices.DeviceError) as e:
    devices.configure_logical_cpus(_NUM_TEST_DEVICES * 2)
  message = str(e.value)
  assert f'Asked for {_NUM_TEST_DEVICES * 2}' in message
  assert f'already started with {_NUM_TEST_DEVICES}' in message
  assert len(_cpu_names()) == _NUM_TEST_DEVICES


@pytest.mark.parametrize('bad', [0, -1])
def test_configure_rejects_non_positive_counts(bad):
  with pytest.raises(devices.DeviceError, match=str(bad)):
    devices.configure_logical_cpus(bad)
