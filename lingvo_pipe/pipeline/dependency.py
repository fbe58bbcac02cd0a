"""Every artificial dependency of the engine, and why each exists.

A schedule is an order: each device runs its actions one after another, and
a recv is posted behind a given action. TensorFlow's graph has no such
order: it runs an op as soon as its inputs exist, prunes what no output
needs, folds what it can, and drops control edges that it rewrites. Each
helper below forces one piece of the order, and each was a silent failure
when missing (measured when it was added; the tests named guard them):

* `chained`     identities of a value that wait for other tensors, inside a
                traced stage body. The device's order: each action's call
                takes the previous action's outputs (`after`) and waits on
                them here; TF drops control dependencies on the call of an
                inlined function, which let micro-batches run out of order
                (peak memory ∝ M). And R's input waits for the incoming
                gradient: otherwise Grappler's common-subexpression
                elimination merged the recompute with the forward and kept
                the activations for the whole step (test_engine, test_memory).
* `opaque`      hides a value from constant folding. Grappler specialises
                a function call with a constant input: one optimised copy of
                the stage body per call site. Micro-batch indices, the loss
                seeds (ones, zeros), the first accumulator and the first
                action's `after` are constants; a K=2, 12-layer Transformer
                step took 22 s instead of 8 s to start (test_grappler).
* `token`       a scalar that exists once a device's last action has
                finished: what carries a device's order across a loop's
                iterations (the loop's carried state holds one per device).
* `computed`    identities of tensors, to wait on as control inputs: a
                control edge on an inlined call's output waits only for
                the call to start. A loop's token fired as its action
                began, and later iterations' forwards ran beside it
                (test_loops); a timeline's end stamp fired at its start.
* `independent` exempts ops from tf.function's automatic control
                dependencies. Stage bodies holding `tf.timestamp()` are
                stateful, and tf.function would chain every stateful op in
                program order: all stages in one sequence, no overlap
                (test_timeline). Collective calls likewise: a send nobody
                consumes is kept (not pruned), and nothing is ordered behind
                it (a send completes only when its receiver posts the recv;
                two stages each waiting on their own send wait forever).
* `made_after`  `make()` once some tensors exist, waiting *by data* through
                a call Grappler does not fold across. Control edges in the
                outer graph were lost where Grappler rewrote the op they
                named: every recv of the last stage was posted at the step's
                start and its 1F1B activations grew with M (test_stage_
                processes' memory case).
* `ready`       an int32 zero made after some tensors: a recv adds it to its
                instance key, so it cannot be posted earlier.
* `behind_send` in a loop body, what a device does after a send waits for
                the send. A stage process has one inter-op thread per core,
                and TF's executor runs the kernel it made ready last first:
                a send call made ready beside the next iteration's forward
                waited behind every forward the loop could run ahead
                (parallel_iterations), and the next stage with it. K=2
                GPipe with recompute, its steady state in loops, took 2-5%
                longer than with two inter-op threads; ordered, 1-5% less.
* `free_loop_body`  builds a `tf.while_loop` whose body has no automatic
                control dependencies. Inside tf.function, while_v2 traces
                the body with them, and they end it with a barrier: every
                value the body returns (the counter too) waits for every
                stateful op of the iteration, `independent` ones included.
                On stage processes that made each iteration wait until its
                peer had taken every send and filled every recv: K=4 1F1B
                (middle stages receive from both neighbours in one
                iteration) and K=2 1F1B with recompute, its recvs posted
                three calls ahead, deadlocked across processes (every
                transfer timed out; test_stage_processes), and where
                nothing deadlocked each process's next iteration waited for
                its peer's. Without them, an op in the body runs once its
                inputs exist; what must run reaches the loop's outputs (the
                carried send token, the records, the received values;
                test_loops checks the body has no barrier).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import tensorflow as tf

__all__ = ['behind_send', 'chained', 'computed', 'free_loop_body',
           'independent', 'index', 'made_after', 'opaque', 'ready', 'token']


def chained(x: Any, after: Sequence[tf.Tensor]) -> Any:
  """`x` (a nest) behind identities that wait for `after`."""
  with tf.control_dependencies(list(after)):
    return tf.nest.map_structure(
        lambda t: t if t is None else tf.identity(t), x)


def opaque(x: tf.Tensor) -> tf.Tensor:
  """`x`, hidden from Grappler's constant folding (a graph placeholder
  whose default is `x`)."""
  return tf.compat.v1.placeholder_with_default(x, x.shape)


def index(m: int) -> tf.Tensor:
  """Micro-batch index m as an int32 tensor that is never a constant."""
  return opaque(tf.constant(m, tf.int32))


def computed(after: Sequence[Any]) -> list[Any]:
  """What waits, as a control input, until each tensor of `after` exists:
  an identity of it (ops pass through). A control edge on a called
  function's output waits, once TF inlines the call, only for the call to
  start (its stateful ops), not for that output; an identity reads it as
  data. Without it, a timeline's end stamp fired as its action began
  (`stage.Clock`), and a loop's carried device order (`token`) fired as
  the last action began, so micro-batches of later iterations ran beside
  it (GPipe with recompute on stage processes)."""
  return [tf.identity(t) if isinstance(t, tf.Tensor) else t for t in after]


def behind_send(after: Sequence[tf.Tensor], sent: tf.Tensor
                ) -> list[tf.Tensor]:
  """`after`, and a send's token: what waits on it waits for the send too
  (its receiver has taken the value)."""
  return [*after, sent]


def token(device: str, after: Sequence[tf.Tensor], zero: tf.Tensor,
          by_data: bool = True) -> tf.Tensor:
  """A scalar (`zero`'s value) that exists once `after` does.

  `by_data`: wait until `after`'s tensors exist (`computed`). False for a
  token that must not wait for what it names (the sends' token: an
  iteration must not wait for its peer's recvs).
  """
  with tf.device(device):
    with tf.control_dependencies(computed(after) if by_data else list(after)):
      return tf.identity(zero)


@contextlib.contextmanager
def free_loop_body() -> Iterator[None]:
  """A `tf.while_loop` built in this context traces its body without
  automatic control dependencies (the module docstring says why). Every
  stateful op of the body must then reach the loop's outputs, or TF prunes
  it."""
  graph = tf.compat.v1.get_default_graph()
  # while_v2 reads the enclosing graph's flag to decide for the body.
  before = getattr(graph, '_add_control_dependencies', False)
  graph._add_control_dependencies = False  # pylint: disable=protected-access
  try:
    yield
  finally:
    graph._add_control_dependencies = before  # pylint: disable=protected-access


def independent(outputs: Iterable[Any]) -> None:
  """Exempts the ops of `outputs` (tensors or ops) from tf.function's
  automatic control dependencies: they are neither ordered in program
  order nor pruned when unused."""
  if tf.executing_eagerly():
    return
  ops = {getattr(t, 'op', t) for t in outputs if t is not None}
  for op in ops:
    manager = getattr(op.graph, 'experimental_acd_manager', None)
    if manager is not None:
      manager.run_independently(op)


_AFTER: dict[tuple[str | None, Any], Any] = {}


def made_after(device: str | None, tensors: Sequence[tf.Tensor],
               make: Callable[[], tf.Tensor]) -> tf.Tensor:
  """`make()` on `device`, once every tensor in `tensors` exists.

  In a graph the result comes out of a `_noinline` function of `tensors`.
  `make` is a module-level function (one traced function per device and
  `make`).
  """
  if tf.executing_eagerly():
    return make()
  key = (device, make)
  if key not in _AFTER:
    def _made(*waited: tf.Tensor) -> tf.Tensor:
      with tf.device(device), tf.control_dependencies(waited):
        return make()
    _AFTER[key] = tf.function(_made, autograph=False,
                              experimental_attributes={'_noinline': True})
  return _AFTER[key](*tensors)


def _zero() -> tf.Tensor:
  return tf.constant(0, tf.int32)


def ready(device: str, after: Iterable[Any]) -> tf.Tensor | None:
  """An int32 zero that exists only once every tensor (or op) in `after`
  does; None if `after` is empty or eager."""
  deps = [d for d in tf.nest.flatten(list(after)) if d is not None]
  if not deps or tf.executing_eagerly():
    return None
  tensors = [d for d in deps if isinstance(d, tf.Tensor)]
  ops = [d for d in deps if not isinstance(d, tf.Tensor)]
  with tf.control_dependencies(ops):
    return made_after(device, tensors, _zero)
