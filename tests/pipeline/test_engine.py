"""The emitted graph runs the schedule: read back from its data and control edges.

torchgpipe asserts its clock cycles; here the engine's graph is walked. Every
action of a step is emitted under the name scope `stage<s>_<kind><m>`; for
every schedule, K ≤ 4 and M ≤ 8, each device's actions must form a chain in
the schedule's order (action i+1 reachable from action i, never the
reverse), and every dependency the schedule names must be a path in the
graph. A schedule the engine ignored, or an order the executor could
reshuffle, fails here. The same holds inside every loop body, in one
process and in each stage process (whose traced graph, transfers
included, each process writes out for this test to read).
"""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import linear
from lingvo_pipe.pipeline import actions
from lingvo_pipe.pipeline import schedule as schedule_lib

import stage_runs  # pylint: disable=g-bad-import-order

_SCOPE = re.compile(r'(?:^|/)stage(\d+)_([A-Z_]+?)(\d+)(?:_\d+)?/')
# A kept stage's backward: tape.gradient names its ops after the forward's.
_TAPE = re.compile(r'gradient_tape/(?:.*/)?stage(\d+)_F(\d+)(?:_\d+)?/')
DEVICES = [f'/device:CPU:{k}' for k in range(4)]
_BATCH = 840  # Divisible by every M ≤ 8.


def _net(schedule: str, k: int, m: int, recompute: str, loop: bool = False):
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=4,
                                        output_dim=4, activation='TANH')
            for i in range(8)]
  p = gpipe.PipeliningLayer.Params().Set(
      name='net', layers=layers, num_stages=k, num_micro_batches=m,
      recompute=recompute, schedule=schedule, devices=DEVICES[:k],
      input_shapes=[[_BATCH, 4]],
      # Every op in the one graph this test walks; the loops' order is
      # test_loops.py's.
      loop_steady_state=loop)
  return p.Instantiate()


def _graph(net) -> Any:
  """The GraphDef (with its function library) of one FPropLoss step."""
  x = tf.ones([_BATCH, 4])
  labels = tf.ones([_BATCH])

  def _loss(y, w):
    return {'loss': (tf.reduce_mean(tf.square(y)), tf.reduce_sum(w))}

  @tf.function(autograph=False)
  def _step():
    with tf.GradientTape() as tape:
      with fprop_context.scope(training=True, step=0):
        metrics = net.FPropLoss(net.theta, (x,), labels, _loss)
    return tape.gradient(metrics['loss'][0], net.trainable_variables)
  return _step.get_concrete_function().graph.as_graph_def()


def _key(sched, op) -> tuple[int, str, int]:
  """An action's group: a recompute and its backward are one call, at R."""
  rebuilt = op.kind == 'B' and sched.rebuilds(op.stage, op.micro_batch)
  return (op.stage, 'R' if rebuilt else op.kind, op.micro_batch)


def _groups(nodes: dict[str, list[str]]) -> dict[tuple[int, str, int],
                                                 set[str]]:
  """(stage, kind, micro-batch) → names of the ops emitted for it."""
  groups = collections.defaultdict(set)
  for name in nodes:
    tape = _TAPE.search(name)
    if tape:
      groups[(int(tape.group(1)), 'B', int(tape.group(2)))].add(name)
      continue
    found = _SCOPE.search(name)
    if found:
      s, kind, m = found.groups()
      groups[(int(s), kind, int(m))].add(name)
  return groups


def _nodes(node_defs) -> dict[str, list[str]]:
  """Op name → the names of the ops it reads (data and control)."""
  return {n.name: [i.split(':')[0].lstrip('^') for i in n.input]
          for n in node_defs}


def _successors(nodes: dict[str, list[str]]) -> dict[str, list[str]]:
  edges = collections.defaultdict(list)
  for name, preds in nodes.items():
    for pred in preds:
      edges[pred].append(name)
  return edges


