"""Which devices pipeline stages run on by default.

Stage k runs on device k. With K accelerators present, those are used; on a
laptop or a CI machine the single physical CPU is split into K *logical* CPU
devices. TensorFlow fixes the logical device list when the runtime starts, so
`configure_logical_cpus` must run before the first op (the trainer does it from
its flags; tests do it in conftest.py).
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_pipe import errors


class DeviceError(errors.LingvoPipeError, RuntimeError):
  """Devices asked for do not exist; the message says how to get them."""


def configure_logical_cpus(num_devices: int) -> None:
  """Splits the CPU into `num_devices` logical devices (before any op runs).

  Idempotent: calling again with a number no larger than the configured one
  is a no-op (it never shrinks an earlier, larger request).
  """
  if num_devices < 1:
    raise DeviceError(f'num_devices must be ≥ 1, got {num_devices}.')
  cpus = tf.config.list_physical_devices('CPU')
  configured = tf.config.get_logical_device_configuration(cpus[0]) or []
  if len(configured) >= num_devices:
    return
  try:
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError as e:  # The runtime is already initialised.
    have = len(tf.config.list_logical_devices('CPU'))
    if have >= num_devices:
      return
    raise DeviceError(
        f'Asked for {num_devices} logical CPU devices but TensorFlow already '
        f'started with {have}. Call lingvo_pipe.pipeline.devices.'
        f'configure_logical_cpus({num_devices}) before any TensorFlow op runs '
        '(the trainer does it from --num_logical_cpu_devices).') from e


def default_devices(num_stages: int) -> list[str]:
  """K local accelerators if there are K, else K logical CPU devices."""
  for kind in ('GPU', 'TPU'):
    found = tf.config.list_logical_devices(kind)
    if len(found) >= num_stages:
      return [d.name for d in found[:num_stages]]
  cpus = tf.config.list_logical_devices('CPU')
  if len(cpus) >= num_stages:
    return [d.name for d in cpus[:num_stages]]
  if len(cpus) == 1:
    # Logical devices are an isolation of placement, not of compute: on a
    # single device every stage runs there, which is still exact.
    return [cpus[0].name] * num_stages
  raise DeviceError(
      f'{num_stages} stages need {num_stages} devices; found {len(cpus)} '
      'logical CPU devices and no accelerators. Pass devices explicitly or '
      f'call configure_logical_cpus({num_stages}) at start-up.')


def _key(name: str) -> tuple[str, str, int, str, int]:
  spec = tf.DeviceSpec.from_string(name)
  job = spec.job or 'localhost'
  return (job, str(spec.replica or 0), spec.task or 0,
          (spec.device_type or 'CPU').upper(), spec.device_index or 0)


def check_devices(names: list[str], where: str) -> None:
  """Raises DeviceError naming any device TensorFlow does not know.

  Without this check soft placement silently runs a misspelt or missing
  stage device (e.g. '/device:CPU:7' on a 2-device host) somewhere else.
  """
  known = {_key(d.name) for d in tf.config.list_logical_devices()}
  for i, name in enumerate(names):
    try:
      key = _key(name)
    except ValueError as e:
      raise DeviceError(f'{where}: devices[{i}]={name!r} is not a device '
                        f'string ({e}); use e.g. "/device:CPU:1", "/GPU:0" '
                        'or "/job:worker/task:1/device:CPU:0".') from e
    if key not in known:
      raise DeviceError(
          f'{where}: devices[{i}]={name!r} does not exist; known devices: '
          f'{sorted(d.name for d in tf.config.list_logical_devices())}. '
          'Start enough logical CPU devices (--num_logical_cpu_devices), '
          'connect to the cluster first, or fix the name.')
