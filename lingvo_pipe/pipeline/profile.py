"""Per-layer costs measured by a short profiling pass (PipeDream's half).

FPropMeta flops rank layers well only if every op runs at the same rate; a
wide matmul runs near peak, while a LayerNorm, a dropout or an embedding
gather is bound by memory bandwidth and costs far more time per flop, so a
partition balanced by flops can leave one stage 1.5× slower than the mean
(tools/bench/partition_bench.py). PipeDream (Narayanan et al., SOSP 2019)
times each layer on the target device instead. `profile_layers` does that:

    for each layer, in order (built alone on `device`, freed after):
      x = outputs of the previous layer, on one micro-batch (N / M rows,
          as a stage runs it: small matmuls run below peak)
      trace  F(x) = FProp(theta, *x)  and  FB(x) = F + gradient of the float
             outputs (fed ones) w.r.t. theta and the float inputs, and
             FI(x) = F + the gradient w.r.t. the float inputs alone (what
             a split backward's I computes), under tf.function, in a
             training fprop_context
      warm up, then time E, F, FB and FI in turn `repeats` times (each
             sample averages enough calls to last ~2 ms), where E is an
             empty call (dispatch overhead, paid once per stage call in
             the engine, not once per layer)
      forward = max(0, median(F) - median(E))
      backward = max(0, median(FB) - median(F))
      input_grad = min(backward, max(0, median(FI) - median(F)))

`clock='cpu'` times by this process's CPU time: on a shared CPU host,
others' load stretches wall time, not our CPU time (one op, busy 2-core
machine: medians 4.1–4.4 ms by CPU time, 4.9–8.2 ms by wall time). It
equals wall time only with single-threaded TF pools (as stage workers have)
and misses accelerator time.

Left out: the recompute pass (with recompute a stage costs ~2·forward +
backward; costs stay balanced unless layers' forward/backward ratios differ
a lot), the engine's per-op overhead, and contention with the other stages
of a real run. Weights do not change timings, so each layer is built alone
(its own root path and seed), not with the model's initial values.

>>> from lingvo_pipe.layers import linear
>>> p = [linear.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=4)]
>>> [prof] = profile_layers(p, synthetic_inputs([[8, 4]]), 2, repeats=1)
>>> prof.out_bytes, prof.param_bytes  # 4 rows × 4 floats; 4×4 + 4 floats.
(64, 80)
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.pipeline import devices as devices_lib
from lingvo_pipe.pipeline import microbatch

__all__ = ['CLOCKS', 'LayerProfile', 'ProfileError', 'costs_from_profiles',
           'profile_layers', 'synthetic_inputs']

# What a profile times by (see the module doc).
CLOCKS: dict[str, Callable[[], float]] = {'wall': time.perf_counter,
                                          'cpu': time.process_time}

# A PCIe 3.0 x16 link moves ~1e10 bytes/s; measure yours for real numbers.
DEFAULT_BYTES_PER_SECOND = 1e10


class ProfileError(errors.LingvoPipeError):
  """Arguments a profiling pass cannot use; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Measured cost of one layer on one micro-batch.

  forward_s / backward_s: median seconds per micro-batch (less the dispatch
  of an empty call); out_bytes: the layer's outputs for one micro-batch
  (what crosses a stage boundary if a stage ends here); param_bytes: its
  trainable variables.
  """
  name: str
  forward_s: float
  backward_s: float
  out_bytes: int
  param_bytes: int
  input_grad_s: float | None = None  # I's part of backward_s; None: unknown.

  @property
  def total_s(self) -> float:
    return self.forward_s + self.backward_s

  @property
  def weight_share(self) -> float:
    """W's share of the backward (zero-bubble schedules run it apart);
    unknown: the simulator's rule (1/2 with parameters, else 0)."""
    if self.input_grad_s is None:
      return 0.5 if self.param_bytes else 0.0
    if self.backward_s <= 0:
      return 0.0
    return max(0.0, 1.0 - self.input_grad_s / self.backward_s)


def _nbytes(tensors: Any) -> int:
  return sum(int(t.shape.num_elements()) * t.dtype.size
             for t in tf.nest.flatten(tensors) if t is not None)


def _floats(leaves: Sequence[Any]) -> list[tf.Tensor]:
  return [x for x in leaves if x is not None and x.dtype.is_floating]


