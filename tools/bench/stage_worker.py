"""One stage process of a benchmark run (started by `stage_procs.launch`).

    python -m lingvo_pipe.launch --num_stages=K --num_replicas=R \\
        --worker=tools/bench/stage_worker.py -- --spec=run/spec.json \\
        --out_dir=run/

Every task of the run reads the same spec (JSON, written by
`stage_procs.py`): a list of configurations, each a training step of an FC
stack (FPropLoss of a PipeliningLayer + SGD in one `tf.function`, or a
hand-written tape step, `kind: "hand"`, optionally over `micro_batches`
slices), and how to time them. A configuration is either

* `scope: "run"` — built after `placement.use(peers)`: a pipeline of K
  stages × R replicas over every task of the run (K·R = #tasks);
* `scope: "local"` — built before it: an ordinary one-process step, run
  only by the tasks listed in `tasks` (the others wait at the barrier).
  That is how one run holds both a K=1 reference and the ceiling C
  ("alone" = one task runs it, "together" = both run it at once).

A configuration with `inline: true` inlines its stage bodies' calls as stage
processes do by default (`p.inline_stage_calls`): a local reference that
compares with them should.

A configuration with `slice_us` sets the scheduler slice of this task's
compute threads (`processes.shorten_slices`; 0: the kernel's default)
before each of its steps, so two configurations that differ only there
compare the slices within one launch.

A configuration with `rate_bits` (None: no limit) runs with the stage-to-
stage link at that rate, when the tasks run on hosts of tools/hosts.py:
before each of its steps, task 0 asks the harness through files in the
spec's `rate_dir` (links_bench.py applies it) and waits until it is set.
`same_as: <name>` reuses that configuration's network and step, so one
network is timed at several rates without a copy of its weights.

Configurations are timed in alternation, a barrier of every task before
each one, so the neighbours' load hits every configuration alike. Each
task writes `task<i>.json`: wall seconds per timed step, the engine's
timeline of `record` recorded steps (absolute `tf.timestamp` seconds:
comparable across the processes of one host), TF's allocator peak over one
step and the bytes in use before it (TF_CPU_ALLOCATOR_USE_BFC=true, set by
the harness before TF starts; TF_CPU_BFC_MEM_LIMIT_IN_MB caps it), peak
RSS, and the memory model's prediction of each device's activations,
workspace and transfers in flight (memory.py).
A step that runs out of memory ends the task with `"oom": true` written.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Callable

from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top,C0413
_startup.import_tensorflow(sys.argv)  # Without Keras's pyplot: less start-up.
from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))  # tools/: the bench package.

from lingvo_pipe.pipeline import processes  # pylint: disable=C0413

processes.define_flags()
_SPEC = flags.DEFINE_string('spec', '', 'The run\'s JSON spec.')
_OUT_DIR = flags.DEFINE_string('out_dir', '', 'Where task<i>.json goes.')

LEARNING_RATE = 1e-6  # Tiny SGD steps: the weights (and timings) stay put.


def _loss_fn(tf: Any) -> Callable[[Any, Any], dict[str, Any]]:
  def loss_fn(y: Any, labels: Any) -> dict[str, Any]:
    del labels  # The square loss needs none; the engine still splits them.
    n = tf.cast(tf.shape(y)[0], y.dtype)
    return {'loss': (tf.reduce_sum(tf.square(y)) / n, n)}
  return loss_fn


def _build(tf: Any, cfg: dict[str, Any], peers: Any) -> Any:
  """The PipeliningLayer of one configuration."""
  from bench import common  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.core import gpipe  # pylint: disable=g-import-not-at-top
  spec = common.NetSpec(*cfg['net'])
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=spec.layer_params(), num_stages=cfg['K'],
      num_micro_batches=cfg['M'], input_shapes=[[spec.batch, spec.width]],
      schedule=cfg.get('schedule', 'gpipe'),
      recompute=cfg.get('recompute', 'always'),
      virtual_stages_per_device=cfg.get('chunks', 2),
      inline_stage_calls=cfg.get('inline'))
  if cfg['scope'] == 'local':
    p.devices = [peers.device] * cfg['K']
  return p.Instantiate()


def _inputs(tf: Any, cfg: dict[str, Any], peers: Any, replica: int) -> Any:
  width, batch = cfg['net'][1], cfg['net'][2]
  with tf.device(peers.device):
    x = tf.Variable(tf.random.stateless_normal(
        [batch, width], seed=[7 + replica, 0]), trainable=False)
    labels = tf.Variable(tf.zeros([batch]), trainable=False)
  return x, labels


def _sgd(tf: Any, variables: list[Any], grads: list[Any]) -> list[Any]:
  return [v.assign_sub(LEARNING_RATE * g) for v, g in zip(variables, grads)
          if g is not None]


def _step_fn(tf: Any, cfg: dict[str, Any], net: Any, x: Any,
             labels: Any) -> Callable[[], Any]:
  """The training step: FPropLoss (or a plain tape step) + SGD."""
  from lingvo_pipe.core import fprop_context  # pylint: disable=C0415
  variables = list(net.trainable_variables)

  @tf.function(autograph=False)
  def step() -> Any:
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        if cfg.get('kind') == 'hand':  # No pipeline, no recompute.
          # `micro_batches`: the same kernels on M slices of the batch, one
          # after another, unrolled (what M does to the kernels alone).
          m = cfg.get('micro_batches', 1)
          losses = []
          for xs, ls in zip(tf.split(x, m), tf.split(labels, m)):
            for layer in net.children.layers:
              xs = layer.FProp(layer.theta, xs)
            losses.append(_loss_fn(tf)(xs, ls)['loss'][0])
          loss = tf.add_n(losses) / m
        else:
          loss = net.FPropLoss(net.theta, (x,), labels,
                               _loss_fn(tf))['loss'][0]
    updates = _sgd(tf, variables, tape.gradient(loss, variables))
    with tf.control_dependencies(updates):
      return tf.identity(loss)

  return step


def _kept_bytes(tf: Any, cfg: dict[str, Any]) -> list[float]:
  """Per layer, what a split backward keeps from I to W for the whole
  batch (`split_backward.layer_bytes` of one micro-batch × M)."""
  from bench import common  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.pipeline import split_backward  # pylint: disable=C0415
  spec, m = common.NetSpec(*cfg['net']), cfg['M']
  x = [tf.TensorSpec([spec.batch // m, spec.width], tf.float32)]
  return [float(split_backward.layer_bytes(p, x)[0] * m)
          for p in spec.layer_params()]


def _peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Config:
  """One configuration as this task runs it."""

  def __init__(self, tf: Any, cfg: dict[str, Any], peers: Any,
               replica: int, same: '_Config | None' = None) -> None:
    self.cfg = cfg
    self.result: dict[str, Any] = {'name': cfg['name'], 'times_s': [],
                                   'records': [], 'first_call_s': None}
    if same is not None:  # Another rate of the same network and step.
      self.net, self.step, self.recorder = same.net, same.step, same.recorder
      return
    self.net = _build(tf, cfg, peers)
    x, labels = _inputs(tf, cfg, peers, replica)
    self.step = _step_fn(tf, cfg, self.net, x, labels)
    self.recorder = None
    if cfg.get('kind') != 'hand':
      from lingvo_pipe.pipeline import timeline  # pylint: disable=C0415
      self.recorder = timeline.StepRecorder(
          self.net, (x,), _loss_fn(tf), labels=labels, normalize=False,
          update=lambda v, g: _sgd(tf, v, g))

  def first_call(self, tf: Any) -> None:
    """Times tracing + the first step, and the tracing alone (Python
    building the graph: the call's part before graph optimisation and the
    run); counts the traced step's ops (its graph and every function it
    holds: loop bodies, stage bodies)."""
    start = time.perf_counter()
    self.step.get_concrete_function()
    self.result['trace_s'] = time.perf_counter() - start
    self.step().numpy()
    self.result['first_call_s'] = time.perf_counter() - start
    graph = self.step.get_concrete_function().graph.as_graph_def()
    self.result['graph_ops'] = len(graph.node) + sum(
        len(f.node_def) for f in graph.library.function)

  def _slices(self) -> None:
    if 'slice_us' in self.cfg:
      processes.shorten_slices(self.cfg['slice_us'])

  def timed_call(self) -> None:
    self._slices()
    start = time.perf_counter()
    self.step().numpy()
    self.result['times_s'].append(time.perf_counter() - start)

  def record(self) -> None:
    self._slices()
    if self.recorder is not None and self.cfg.get('record', True):
      self.result['records'].append([list(r) for r in self.recorder()])

  def memory(self, tf: Any) -> None:
    """Allocator bytes in use before one step and its peak; the simulator's
    activation peak of each device."""
    tf.config.experimental.reset_memory_stats('CPU:0')
    before = tf.config.experimental.get_memory_info('CPU:0')['current']
    self.step().numpy()
    info = tf.config.experimental.get_memory_info('CPU:0')
    self.result['memory'] = {
        'before_bytes': before, 'peak_bytes': info['peak'],
        'param_bytes': sum(int(v.shape.num_elements()) * 4
                           for v in self.net.trainable_variables)}
    if self.cfg.get('kind') != 'hand':
      # The memory model (memory.py): the simulator's activation peak, the
      # backward's workspace and the transfers in flight. The batch is
      # resident before the step (a variable; micro-batches are views of
      # it), as with whole-batch io, whose io is then not counted.
      from lingvo_pipe.pipeline import memory as memory_lib  # pylint: disable=C0415
      from lingvo_pipe.pipeline import schedule as schedule_lib  # pylint: disable=C0415
      schedule = self.cfg.get('schedule', 'gpipe')
      pred = memory_lib.predict(
          self.net.metas, self.net.boundaries, self.cfg['M'],
          input_bytes=self.cfg['net'][1] * self.cfg['net'][2] * 4,
          schedule=schedule, recompute=self.cfg.get('recompute', 'always'),
          optimizer=None, whole_batch_io=True,
          num_chunks=schedule_lib.chunks_of(schedule,
                                            self.cfg.get('chunks', 2)),
          stage_processes=self.cfg['scope'] == 'run',
          layer_kept_bytes=_kept_bytes(tf, self.cfg)
          if schedule in ('zb_h1', 'zb_v') else None)
      self.result['memory']['predicted'] = [
          {'activation_bytes': s.activations, 'workspace_bytes': s.workspace,
           'transfer_bytes': s.transfers} for s in pred.stages]


def _run(tf: Any, spec: dict[str, Any], peers: Any, out: dict[str, Any]
         ) -> None:
  from lingvo_pipe.pipeline import placement  # pylint: disable=C0415
  configs: list[tuple[_Config | None, dict[str, Any]]] = []
  for cfg in spec['configs']:  # Local ones first: before placement.use.
    if cfg['scope'] == 'local':
      mine = peers.task in cfg.get('tasks', [0])
      configs.append((_Config(tf, cfg, peers, 0) if mine else None, cfg))
  placement.use(peers)
  built: dict[str, _Config] = {}
  for cfg in spec['configs']:
    if cfg['scope'] == 'run':
      # Replica r of a K-stage config: tasks r·K … r·K+K−1.
      built[cfg['name']] = _Config(tf, cfg, peers, peers.task // cfg['K'],
                                   built.get(cfg.get('same_as', '')))
      configs.append((built[cfg['name']], cfg))
  out['configs'] = []
  rates = _Rates(spec.get('rate_dir'), peers.task == 0)

  def _each(what: Callable[[_Config], None], tag: str) -> None:
    for i, (config, cfg) in enumerate(configs):
      rates.set(cfg)
      peers.barrier(key=('bench', tag, i))
      if config is not None:
        what(config)

  _each(lambda c: c.first_call(tf), 'first')
  for w in range(spec.get('warmup', 1)):
    _each(lambda c: c.timed_call(), f'warm{w}')
  for c, _ in configs:
    if c is not None:
      c.result['times_s'].clear()
  for r in range(spec.get('reps', 3)):
    _each(lambda c: c.timed_call(), f'rep{r}')
  if spec.get('record', 0):
    _each(lambda c: c.record(), 'trace_timed')  # Traces; dropped below.
    for c, _ in configs:
      if c is not None:
        c.result['records'].clear()
    for r in range(spec['record']):
      _each(lambda c: c.record(), f'record{r}')
  if spec.get('memory'):
    _each(lambda c: c.memory(tf), 'memory')
  out['configs'] = [c.result for c, _ in configs if c is not None]
  peers.barrier(key=('bench', 'done'))


class _Rates:
  """Task 0 asks the hosts harness for a configuration's link rate."""

  def __init__(self, rate_dir: str | None, asks: bool) -> None:
    self._dir = rate_dir if asks else None
    self._asked = 0
    self._rate: Any = 'unset'

  def set(self, cfg: dict[str, Any]) -> None:
    rate = cfg.get('rate_bits')
    if self._dir is None or rate == self._rate:
      return
    self._asked += 1
    with open(os.path.join(self._dir, 'request.tmp'), 'w') as f:
      json.dump({'seq': self._asked, 'rate_bits': rate}, f)
    os.replace(os.path.join(self._dir, 'request.tmp'),
               os.path.join(self._dir, 'request'))
    applied = os.path.join(self._dir, 'applied')
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      try:
        with open(applied) as f:
          if json.load(f)['seq'] == self._asked:
            self._rate = rate
            return
      except (OSError, ValueError):
        pass
      time.sleep(0.005)
    raise RuntimeError(f'the harness did not set rate {rate} within 60 s')


