"""Is a pipelined step the same training as the unpipelined one?

Pipelining must change nothing but the order of float32 roundings. Comparing
a pipelined step with an unpipelined float32 step alone cannot tell a real
difference of 1e-5 from rounding: the kernels' summation order depends on
the CPU (oneDNN on or off, AVX-512 or AVX2), and a LayerNorm scale gradient
that nearly cancels differed by 1.06e-5 on an AMD EPYC with oneDNN off.

So each comparison uses three runs of the same layers and weights:

    pipelined   float32, through the engine;
    reference   float32, the layers one after another, plain autodiff;
    exact       the reference in float64 (every layer's fprop_dtype).

and passes if the pipelined step matches the float32 reference to `tol`
(1e-5, the headline figure), or if it is as close to the float64 step as the
float32 reference is, within `SLACK` times (the bound then measures the
pipeline, not the machine's kernels).

>>> d = Discrepancy(direct=3e-5, pipelined=2e-5, reference=1e-5)
>>> d.ok(1e-5), d.bound(1e-5)
(True, 4e-05)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.core.nested_map import NestedMap

__all__ = ['Discrepancy', 'SLACK', 'TransparencyReport', 'check_transparency',
           'discrepancy', 'float64_layer_params', 'max_rel_diff']

SLACK = 4.0  # Pipelined error vs float64 may be this × the reference's.


def _dense(x: Any) -> np.ndarray:
  """float64 numpy of a tensor, IndexedSlices (embeddings) or None."""
  if x is None:  # No gradient (e.g. BatchNorm's moving averages).
    return np.zeros([0])
  return np.asarray(tf.convert_to_tensor(x), np.float64)


def max_rel_diff(got: Any, want: Any) -> tuple[float, int]:
  """Largest leaf-wise max|got − want| / scale, and the leaf it occurs in.

  Each leaf's scale is its own max|want|, floored at 1e-3 of the largest
  leaf's: a leaf whose true value is zero (an attention key bias gradient,
  which softmax cancels) holds only rounding noise.
  """
  pairs = [(_dense(a), _dense(b))
           for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want))]
  top = max((float(np.max(np.abs(b))) for _, b in pairs if b.size),
            default=0.0)
  worst, where = 0.0, -1
  for i, (a, b) in enumerate(pairs):
    if not b.size:
      continue
    scale = max(float(np.max(np.abs(b))), 1e-3 * top, 1e-12)
    diff = float(np.max(np.abs(a - b))) / scale
    if diff > worst:
      worst, where = diff, i
  return worst, where


@dataclasses.dataclass(frozen=True)
class Discrepancy:
  """How far one quantity (loss, outputs, gradients, statistics) is off.

  Attributes:
    direct: pipelined float32 vs reference float32.
    pipelined: pipelined float32 vs the float64 reference.
    reference: reference float32 vs the float64 reference: the rounding of
      this machine's float32 kernels, which no pipeline can beat.
    where: index of the worst leaf of `direct` (-1: none).
  """
  direct: float
  pipelined: float
  reference: float
  where: int = -1

  def bound(self, tol: float) -> float:
    """What `pipelined` may reach: tol, or SLACK × the kernels' rounding."""
    return max(tol, SLACK * self.reference)

  def ok(self, tol: float = 1e-5) -> bool:
    return self.direct < tol or self.pipelined <= self.bound(tol)

  def __str__(self) -> str:
    return (f'{self.direct:.2e} vs float32 (float64: pipelined '
            f'{self.pipelined:.2e}, reference {self.reference:.2e})')


def discrepancy(got: Any, want32: Any, want64: Any) -> Discrepancy:
  """Compares the pipelined `got` with the float32 and float64 references."""
  direct, where = max_rel_diff(got, want32)
  return Discrepancy(direct=direct, pipelined=max_rel_diff(got, want64)[0],
                     reference=max_rel_diff(want32, want64)[0], where=where)


def float64_layer_params(layer_params: list[Any]) -> list[Any]:
  """Copies of `layer_params` that compute in float64 (same weights, paths).

  Every layer casts its inputs and theta to `fprop_dtype`, and passes it to
  the children it builds, so the float64 twin runs on the float32 model's
  own theta.
  """
  return [lp.Copy().Set(fprop_dtype=tf.float64) for lp in layer_params]