def synthetic_inputs(input_shapes: Sequence[Sequence[int]],
                     input_dtypes: Sequence[tf.DType] | None = None,
                     float_value: float = 1.0) -> tuple[tf.Tensor, ...]:
  """Inputs of the given shapes for a profile when no real batch is at hand.

  Dense ops' timings do not depend on values. Floats are `float_value` (1:
  ReLUs pass it, norms stay finite); ints 0, a valid id and label anywhere.

  Args:
    input_shapes: one fully known shape per positional input, for one
      mini-batch, e.g. PipeliningLayer's p.input_shapes.
    input_dtypes: one dtype per input; None means float32 for all.
    float_value: the value of every float element.

  Raises:
    ProfileError: mismatched lengths or a shape with unknown dimensions.
  """
  dtypes = list(input_dtypes or [tf.float32] * len(input_shapes))
  if len(dtypes) != len(input_shapes):
    raise ProfileError(
        f'input_dtypes has {len(dtypes)} entries but input_shapes has '
        f'{len(input_shapes)}; give one dtype per input, or None (float32).')
  out = []
  for i, (shape, dtype) in enumerate(zip(input_shapes, dtypes)):
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
      raise ProfileError(f'input_shapes[{i}] = {shape} has unknown '
                         'dimensions; give every dimension for a profile.')
    dtype = tf.as_dtype(dtype)
    value = float_value if dtype.is_floating else 0
    out.append(tf.fill(shape, tf.cast(value, dtype)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Settings:  # How profile_layers runs and times each layer.
  device: str
  num_micro_batches: int
  batch_dim: int
  repeats: int
  warmup: int
  clock: str


def _bodies(layer: Any, cfg: _Settings
           ) -> tuple[Callable[..., Any], Callable[..., Any],
                      Callable[..., Any]]:
  """The forward, forward+backward and forward+input gradient of `layer`,
  as tf.functions.

  Step and micro-batch index are arguments, not constants, so Grappler
  cannot fold a dropout mask into a constant (the engine does the same).
  The outputs and statistics are returned so no forward op is pruned. The
  bodies pin their ops to `device`: a called function's ops do not inherit
  the caller's device scope.
  """

  def _fprop(x: tuple[Any, ...], step: tf.Tensor, m: tf.Tensor) -> Any:
    collector = StatsCollector()
    with fprop_context.scope(training=True, step=step, micro_batch_index=m,
                             num_micro_batches=cfg.num_micro_batches,
                             batch_axis=cfg.batch_dim, stats=collector):
      y = layer.FProp(layer.theta, *x)
    return y, collector.stats

  @tf.function(autograph=False)
  def forward(x: tuple[Any, ...], step: tf.Tensor, m: tf.Tensor) -> Any:
    with tf.device(cfg.device):
      return _fprop(x, step, m)

  def _with_grads(weights: bool) -> Callable[..., Any]:
    @tf.function(autograph=False)
    def _fn(x: tuple[Any, ...], step: tf.Tensor, m: tf.Tensor) -> Any:
      with tf.device(cfg.device):
        with tf.GradientTape() as tape:
          x_float = _floats(tf.nest.flatten(x))
          tape.watch(x_float)
          y, stats = _fprop(x, step, m)
        targets = _floats(tf.nest.flatten(y))
        sources = (x_float, list(layer.trainable_variables) if weights
                   else [])
        grads = tape.gradient(
            targets, sources,
            output_gradients=[tf.ones_like(t) for t in targets],
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return y, stats, grads
    return _fn

  return forward, _with_grads(True), _with_grads(False)


def _seconds(fn: Callable[..., Any], args: tuple[Any, ...],
             clock: Callable[[], float], calls: int = 1) -> float:
  """Seconds per call, averaged over `calls` back-to-back calls."""
  start = clock()
  for _ in range(calls):
    fn(*args)
  tf.test.experimental.sync_devices()  # Accelerators run asynchronously.
  return (clock() - start) / calls


def _profile_one(layer: Any, name: str, x: tuple[Any, ...],
                 cfg: _Settings) -> tuple[LayerProfile, tuple[Any, ...]]:
  """Times one built layer on x; returns its profile and its outputs."""
  forward, forward_backward, forward_input = _bodies(layer, cfg)
  clock = CLOCKS[cfg.clock]
  # The cost of a call that computes nothing: Python and runtime dispatch,
  # paid once per stage call in the engine, not once per layer.
  empty = tf.function(lambda x, step, m: tf.nest.map_structure(tf.identity, x),
                      autograph=False)
  with tf.device(cfg.device):
    args = (x, tf.constant(0, tf.int64), tf.constant(0, tf.int32))
  y, _ = forward(*args)  # Traces, as do the next two calls.
  fns = (empty, forward, forward_backward, forward_input)
  for fn in (empty, forward_backward, forward_input) + fns * cfg.warmup:
    fn(*args)
  # Calls per sample: ~2 ms' worth, so that jitter averages out.
  calls = min(100, 1 + int(2e-3 / _seconds(forward_backward, args, clock)))
  times: list[list[float]] = [[], [], [], []]
  for _ in range(cfg.repeats):  # Alternated: noise hits all alike.
    for fn, t in zip(fns, times):
      t.append(_seconds(fn, args, clock, calls))
  e, f, fb, fi = (statistics.median(t) for t in times)
  y = y if isinstance(y, tuple) else (y,)
  backward = max(0.0, fb - f)
  return LayerProfile(
      name=name, forward_s=max(0.0, f - e), backward_s=backward,
      out_bytes=_nbytes(y),
      param_bytes=_nbytes(list(layer.trainable_variables)),
      input_grad_s=min(backward, max(0.0, fi - f))), y


def profile_layers(layer_params: Sequence[Any], inputs: Sequence[Any],
                   num_micro_batches: int, device: str | None = None,
                   repeats: int = 5, warmup: int = 1, batch_dim: int = 0,
                   clock: str = 'wall') -> list[LayerProfile]:
  """Times forward and backward of each layer of a sequence (see module doc).

  Args:
    layer_params: the sequence, as PipeliningLayer's p.layers; a layer's
      outputs (a tuple = several positional inputs) feed the next.
    inputs: positional inputs of the first layer for ONE mini-batch (real
      data, or `synthetic_inputs`); cut here to one micro-batch.
    num_micro_batches: M; the batch must divide by it.
    device: where to build and run the layers; None = the first stage's
      default device (`devices.default_devices(1)`).
    repeats: timed calls of each function; the median is kept.
    warmup: untimed calls after the tracing call.
    batch_dim: the batch dimension of every input leaf.
    clock: 'wall', or 'cpu' on a shared CPU host with single-threaded
      pools (see the module doc).

  Returns:
    One LayerProfile per layer, in order.

  Raises:
    ProfileError: empty layers or bad repeats, warmup or clock.
    microbatch.MicroBatchError: a batch that M does not divide.
  """
  if not layer_params:
    raise ProfileError('layer_params is empty; give the sequence of layer '
                       'Params to profile (e.g. PipeliningLayer p.layers).')
  if repeats < 1 or warmup < 0:
    raise ProfileError(f'repeats={repeats}, warmup={warmup}: use repeats ≥ '
                       '1 (the median of them is kept) and warmup ≥ 0.')
  if clock not in CLOCKS:
    raise ProfileError(f'clock={clock!r}; use one of {sorted(CLOCKS)}.')
  where = 'profile_layers'
  device = device or devices_lib.default_devices(1)[0]
  inputs = tuple(inputs)
  n = microbatch.batch_size(inputs, batch_dim, where)
  m = microbatch.num_micro_batches(n, num_micro_batches, None, where)
  cfg = _Settings(device, m, batch_dim, repeats, warmup, clock)
  with tf.device(device):
    x = tuple(tf.identity(t) for t in microbatch.split(
        tuple(tf.convert_to_tensor(t) for t in inputs), m, batch_dim)[0])
  profiles = []
  for i, lp in enumerate(layer_params):
    name = lp.name or lp.cls.__name__
    with tf.device(device):
      layer = lp.Copy().Instantiate()
    prof, x = _profile_one(layer, name, x, cfg)
    profiles.append(prof)
    del layer
    gc.collect()  # Frees this layer's variables before the next is built.
  return profiles


def costs_from_profiles(profiles: Sequence[LayerProfile],
                        include_transfer: bool = False,
                        bytes_per_second: float = DEFAULT_BYTES_PER_SECOND
                        ) -> list[float]:
  """Per-layer seconds for `partitioner.partition`: forward + backward.

  With `include_transfer`, each layer is also charged 2 × out_bytes /
  bytes_per_second: its output crosses a device boundary forward and its
  gradient (the same size) crosses back. The partitioner sums per-layer
  costs, so every layer is charged as if a stage ended after it, which
  overstates stages by their interior layers' transfers: fair when
  transfers are small next to compute or outputs are of similar size.
  Charging only the cut layers needs a partitioner with per-cut costs.

  Raises:
    ProfileError: no profiles, or a bandwidth that is not > 0.
  """
  if not profiles:
    raise ProfileError('profiles is empty; run profile_layers first.')
  if include_transfer and not bytes_per_second > 0:
    raise ProfileError(f'bytes_per_second={bytes_per_second!r} must be > 0 '
                       '(the stage-to-stage bandwidth, e.g. 1e10 for PCIe).')
  per_byte = 2.0 / bytes_per_second if include_transfer else 0.0
  return [p.total_s + per_byte * p.out_bytes for p in profiles]