def _reachable(edges: dict[str, list[str]], start: set[str]) -> set[str]:
  seen, todo = set(start), list(start)
  while todo:
    for nxt in edges[todo.pop()]:
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def _walk(node_defs, sched, devices, complete: bool) -> int:
  """Checks the devices' chains and the dependencies in one graph (or loop
  body); `complete`: every action of `devices` must be in it. Returns how
  many action groups it found."""
  nodes = _nodes(node_defs)
  groups, edges = _groups(nodes), _successors(nodes)
  reach = {key: _reachable(edges, names) for key, names in groups.items()}
  for d in devices:
    ops = sched[d]
    keys = list(dict.fromkeys(_key(sched, op) for op in ops
                              if op.kind in actions.COMPUTE_KINDS))
    if complete:
      assert all(key in groups for key in keys), (d, keys, sorted(groups))
    keys = [key for key in keys if key in groups]
    for a, b in zip(keys, keys[1:]):  # The device's chain, in order.
      assert groups[b] & reach[a], f'device {d}: {b} does not wait for {a}'
      assert not groups[a] & reach[b], f'device {d}: {a} waits for {b}'
    previous = None
    for op in ops:
      key = _key(sched, op)
      if key in groups:
        for dep_d, dep in sched.dependencies(d, op):
          before = _key(sched, dep)
          if dep_d in devices and before in groups and before != key:
            assert groups[key] & reach[before], (op, dep)
        if op.kind.startswith('RECV_') and previous in groups:
          # Posted behind the device's previous compute action.
          assert groups[key] & reach[previous], (op, previous)
      if op.kind in actions.COMPUTE_KINDS:
        previous = key
  return len(groups)


def _loop_bodies(graph_def) -> list[Any]:
  """The node lists of the While bodies of `graph_def`, in graph order."""
  library = {f.signature.name: f for f in graph_def.library.function}
  return [library[n.attr['body'].func.name].node_def
          for n in graph_def.node if n.op in ('While', 'StatelessWhile')]


def _cases():
  for name in schedule_lib.SCHEDULES:
    for k in (1, 2, 3, 4):
      for m in range(1, 9):
        if name == 'interleaved' and (m % k or 2 * k > 8):
          continue
        yield name, k, m, 'always'
    yield name, 2, 4, 'never'
    yield name, 2, 4, 'except_last'
    yield name, 2, 4, 'needed'
    yield name, 3, 6, 'needed'


@pytest.mark.parametrize('name,k,m,recompute', list(_cases()))
def test_emitted_graph_follows_the_schedule(name, k, m, recompute):
  net = _net(name, k, m, recompute)
  sched = net.plan.schedule(m)
  _walk(_graph(net).node, sched, range(k), complete=True)


@pytest.mark.parametrize('name,k,m', [('gpipe', 2, 20), ('1f1b', 2, 20),
                                      ('1f1b', 4, 20), ('gpipe', 4, 20),
                                      ('interleaved', 2, 20)])
def test_loop_bodies_follow_the_schedule(name, k, m):
  # A looped step (the default): inside each loop body, every device's
  # actions are chained in the schedule's order, and every dependency the
  # schedule names between two of the body's actions is a path. (Between
  # iterations a device's order is a token: test_loops compares the
  # numbers and memory with the step emitted action by action.)
  net = _net(name, k, m, 'always', loop=True)
  sched = net.plan.schedule(m)
  bodies = _loop_bodies(_graph(net))
  assert bodies
  for body in bodies:
    assert _walk(body, sched, range(k), complete=False), [
        n.name for n in body][:20]


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_stage_process_loop_bodies_follow_the_schedule(tmp_path, schedule):
  # Each stage process traces its own stages' actions and the transfers
  # between them; its loop bodies must chain them in the schedule's order,
  # recvs posted behind the action before them (K=2, M=8).
  graphs = stage_runs.run(tmp_path, 'nested', 2, 1, 8, schedule, 'always',
                          graphs=True)
  sched = schedule_lib.make_schedule(schedule, 2, 8).with_transfers()
  for task, graph_def in enumerate(graphs):
    bodies = _loop_bodies(graph_def)
    assert bodies, task
    assert sum(_walk(b, sched, [task], complete=False) for b in bodies)