@dataclasses.dataclass(frozen=True)
class TransparencyReport:
  """Discrepancies of loss, outputs and gradients (see `Discrepancy`)."""
  loss: Discrepancy
  outputs: Discrepancy
  gradients: Discrepancy
  worst_variable: str

  def ok(self, tol: float = 1e-5) -> bool:
    return all(d.ok(tol) for d in (self.loss, self.outputs, self.gradients))

  def __str__(self) -> str:
    return (f'loss {self.loss}; outputs {self.outputs}; gradients '
            f'{self.gradients} (worst: {self.worst_variable})')


def _unpipelined(layers: list[Any], thetas: list[Any],
                 inputs: tuple[Any, ...], loss_fn: Any, step: int,
                 num_micro_batches: int, batch_dim: int) -> tuple[Any, ...]:
  """Loss, outputs and theta gradients of plain autodiff, micro-batch by
  micro-batch (M=1: the whole batch)."""
  micro = microbatch.split(tuple(inputs), num_micro_batches, batch_dim)
  n = microbatch.batch_size(inputs, batch_dim, 'reference')
  outs = []
  with tf.GradientTape() as tape:
    for i, x in enumerate(micro):
      with fprop_context.scope(
          training=True, step=step, micro_batch_index=i,
          num_micro_batches=num_micro_batches, batch_axis=batch_dim,
          first_example=i * n // num_micro_batches, global_batch_size=n):
        for layer, theta in zip(layers, thetas):
          x = layer.FProp(theta, *x)
          x = x if isinstance(x, tuple) else (x,)
      outs.append(x)
    out = microbatch.concat(outs, batch_dim)
    out = out[0] if len(out) == 1 else out
    loss = loss_fn(out)
  return loss, out, tape.gradient(loss, thetas)


def check_transparency(params: Any, inputs: tuple[Any, ...],
                       loss_fn: Any = None, step: int = 0,
                       micro_batched_reference: bool = False
                      ) -> TransparencyReport:
  """Runs a pipeline and its unpipelined twin; reports how far they differ.

  The twin is the same layers (same weights) run one after another under a
  plain `tf.GradientTape` on the whole batch — or, with
  `micro_batched_reference`, micro-batch by micro-batch with summed
  gradients, which is what BatchNorm models should be compared with. It
  runs twice: in float32, and in float64 (see the module docstring).

  Args:
    params: PipeliningLayer Params.
    inputs: The first layer's positional inputs for one mini-batch.
    loss_fn: outputs → scalar loss; default Σ squares of the float outputs / N.
    step: Training step (seeds dropout).
    micro_batched_reference: See above.

  Returns:
    A TransparencyReport; `report.ok()` means float32 rounding only.
  """
  net = params.Instantiate()
  twin = params.Copy().Set(
      layers=float64_layer_params(list(params.layers)), num_stages=1,
      split_points=None, devices=None, schedule='gpipe').Instantiate()
  n = microbatch.batch_size(inputs, net.params.batch_dim, net.path)
  if loss_fn is None:
    loss_fn = lambda out: tf.add_n([  # pylint: disable=g-long-lambda
        tf.reduce_sum(tf.square(x)) for x in tf.nest.flatten(out)
        if x.dtype.is_floating]) / n

  @tf.function
  def _pipelined():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=step):
        out = net.FProp(net.theta, *inputs)
        loss = loss_fn(out)
    return loss, out, tape.gradient(loss, net.theta)

  m = (microbatch.num_micro_batches(n, net.params.num_micro_batches,
                                    net.params.micro_batch_size, net.path)
       if micro_batched_reference else 1)
  thetas = list(net.theta.layers)
  ref = [_unpipelined(layers, thetas, inputs, loss_fn, step, m,
                      net.params.batch_dim)
         for layers in (net.children.layers, twin.children.layers)]
  loss, out, grads = _pipelined()
  got = (loss, out, grads.layers)
  d = [discrepancy(got[i], ref[0][i], ref[1][i]) for i in range(3)]
  names = [k for k, _ in NestedMap(layers=net.theta.layers).FlattenItems()]
  return TransparencyReport(
      loss=d[0], outputs=d[1], gradients=d[2],
      worst_variable=names[d[2].where] if d[2].where >= 0 else '')
