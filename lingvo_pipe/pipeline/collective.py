"""Collectives between stage processes: all-reduces, barriers, transfers.

With one process per pipeline stage (and per data-parallel replica), every
process runs its own stage's actions inside one `tf.function` per step,
and what processes exchange travels over TensorFlow's collective runtime:
a 2-member broadcast group per pair of tasks for a send/recv, and a ring
all-reduce for gradients, statistics and the step barrier. `Peers` is this
process's view of that: its task index, the tasks' addresses, its device,
and the operations the engine calls:

    grads = peers.all_reduce(grads, tasks=[1, 3], key=('grads', 1))
    loss_and_flag = peers.barrier([loss, finite])   # every task, every step
    token = peers.send(value, to_task=1, key=('ping', 0))        # task 0
    x = peers.recv(specs, from_task=0, key=('ping', 0))          # task 1

The executor's stage-boundary transfers, which must also match inside
`tf.while_loop`s, go through `boundary.py`. Why the rest looks like this
(each point was measured on TF 2.21):
- A collective is matched across processes by (group key, instance key), two
  int32s both sides must compute alike. The caller names a collective with a
  tuple `key`; the group key is a bitmask of the member tasks and the
  instance key a blake2b digest of the key and what else tells collectives
  apart (a transfer's direction and leaf, an all-reduce's dtype and chunk;
  the chunks are cut from static shapes, alike on every member). Python's
  `hash()` is salted per process, so it cannot serve. Two keys whose digests
  collide within one group are reported when the second is built: every
  member of a group builds every collective of that group, so each process
  sees all of its own groups' keys.
- Reusing the same keys on every step (one traced function called again) is
  how it is meant to be used; keys only need to be unique within a step.
- A send completes only once the receiver has posted the matching recv (it is
  a rendezvous, not a buffer). So never make a later op of the sending
  device wait on a send's token (two stages that each send before they
  receive would wait on each other for ever, e.g. in 1F1B); keep tokens
  for the step's end (`barrier(after=...)`). Order recvs with `after`
  instead, a data dependency (`dependency.ready`): as control edges,
  Grappler dropped them.
- Collective ops are asynchronous in a `tf.function`: automatic control
  dependencies neither order nor keep them. A send whose token nobody uses
  would be pruned, and its receiver would wait out the timeout; `send` marks
  its ops to run anyway (`dependency.independent`), and still returns the
  token.
- Without a timeout a mismatched key hangs for ever. But TF arms a timeout
  with a thread per op that sleeps out the whole timeout (TF 2.21): at ~37
  collectives a step, 300 s of timeout held ~16,000 threads per process,
  and the default model's run died of SIGABRT ("Resource temporarily
  unavailable") after 400 steps. So the ops of a started run
  (`processes.start`, unless `op_timeouts=True`) carry no TF timeout
  (`op_timeout_s=0`); the process watchdog ends a task whose steps stop
  finishing within `timeout_s`, and finds a dead peer within seconds
  (`watchdog.py`). A `Peers` built
  directly times each op out after `timeout_s`. A TF timeout aborts every
  collective of the process (TF's rule), so it is fatal: `explain(error)`
  turns the TF error into one line naming the op's key and the peer task
  and address.
- The collective ops take bool, float16/32/64 and int32/64; other dtypes
  travel widened losslessly (bfloat16 as float32, small ints as int32).

`Peers.local()` is the single-process case: all-reduces and barriers over
task 0 alone return their inputs, so one engine serves 1 and K processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import weakref
from typing import Any, Iterable, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.pipeline import dependency

Key = tuple  # Of str/int; both sides of a transfer build it alike.

_NATIVE = (tf.bool, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)
_WIDER = {tf.bfloat16: tf.float32, tf.int8: tf.int32, tf.uint8: tf.int32,
          tf.int16: tf.int32, tf.uint16: tf.int32, tf.uint32: tf.int64}
_MAX_BITMASK_TASKS = 30  # Group keys are int32: a bitmask up to 30 tasks.
_OP_NAME = re.compile(r'\blp_([a-z_]+?)_g(\d+)_i(\d+)')


class CollectiveError(errors.LingvoPipeError, RuntimeError):
  """A collective could not be built, or failed; names the key and peer."""


@dataclasses.dataclass(frozen=True)
class Peers:
  """This process's place in the run, and the collectives between tasks.

  `processes.start` makes it for a run of several processes. On one process
  (no cluster) reductions are identities, so the engine's code is the same:

  >>> peers = Peers.local()
  >>> peers.all_reduce({'w': tf.ones([2])}, [0], ('grads', 0))['w'].numpy()
  array([1., 1.], dtype=float32)

  Attributes:
    task: this process's index in `addresses`.
    addresses: 'host:port' of every task of the job, in task order.
    job: the TF job name ('worker'; 'localhost' for one process).
    timeout_s: every collective fails after this many seconds without its
      peers (a mismatch, or a peer that never got there). Generous, because
      a peer may still be tracing its first step.
    op_timeout_s: the TF timeout each op carries; None: `timeout_s`; 0: none
      (the watchdog's step deadline enforces `timeout_s`; see above).
    device_type: 'CPU' or 'GPU': this task's device for the collectives.
  """
  task: int
  addresses: tuple[str, ...]
  job: str = 'worker'
  timeout_s: float = 300.0
  device_type: str = 'CPU'
  op_timeout_s: float | None = None
  _registry: dict = dataclasses.field(
      default_factory=dict, init=False, repr=False, compare=False)
  _per_graph: Any = dataclasses.field(
      default_factory=weakref.WeakKeyDictionary, init=False, repr=False,
      compare=False)

  @classmethod
  def local(cls) -> 'Peers':
    """One process, no cluster: reductions over task 0 return their input."""
    return cls(task=0, addresses=('localhost',), job='localhost')

  @property
  def _op_timeout_s(self) -> float:
    return self.timeout_s if self.op_timeout_s is None else self.op_timeout_s

  def op_timeout(self) -> float:
    """The TF timeout each collective op carries (0: none)."""
    return self._op_timeout_s

  @property
  def num_tasks(self) -> int:
    return len(self.addresses)

  @property
  def device(self) -> str:
    """This task's device: place the stage's variables and ops here."""
    return self.task_device(self.task)

  def task_device(self, task: int) -> str:
    return f'/job:{self.job}/replica:0/task:{task}/device:{self.device_type}:0'

  def describe(self, task: int) -> str:
    """'task 2 at 10.0.0.3:2222', for messages."""
    return f'task {task} at {self.addresses[task]}'

  # ---- Stage boundaries ------------------------------------------------------
  def send(self, value: Any, to_task: int, key: Key) -> tf.Tensor | None:
    """Sends every tensor of the nest `value` to `to_task`.

    None leaves are skipped (the receiver's spec has None there too).

    Returns:
      A token (a bool scalar) that is ready once `to_task` has received
      everything; None in eager mode, where the send has then completed.
      The sends run even if nobody uses it; see the module docstring
      before ordering anything on it.
    """
    self._check_peer(to_task, 'send', key)
    ops = []
    with tf.device(self.device):
      for leaf, x in enumerate(tf.nest.flatten(value)):
        if x is None:
          continue
        x = tf.convert_to_tensor(x)
        group, instance = self._keys(
            _transfer(key, leaf, self.task, to_task), key,
            (self.task, to_task), ('p2p', self.task, to_task, leaf))
        op = tf.raw_ops.CollectiveBcastSendV2(
            input=_widen(x, key), group_size=2, group_key=group,
            instance_key=instance, timeout_seconds=self._op_timeout_s,
            name=f'lp_send_g{group}_i{instance}')
        dependency.independent([op])
        ops.append(op)
    if tf.executing_eagerly() or not ops:
      return None
    with tf.control_dependencies(ops):
      return tf.constant(True)

  def recv(self, spec: Any, from_task: int, key: Key,
           after: Iterable[Any] = ()) -> Any:
    """Receives the nest `from_task` sent with `key`.

    Args:
      spec: a nest like the sent one, with a `tf.TensorSpec` (or a tensor)
        of the full static shape and dtype at each leaf, None where the
        sender had None.
      from_task: the sender.
      key: the sender's key.
      after: tensors or ops (a nest; None ignored) the recv is posted behind.

    Returns:
      The nest of `spec`, received tensors in place of specs.
    """
    self._check_peer(from_task, 'recv', key)
    leaves = tf.nest.flatten(spec)
    out = []
    with tf.device(self.device):
      ready = dependency.ready(self.device, after)
      for leaf, s in enumerate(leaves):
        if s is None:
          out.append(None)
          continue
        dtype, shape = tf.as_dtype(s.dtype), tf.TensorShape(s.shape)
        if not shape.is_fully_defined():
          raise CollectiveError(
              f'recv(key={key!r}) from task {from_task}: leaf {leaf} has '
              f'shape {shape}, which is not fully defined; give the full '
              'static shape (micro-batch size included) in the spec.')
        group, instance = self._keys(
            _transfer(key, leaf, from_task, self.task), key,
            (from_task, self.task), ('p2p', from_task, self.task, leaf))
        x = tf.raw_ops.CollectiveBcastRecvV2(
            group_size=2, group_key=group,
            instance_key=instance if ready is None else instance + ready,
            shape=shape.as_list(), T=wire_dtype(dtype, key),
            timeout_seconds=self._op_timeout_s,
            name=f'lp_recv_g{group}_i{instance}')
        out.append(tf.cast(x, dtype) if x.dtype != dtype else x)
    return tf.nest.pack_sequence_as(spec, out)

  # ---- Reductions ------------------------------------------------------------
  def all_reduce(self, value: Any, tasks: Sequence[int], key: Key,
                 op: str = 'sum', after: Iterable[Any] = ()) -> Any:
    """Sums (or averages) every tensor of the nest `value` over `tasks`.

    Every task in `tasks` calls it with the same key and a nest of the same
    structure, static shapes and dtypes. Tensors of one dtype travel packed, in
    ring all-reduces of about CHUNK_BYTES that run at once. None leaves pass
    through.

    Args:
      value: a nest of tensors (e.g. one stage's gradients).
      tasks: the group, this task included (e.g. one stage's R replicas).
      key: names this reduction within the step.
      op: 'sum' or 'mean'.
      after: tensors or ops the reduction waits for.
    """
    if op not in ('sum', 'mean'):
      raise CollectiveError(f'all_reduce(key={key!r}, op={op!r}): op must be '
                            "'sum' or 'mean'.")
    members = self._check_group(tasks, key)
    leaves = tf.nest.flatten(value)
    out: list[Any] = list(leaves)
    with tf.device(self.device), tf.control_dependencies(_deps(after)):
      by_dtype: dict[tf.DType, list[int]] = {}
      for i, x in enumerate(leaves):
        if x is not None:
          out[i] = tf.convert_to_tensor(x)
          by_dtype.setdefault(out[i].dtype, []).append(i)
      for dtype, idx in sorted(by_dtype.items(), key=lambda kv: kv[0].name):
        tensors = [out[i] for i in idx]
        if len(members) == 1:
          reduced = [tf.identity(t) for t in tensors]
        else:
          reduced = [r for chunk, bucket in enumerate(_buckets(
              tensors, dtype.size)) for r in self._reduce_packed(
                  bucket, members, key, op, dtype, chunk)]
        for i, t in zip(idx, reduced):
          out[i] = t
    return tf.nest.pack_sequence_as(value, out)

  def barrier(self, values: Any = None, key: Key = ('barrier',),
              after: Iterable[Any] = ()) -> Any:
    """An all-reduce (sum) over every task: nobody leaves before all came.

    Call it at the end of every step, `after` the step's send tokens, so
    processes do not drift apart. It also carries values to everyone: e.g.
    the last stage passes [loss, finite], the others zeros.

    Returns:
      The summed `values`, or a float32 [0.] if `values` is None.
    """
    if values is None:
      values = tf.zeros([1], tf.float32)
    return self.all_reduce(values, range(self.num_tasks), ('barrier',) + key,
                           after=after)

  # ---- Errors ----------------------------------------------------------------
  def explain(self, error: BaseException) -> str | None:
    """One line naming the op, key and peer of a failed collective, or None.

    Args:
      error: what a step raised (a `tf.errors.OpError` names its op, and the
        ops built here carry their group and instance keys in their names).
    """
    for m in _OP_NAME.finditer(str(error)):
      if (int(m[2]), int(m[3])) in self._registry:
        what, members = self._registry[(int(m[2]), int(m[3]))]
        others = ', '.join(self.describe(t) for t in members
                           if t != self.task)
        text = str(error)
        cause = (f'timed out after {self.timeout_s:g} s' if 'timed out' in
                 text else f'failed: {_first_cause(text)}')
        return (f'task {self.task}: {what} ({others}) {cause}. Both sides '
                'must build the same key, shapes and dtypes; a peer that is '
                'only slow (e.g. still tracing) needs a longer '
                '--collective_timeout_secs.')
    return None

  # ---- Keys ------------------------------------------------------------------
  def _keys(self, what: str, key: Key, members: Sequence[int],
            salt: tuple[Any, ...]) -> tuple[int, int]:
    """(group key, instance key) of one collective; checks for collisions.

    Args:
      what: describes the collective alike on every member, for messages.
      key: the caller's key.
      members: the group's tasks.
      salt: what else tells this collective apart within the group.
    """
    _check_key(key)
    members = tuple(sorted(members))
    group = _group_key(members, self.num_tasks)
    instance = _digest((key,) + salt)
    self.register(group, instance, what, members, instance)
    return group, instance

  def group_of(self, members: Sequence[int]) -> int:
    """The group key of the tasks `members`."""
    return _group_key(tuple(sorted(members)), self.num_tasks)

  def register(self, group: int, instance: int, what: str,
               members: Sequence[int], use: Any) -> None:
    """Records collective `what` under (group, instance) for `explain`;
    refuses two different collectives with one key, and one collective
    built twice in a function (`use` tells legitimate repeats apart, e.g.
    the micro-batch of a transfer whose instance key adds it)."""
    members = tuple(sorted(members))
    seen, _ = self._registry.setdefault((group, instance), (what, members))
    if seen != what:
      raise CollectiveError(
          f'Keys collide: {what} and {seen} get the same instance key '
          f'{instance} in group {group}; change one of the two keys.')
    if not tf.executing_eagerly():
      graph = tf.compat.v1.get_default_graph()
      used = self._per_graph.setdefault(graph, set())
      if (group, instance, use) in used:
        raise CollectiveError(
            f'{what} is built twice in one function ({graph.name}); give '
            'each collective of a step its own key (e.g. add the '
            'micro-batch index).')
      used.add((group, instance, use))

  def _check_peer(self, task: int, kind: str, key: Key) -> None:
    if not 0 <= task < self.num_tasks or task == self.task:
      raise CollectiveError(
          f'{kind}(key={key!r}) on task {self.task} names task {task}; the '
          f'peer must be another task in [0, {self.num_tasks}).')

  def _check_group(self, tasks: Iterable[int], key: Key) -> list[int]:
    members = sorted(set(int(t) for t in tasks))
    if self.task not in members or not all(0 <= t < self.num_tasks
                                           for t in members):
      raise CollectiveError(
          f'all_reduce(key={key!r}) on task {self.task} over tasks '
          f'{list(tasks)}: the group must include this task and hold tasks '
          f'of [0, {self.num_tasks}).')
    return members

  def _reduce_packed(self, tensors: list[tf.Tensor], members: list[int],
                     key: Key, op: str, dtype: tf.DType,
                     chunk: int) -> list[tf.Tensor]:
    """One ring all-reduce of `tensors` (all of `dtype`) flattened into one;
    `chunk` tells it apart from the other chunks of `key`."""
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
    group, instance = self._keys(
        f'all_reduce of key {key!r} ({dtype.name}, chunk {chunk}) over '
        f'tasks {members}', key, members,
        ('all_reduce', dtype.name) + ((chunk,) if chunk else ()))
    reduced = tf.raw_ops.CollectiveReduceV2(
        input=_widen(flat, key), group_size=len(members), group_key=group,
        instance_key=instance, ordering_token=[], merge_op='Add',
        final_op='Div' if op == 'mean' else 'Id',
        timeout_seconds=self._op_timeout_s,
        name=f'lp_all_reduce_g{group}_i{instance}')
    reduced = tf.cast(reduced, dtype) if reduced.dtype != dtype else reduced
    parts = tf.split(reduced, [tf.size(t) for t in tensors]) if len(
        tensors) > 1 else [reduced]
    return [tf.reshape(p, tf.shape(t)) for p, t in zip(parts, tensors)]


def _first_cause(text: str) -> str:
  """The first line of a TF error that is neither a trace nor a header."""
  for line in text.split('\n'):
    line = line.strip()
    if line and not line.startswith(('File ', '[[', 'Detected at',
                                     'Graph execution')):
      return re.sub(r'^(Collective ops is aborted by: )+', '', line)
  return text.strip()[:200]


def _transfer(key: Key, leaf: int, src: int, dst: int) -> str:
  return f'transfer of key {key!r} leaf {leaf} from task {src} to task {dst}'


def _check_key(key: Key) -> None:
  if not isinstance(key, tuple) or not all(
      isinstance(k, (str, int)) for k in key):
    raise CollectiveError(
        f'Collective key {key!r} must be a tuple of str and int, e.g. '
        "('F', stage, micro_batch), built alike on both sides.")


def _digest(parts: Any) -> int:
  """A stable int32 in [1, 2³⁰) (repr of str/int tuples is stable across
  runs); [2³⁰, 2³¹) is left to stage-boundary transfers (`boundary.py`)."""
  raw = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
  return int.from_bytes(raw, 'little') % (2**30 - 1) + 1


def _group_key(members: Sequence[int], num_tasks: int) -> int:
  if num_tasks <= _MAX_BITMASK_TASKS:
    return sum(1 << t for t in members)
  return _digest(('group', tuple(members)))


# All-reduce chunk: between two single-core processes one 16 MiB all-reduce
# took 35 ms (22 ms CPU), four concurrent 4 MiB ones 26 ms.
CHUNK_BYTES = 4 << 20


def _buckets(tensors: list[tf.Tensor], itemsize: int
             ) -> list[list[tf.Tensor]]:
  """`tensors` in order, in runs of ≤ CHUNK_BYTES or of one larger tensor
  (one run if a shape is not static)."""
  buckets: list[list[tf.Tensor]] = [[]]
  size = 0
  for t in tensors:
    n = t.shape.num_elements()
    if n is None:
      return [tensors]
    if buckets[-1] and size + n * itemsize > CHUNK_BYTES:
      buckets.append([])
      size = 0
    buckets[-1].append(t)
    size += n * itemsize
  return buckets


def wire_dtype(dtype: tf.DType, key: Key) -> tf.DType:
  """The dtype `dtype` travels as (widened losslessly where needed)."""
  if dtype in _NATIVE:
    return dtype
  if dtype in _WIDER:
    return _WIDER[dtype]
  raise CollectiveError(
      f'Collective key {key!r}: dtype {dtype.name} cannot travel; use one of '
      f'{", ".join(d.name for d in _NATIVE + tuple(_WIDER))}.')


def _widen(x: tf.Tensor, key: Key) -> tf.Tensor:
  wire = wire_dtype(x.dtype, key)
  return x if wire == x.dtype else tf.cast(x, wire)


def _deps(after: Iterable[Any]) -> list[Any]:
  return [d for d in tf.nest.flatten(list(after)) if d is not None]
