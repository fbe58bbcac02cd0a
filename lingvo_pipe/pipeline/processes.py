"""Start-up of one stage process: cluster, TF server, peers, watchdog.

Every process of a multi-process run (one per stage and replica, on one host
or many) calls `start` first thing, before any TensorFlow op:

    config = processes.cluster_from(cluster_spec='worker=h1:2222,h2:2222',
                                    task=1)        # or from TF_CONFIG
    with processes.start(config) as peers:         # every task, same spec
      train(peers)                                 # collective.Peers

`start` reads the cluster (the `--cluster_spec`/`--job`/`--task` flags,
Lingvo's convention, else TensorFlow's `TF_CONFIG`), pins the process to its
cores with matching thread pools, starts this task's TF server with
collective ops enabled (what MultiWorkerMirroredStrategy does), waits until
every peer answers, starts a `Watchdog` and meets the peers in a barrier. A
task that never answers (`--peer_timeout_secs`), a port already taken, and
a peer that dies or becomes unreachable later (`--peer_unreachable_secs`,
from the barrier on) each end in one line naming the task and its address,
not in a hang.

Why this way (measured on TF 2.21, 127.0.0.1):
- Multi-controller: each process runs its own `tf.function`s. The eager
  remote runtime, where one client drives every worker, ran the worker
  parts of one function one after another.
- Peer liveness: TF's `check_collective_ops_peer_health` (a GetStatus RPC,
  what MultiWorkerMirroredStrategy's health thread uses) noticed a SIGKILLed
  peer within about a second. TF's coordination service was tried instead:
  it aborts collectives after its heartbeat timeout but leaves the process
  running, hung in start-up when a peer died before registering, and its
  errors span dozens of lines.
- The collective group leader (which resolves group membership) is task 0.
- TF's compute threads keep the kernel's scheduler slice unless
  `--compute_slice_us` asks for a shorter one (`shorten_slices`). On a
  one-core stage process a boundary transfer hands off between several
  threads (gRPC, the collective executor, the executor), and under Linux's
  EEVDF scheduler each hand-off can wait for the running compute thread's
  slice (1.4 ms here). With 100 µs, probes at K=2 (16 × FC 512, batch
  1024, M=8; both arms alternated in one launch) first gave 1–5% shorter
  steps, but `tools/benchmark.py slices`, 3 runs of 2 launches later the
  same day, gave on ÷ off from 0.92 to 1.06 with no consistent sign. So it
  is off by default. (SCHED_IDLE compute threads were no better, and any
  other process on the core starves them.)

With no cluster (`config` None), `start` gives `collective.Peers.local()`
and does nothing else, so a binary has one code path for 1 and K processes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import platform
import re
import struct
import time
from typing import Any, Mapping, Sequence

from absl import flags
import tensorflow as tf
from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context

from lingvo_pipe import errors
from lingvo_pipe.pipeline import collective
from lingvo_pipe.pipeline import watchdog as watchdog_lib

DEFAULT_JOB = 'worker'


class ClusterError(errors.LingvoPipeError, RuntimeError):
  """A cluster that cannot start: a bad spec, a port in use, a peer that
  never answered; the message names the task and the fix."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """Which tasks form the run, and which one this process is."""
  addresses: tuple[str, ...]
  task: int
  job: str = DEFAULT_JOB


def task_of(stage: int, replica: int, num_stages: int) -> int:
  """The task of `stage` in `replica`: a replica's stages are adjacent
  tasks (the launcher pins task i to core i mod #cores)."""
  return replica * num_stages + stage


def stage_tasks(stage: int, num_stages: int, num_replicas: int) -> list[int]:
  """The R tasks that hold `stage`: its gradients' all-reduce group."""
  return [task_of(stage, r, num_stages) for r in range(num_replicas)]


def cluster_from(cluster_spec: str = '', job: str = DEFAULT_JOB,
                 task: int | None = None,
                 environ: Mapping[str, str] | None = None
                 ) -> ClusterConfig | None:
  """The cluster from flags (first) or `TF_CONFIG`; None for one process.

  Args:
    cluster_spec: Lingvo's format, 'worker=h1:p,h2:p' (jobs joined by '@').
    job: the job of this process within `cluster_spec`.
    task: this process's index in the job.
    environ: where to look for TF_CONFIG (default os.environ).

  Raises:
    ClusterError: a malformed spec or TF_CONFIG, or a task out of range.
  """
  environ = os.environ if environ is None else environ
  if cluster_spec:
    jobs = _parse_spec(cluster_spec)
    where = f'--cluster_spec={cluster_spec}'
    if task is None:
      raise ClusterError(f'{where} needs --task: this process\'s index in '
                         f'job {job!r}.')
  elif environ.get('TF_CONFIG'):
    jobs, job, task = _parse_tf_config(environ['TF_CONFIG'])
    where = 'TF_CONFIG'
  else:
    return None
  if set(jobs) != {job}:
    raise ClusterError(
        f'{where} has jobs {sorted(jobs)} (this task: {job!r}); lingvo_pipe '
        'runs one job of identical processes: list every task under '
        f'{DEFAULT_JOB!r}.')
  addresses = jobs[job]
  if not 0 <= task < len(addresses):
    raise ClusterError(f'{where}: task {task} is out of range; job {job!r} '
                       f'has tasks 0..{len(addresses) - 1}.')
  return ClusterConfig(addresses=tuple(addresses), task=task, job=job)


def start(config: ClusterConfig | None, *, cores: Sequence[int] | None = None,
          collective_timeout_s: float = 300.0, peer_timeout_s: float = 120.0,
          unreachable_s: float = 10.0, watchdog: bool = True,
          op_timeouts: bool = False, compute_slice_us: int = 0,
          inter_op_threads: int = 0) -> 'Runtime':
  """Starts this task of the run; call it before any TensorFlow op.

  Args:
    config: from `cluster_from`; None for a single process.
    cores: pin this process to these CPUs (else keep the inherited mask,
      e.g. the launcher's one core). Thread pools follow the mask.
    collective_timeout_s: `Peers.timeout_s`: a step (or the shutdown
      barrier) that takes longer ends the process.
    peer_timeout_s: how long to wait for every peer to answer, and for the
      start-up barrier.
    unreachable_s: a peer silent this long (a network partition) ends the
      process (`Watchdog`); watched from the start-up barrier on.
    watchdog: watch the peers and exit when one dies.
    op_timeouts: give every collective op the TF timeout (a failure then
      names the op's key and peer), at the cost of a thread per op for the
      whole timeout (collective.py); only for short programs. Else the
      trainer's step deadline (`watchdog.expect_step`) bounds a hang.
    compute_slice_us: give TF's compute threads this scheduler time slice
      (`shorten_slices`); 0 keeps the kernel's default.
    inter_op_threads: TF's inter-op threads; 0: one per core of the mask
      (`inter_op_threads_for` picks one more for a split schedule).

  Raises:
    ClusterError: TF already started, a port in use, or a failed barrier.
    watchdog.PeerUnreachableError: peers that did not answer in time.
  """
  if cores:
    os.sched_setaffinity(0, set(cores))
  _configure_threads(inter_op_threads)
  if config is None:
    return Runtime(collective.Peers.local(), None)
  # No TF timeout on each op (a sleeping thread per op: collective.py); the
  # watchdog's step deadline enforces collective_timeout_s instead.
  peers = collective.Peers(task=config.task, addresses=config.addresses,
                           job=config.job, timeout_s=collective_timeout_s,
                           device_type=_device_type(),
                           op_timeout_s=None if op_timeouts else 0.0)
  _start_server(config)
  if compute_slice_us:
    shorten_slices(compute_slice_us)
  watch = watchdog_lib.Watchdog(peers, unreachable_s=unreachable_s)
  missing = watch.wait_until_up(peer_timeout_s)
  if missing:
    names = ', '.join(peers.describe(t) for t in missing)
    raise watchdog_lib.PeerUnreachableError(
        f'task {config.task}: {names} did not answer within '
        f'{peer_timeout_s:g} s (--peer_timeout_secs): not started yet, or '
        'not reachable from here; start every task with the same cluster '
        '(--cluster_spec or TF_CONFIG) and its own --task, and check that '
        'the addresses are reachable from this host.')
  if watchdog:  # Before the barrier: a peer lost during it is named.
    watch.start()
  _meet(peers, peer_timeout_s, watch)
  return Runtime(peers, watch)


def define_flags() -> None:
  """Defines the cluster flags of a worker binary (absl); call it once, at
  the binary's top level: --cluster_spec, --job, --task,
  --collective_timeout_secs, --peer_timeout_secs, --peer_unreachable_secs,
  --compute_slice_us, --inter_op_threads."""
  flags.DEFINE_string('cluster_spec', '', 'The run\'s tasks, Lingvo style: '
                      '"worker=host:port,host:port"; empty: TF_CONFIG, or '
                      'one process.')
  flags.DEFINE_string('job', DEFAULT_JOB, 'This process\'s job in '
                      '--cluster_spec.')
  flags.DEFINE_integer('task', None, 'This process\'s index in its job.')
  flags.DEFINE_float('collective_timeout_secs', 300.0, 'A training step '
                     'that takes longer (the first: 6× as long, as it '
                     'traces) while every peer answers ends the task with '
                     'an error; a dead peer is found within seconds.')
  flags.DEFINE_float('peer_timeout_secs', 120.0, 'How long start-up waits '
                     'for every task to answer.')
  flags.DEFINE_float('peer_unreachable_secs', 10.0, 'A peer that does not '
                     'answer for this long (a network partition) ends the '
                     'task, exit 75, with one line naming it; a peer whose '
                     'process ended is found within about a second.',
                     lower_bound=0.1)
  flags.DEFINE_integer('compute_slice_us', 0, 'Scheduler time slice of '
                       'TensorFlow\'s compute threads, so that boundary '
                       'transfers need not wait behind compute (Linux ≥ '
                       '6.12, which keeps it within 100..100000; '
                       'elsewhere no effect; tools/benchmark.py slices '
                       'measures it); 0: the kernel\'s default.',
                       lower_bound=0)
  flags.DEFINE_integer('inter_op_threads', 0, 'TensorFlow\'s inter-op '
                       'threads in this process; 0: one per core it may '
                       'use, and one more when the model\'s schedule splits '
                       'its backward (zb_h1, zb_v), whose sends otherwise '
                       'wait behind its weight gradients.', lower_bound=0)


def start_from_flags(**kwargs: Any) -> 'Runtime':
  """`start` with the flags of `define_flags` (after absl parsed them)."""
  f = flags.FLAGS
  config = cluster_from(f.cluster_spec, f.job, f.task)
  kwargs.setdefault('inter_op_threads', f.inter_op_threads)
  return start(config, collective_timeout_s=f.collective_timeout_secs,
               peer_timeout_s=f.peer_timeout_secs,
               unreachable_s=f.peer_unreachable_secs,
               compute_slice_us=f.compute_slice_us, **kwargs)


class Runtime:
  """A started task: its `peers`, and a guard for the code that uses them."""

  def __init__(self, peers: collective.Peers,
               watch: 'watchdog_lib.Watchdog | None') -> None:
    self.peers = peers
    self.watchdog = watch

  def __enter__(self) -> collective.Peers:
    return self.peers

  def __exit__(self, exc_type: Any, exc: BaseException | None,
               tb: Any) -> bool:
    """On an error: a dead peer ends the process with one line naming it; a
    failed collective becomes a CollectiveError naming key and peer. Without
    one: every task meets in a last barrier, so none exits under a peer's
    watchdog."""
    if self.watchdog is None:
      return False
    if exc is None:
      self.shutdown()
      return False
    if isinstance(exc, Exception):
      self.watchdog.exit_if_peer_dead(cause=exc)
    # Peers see this task leave; its own error is the one to report.
    self.watchdog.stop()
    line = self.peers.explain(exc)
    if line:
      raise collective.CollectiveError(line) from None
    return False

  def shutdown(self) -> None:
    """Stops the watchdog, waits at a barrier for every other task, then
    keeps this task's server up for `LINGER_S`.

    The barrier is a ring all-reduce, which ends on a task once it has what
    it needs, not once its peers have: a task that left it and exited at
    once closed its server under a peer still fetching the last chunk from
    it, and that peer failed ("Socket closed", then "peer task 1 … is
    gone", exit 75). Stand-in stage processes forked in the tests, which
    skip an interpreter's finalization (the time that had hidden it), did
    so once in four runs of test_stage_processes.
    """
    if self.watchdog is None:
      return
    self.watchdog.stop()
    try:
      dataclasses.replace(self.peers, op_timeout_s=None).barrier(
          key=('shutdown',))
    except Exception as e:  # pylint: disable=broad-except
      self.watchdog.exit_if_peer_dead(cause=e)
      raise
    time.sleep(LINGER_S)


# ---- Helpers -----------------------------------------------------------------
# After the shutdown barrier: a peer's last fetch from this task is a local
# RPC of a few milliseconds (`Runtime.shutdown`).
LINGER_S = 0.5
_SPEC_JOB = re.compile(r'^(\w+)=(.+)$')
_ADDRESS = re.compile(r'(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):\d+')  # IPv6 in [].


def _parse_spec(spec: str) -> dict[str, list[str]]:
  jobs = {}
  for part in spec.split('@'):
    m = _SPEC_JOB.match(part.strip())
    addresses = [a.strip() for a in m[2].split(',')] if m else []
    if not m or not all(_ADDRESS.fullmatch(a) for a in addresses):
      raise ClusterError(
          f'--cluster_spec={spec}: cannot read {part!r}; write '
          '"worker=host:port,host:port" (jobs joined by "@").')
    jobs[m[1]] = addresses
  return jobs


def _parse_tf_config(text: str) -> tuple[dict[str, list[str]], str, int]:
  try:
    config = json.loads(text)
    jobs = {str(k): [str(a) for a in v] for k, v in config['cluster'].items()}
    return jobs, str(config['task']['type']), int(config['task']['index'])
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ClusterError(
        f'TF_CONFIG={text!r} cannot be read ({type(e).__name__}: {e}); '
        'write {"cluster": {"worker": ["host:port", ...]}, "task": '
        '{"type": "worker", "index": i}}.') from None


def _configure_threads(inter_op_threads: int = 0) -> None:
  """Intra-op threads = the cores this process may use; inter-op threads
  the same unless `inter_op_threads` says otherwise.

  More inter-op threads than cores only time-slice kernels on a core: two
  kernels of a stage then run at once, each slower, and the one the other
  stage waits for finishes later (DEVELOPERS.md). Collectives and function
  calls are asynchronous kernels that hold no inter-op thread while they
  wait, so transfers still overlap compute. With one thread, a send in a
  loop must be ordered (`dependency.behind_send`), and a schedule that
  splits its backward needs a second thread (`inter_op_threads_for`).
  """
  ncores = len(os.sched_getaffinity(0))
  pinned = ncores < (os.cpu_count() or 1)
  if not pinned and not inter_op_threads:
    return  # Not pinned: TensorFlow's defaults.
  try:
    if pinned:
      tf.config.threading.set_intra_op_parallelism_threads(ncores)
    tf.config.threading.set_inter_op_parallelism_threads(
        inter_op_threads or ncores)
  except RuntimeError as e:
    raise ClusterError(_TOO_LATE.format(e)) from None


def inter_op_threads_for(*schedules: Any) -> int:
  """`start`'s inter_op_threads for a process running pipelines of these
  `p.schedule`s: 0 (one per core), or one more than the cores if one of
  them splits its backward into I and W (zb_h1, zb_v, a text schedule
  with I/W actions).

  With one thread per core, a split schedule's W and next F were ready
  whenever a send was, and TF's executor ran them first: the value left
  only when the device ran out of compute. At K=2, M=8 (16 × FC 512,
  recompute never, AMD EPYC, 2 launches each) the two processes were busy
  at once 55% (zb_h1) and 30% (zb_v) of the step, and zb_h1 took 1.06×
  1F1B's step, zb_v 1.46×. With a second thread, 90% and 78%, and 0.87×
  and 1.03× (DEVELOPERS.md). GPipe and 1F1B idle while they wait, so the
  send goes out; a second thread only time-slices their kernels.
  """
  from lingvo_pipe.pipeline import schedule as schedule_lib  # pylint: disable=C0415
  if not any(schedule_lib.splits_backward(s) for s in schedules):
    return 0
  return len(os.sched_getaffinity(0)) + 1


_TOO_LATE = ('processes.start() came after TensorFlow\'s runtime started '
             '({}); call it first thing, before any TF op, variable or device '
             'query.')


# sched_setattr(2) per architecture; Python has no wrapper for it.
_SCHED_SETATTR = {'x86_64': 314, 'aarch64': 274}
_COMPUTE_THREAD = 'tf_Compute'  # TF's inter-op pool threads run the kernels.


def compute_threads() -> list[int]:
  """Thread ids of this process's TensorFlow compute threads."""
  tids = []
  for tid in os.listdir('/proc/self/task'):
    try:
      with open(f'/proc/self/task/{tid}/comm') as f:
        if f.read().strip() == _COMPUTE_THREAD:
          tids.append(int(tid))
    except OSError:  # The thread has ended.
      pass
  return sorted(tids)


def shorten_slices(slice_us: int, tids: Sequence[int] | None = None) -> int:
  """Gives threads (default: `compute_threads()`) a scheduler time slice of
  `slice_us` µs; returns how many took it (0 where the kernel or platform
  cannot: then nothing changes).

  The slice is EEVDF's `sched_runtime` of a normal thread (Linux ≥ 6.12):
  with a short one, a thread that wakes (a transfer's next hand-off)
  runs within that time instead of after the running compute thread's
  default slice (1.4 ms here). The threads' weight, their share of the
  CPU, is unchanged. 0 restores the default.
  """
  number = _SCHED_SETATTR.get(platform.machine())
  if number is None or not os.path.isdir('/proc/self/task'):
    return 0
  libc = ctypes.CDLL(None, use_errno=True)
  # struct sched_attr, version 0: size, policy (SCHED_OTHER), flags, nice,
  # priority, runtime (ns), deadline, period.
  attr = ctypes.create_string_buffer(struct.pack(
      'IIQiIQQQ', 48, 0, 0, 0, 0, slice_us * 1000, 0, 0))
  done = 0
  for tid in compute_threads() if tids is None else tids:
    if libc.syscall(number, tid, attr, 0) == 0:
      done += 1
  return done


def _device_type() -> str:
  return 'GPU' if tf.config.list_physical_devices('GPU') else 'CPU'


def _start_server(config: ClusterConfig) -> None:
  """This task's TF server, with collectives led by task 0."""
  ctx = context.context()
  if ctx._context_handle is not None:  # pylint: disable=protected-access
    raise ClusterError(_TOO_LATE.format('its context exists'))
  ctx.configure_collective_ops(
      collective_leader=f'/job:{config.job}/replica:0/task:0',
      device_filters=(f'/job:{config.job}/task:{config.task}',))
  address = config.addresses[config.task]
  server_def = tensorflow_server_pb2.ServerDef(
      cluster=tf.train.ClusterSpec({config.job: list(config.addresses)}
                                   ).as_cluster_def(),
      job_name=config.job, task_index=config.task, protocol='grpc',
      port=int(address.rsplit(':', 1)[1]), default_session_config=ctx.config)
  ctx.enable_collective_ops(server_def)
  try:
    ctx.ensure_initialized()
  except tf.errors.OpError as e:
    if 'Could not start gRPC server' in str(e):
      raise ClusterError(
          f'task {config.task}: cannot listen on {address}: the port is in '
          'use (another run on the same ports?); stop that run or give '
          'this one other ports.') from None
    raise


def _meet(peers: collective.Peers, timeout_s: float,
          watch: 'watchdog_lib.Watchdog') -> None:
  """A first barrier: every task is up and the collective path works. A
  peer lost meanwhile ends the process through `watch`, naming it."""
  slow = dataclasses.replace(peers, timeout_s=timeout_s, op_timeout_s=None)
  try:
    slow.barrier(key=('startup',))
  except Exception as e:  # pylint: disable=broad-except
    watch.exit_if_peer_dead(cause=e)
    raise ClusterError(
        f'task {peers.task}: the start-up barrier of {peers.num_tasks} tasks '
        f'failed within {timeout_s:g} s ({type(e).__name__}) though every '
        'peer answers; every task must run the same cluster spec.') from None