def main(argv: list[str]) -> None:
  del argv
  with open(_SPEC.value) as f:
    spec = json.load(f)
  out: dict[str, Any] = {}
  path = None
  # The schedules' threads, as the trainer picks them (--inter_op_threads
  # overrides): one launch holds configs of one kind.
  threads = flags.FLAGS.inter_op_threads or processes.inter_op_threads_for(
      *(c.get('schedule', 'gpipe') for c in spec['configs']
        if c['scope'] == 'run'))
  with processes.start_from_flags(inter_op_threads=threads) as peers:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    path = os.path.join(_OUT_DIR.value, f'task{peers.task}.json')
    out.update(task=peers.task, num_tasks=peers.num_tasks, pid=os.getpid(),
               cores=sorted(os.sched_getaffinity(0)))
    try:
      _run(tf, spec, peers, out)
    except tf.errors.ResourceExhaustedError as e:
      out.update(oom=True, error=str(e).splitlines()[0][:300],
                 peak_rss_bytes=_peak_rss_bytes())
      with open(path, 'w') as f:
        json.dump(out, f)
      os._exit(3)  # pylint: disable=protected-access  # Peers may hang.
  out['peak_rss_bytes'] = _peak_rss_bytes()
  with open(path, 'w') as f:
    json.dump(out, f)


if __name__ == '__main__':
  app.run(main)
