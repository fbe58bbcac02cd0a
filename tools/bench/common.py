"""What every benchmark shares: the network, its train steps, the clock.

Why interleave: other processes share this machine, so configurations that
are compared are timed in alternation (a, b, a, b, …) and summarised by the
median, never one after the other.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import linear

LEARNING_RATE = 1e-6  # Tiny SGD step: the weights (and timings) stay put.


class BenchError(RuntimeError):
  """A benchmark cannot run as configured; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class NetSpec:
  """A stack of `num_layers` ReLU FC layers of `width` on [batch, width]."""
  num_layers: int
  width: int
  batch: int

  def layer_params(self) -> list[Any]:
    return [linear.FCLayer.Params().Set(
        name=f'fc{i}', input_dim=self.width, output_dim=self.width,
        activation='RELU') for i in range(self.num_layers)]

  def describe(self) -> str:
    return (f'{self.num_layers} × FC({self.width}→{self.width}, ReLU), '
            f'batch {self.batch}')


def pipeline_params(spec: NetSpec, num_stages: int, num_micro_batches: int,
                    devices: Sequence[str], recompute: str = 'always') -> Any:
  return gpipe.PipeliningLayer.Params().Set(
      name='net', layers=spec.layer_params(), num_stages=num_stages,
      num_micro_batches=num_micro_batches, input_shapes=[[spec.batch,
                                                          spec.width]],
      devices=list(devices[:num_stages]), recompute=recompute)


def make_input(spec: NetSpec, device: str, seed: int = 7) -> tf.Variable:
  """The batch, living on `device` so the client never ships it."""
  with tf.device(device):
    return tf.Variable(tf.random.stateless_normal(
        [spec.batch, spec.width], seed=[seed, 0]), trainable=False)


def square_loss(y: tf.Tensor) -> tf.Tensor:
  """Σ y² / N: a per-example sum over the batch, as the engine expects."""
  return tf.reduce_sum(tf.square(y)) / tf.cast(tf.shape(y)[0], y.dtype)


def sgd_update(variables: Sequence[tf.Variable],
               grads: Sequence[tf.Tensor]) -> None:
  """In-place SGD, each update on its variable's device."""
  for v, g in zip(variables, grads):
    with tf.device(v.device):
      v.assign_sub(LEARNING_RATE * g)


def loss_on(device: str) -> Callable[[Any], tf.Tensor]:
  """square_loss placed on `device` (the last stage's), not on the client."""

  def _loss(y: Any) -> tf.Tensor:
    with tf.device(device):
      return square_loss(y)

  return _loss


def pipeline_step(net: Any, x: tf.Variable) -> Callable[[], tf.Tensor]:
  """A tf.function training step of a PipeliningLayer: loss, grads, SGD."""
  variables = list(net.trainable_variables)
  loss_fn = loss_on(net.devices[-1])

  @tf.function
  def _step() -> tf.Tensor:
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        loss = loss_fn(net.FProp(net.theta, x))
    sgd_update(variables, tape.gradient(loss, variables))
    return loss

  return _step


def hand_written_step(net: Any, x: tf.Variable) -> Callable[[], Any]:
  """The same layers and weights, no pipeline: one tape, one device."""
  variables = list(net.trainable_variables)
  layers, device = list(net.children.layers), net.devices[0]

  @tf.function
  def _step() -> tf.Tensor:
    with tf.device(device):
      with tf.GradientTape() as tape:
        y = x
        for layer in layers:
          y = layer.FProp(layer.theta, y)
        loss = square_loss(y)
      grads = tape.gradient(loss, variables)
      sgd_update(variables, grads)
      return loss

  return _step


def sync(result: Any) -> Any:
  """Waits for a step's outputs (fetching them to the client)."""
  if result is None:
    return None
  return tf.nest.map_structure(lambda t: t.numpy(), result)


def first_call(fn: Callable[[], Any]) -> float:
  """Seconds of the first call: tracing, optimisation, registration, run."""
  start = time.perf_counter()
  sync(fn())
  return time.perf_counter() - start


def interleaved(fns: dict[str, Callable[[], Any]],
                reps: int) -> dict[str, list[float]]:
  """Wall seconds of `reps` calls of each fn, called in alternation."""
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      sync(fn())
      times[name].append(time.perf_counter() - start)
  return times


def span(records: Sequence[Any]) -> float:
  """Seconds from a recorded step's first op start to its last op end."""
  return max(r.end for r in records) - min(r.start for r in records)


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs))


def release() -> None:
  """Drops Python references to old nets so their variables are freed."""
  gc.collect()


def log(msg: str) -> None:
  print(f'[bench {time.strftime("%H:%M:%S")}] {msg}', file=sys.stderr,
        flush=True)
