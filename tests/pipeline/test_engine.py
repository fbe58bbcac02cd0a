"""The emitted graph runs the schedule: read back from its data and control edges.

torchgpipe asserts its clock cycles; here the engine's graph is walked. Every
op of a step is emitted under the name scope `stage<s>_<kind><m>`; for every
schedule, K ≤ 4 and M ≤ 8, each device's ops must form a chain in the
schedule's order (op i+1 reachable from op i, never the reverse), and every
dependency the schedule names must be a path in the graph. A schedule the
engine ignored, or an order the executor could reshuffle, fails here.
"""

from __future__ import annotations

import collections
import re

import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import linear
from lingvo_pipe.pipeline import schedule as schedule_lib

_SCOPE = re.compile(r'(?:^|/)stage(\d+)_([FRB])(\d+)(?:_\d+)?/')
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


def _graph(net) -> tf.Graph:
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
  return _step.get_concrete_function().graph


def _groups(graph: tf.Graph) -> dict[tuple[int, str, int], set[str]]:
  """(stage, kind, micro-batch) → names of the ops emitted for it."""
  groups = collections.defaultdict(set)
  for op in graph.get_operations():
    tape = _TAPE.search(op.name)
    if tape:
      groups[(int(tape.group(1)), 'B', int(tape.group(2)))].add(op.name)
      continue
    found = _SCOPE.search(op.name)
    if found:
      s, kind, m = found.groups()
      groups[(int(s), kind, int(m))].add(op.name)
  return groups


def _successors(graph: tf.Graph) -> dict[str, list[str]]:
  edges = collections.defaultdict(list)
  for op in graph.get_operations():
    for t in op.inputs:
      edges[t.op.name].append(op.name)
    for c in op.control_inputs:
      edges[c.name].append(op.name)
  return edges


def _reachable(edges: dict[str, list[str]], start: set[str]) -> set[str]:
  seen, todo = set(start), list(start)
  while todo:
    for nxt in edges[todo.pop()]:
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


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
  graph = _graph(net)
  groups, edges = _groups(graph), _successors(graph)

  def _key(d, op):  # A recompute and its backward are one call.
    s = sched.stage(d, op)
    kind = 'R' if op.kind == 'B' and sched.rebuilds(s, op.micro_batch) else (
        op.kind)
    return (s, kind, op.micro_batch)

  reach = {key: _reachable(edges, names) for key, names in groups.items()}
  for d, ops in enumerate(sched):
    keys = list(dict.fromkeys(_key(d, op) for op in ops))
    assert all(key in groups for key in keys), (d, keys, sorted(groups))
    for a, b in zip(keys, keys[1:]):  # The device's chain, in order.
      assert groups[b] & reach[a], f'device {d}: {b} does not wait for {a}'
      assert not groups[a] & reach[b], f'device {d}: {a} waits for {b}'
    for op in ops:
      for dep in schedule_lib.dependencies(sched, d, op):
        before = _key(*dep)
        if before != _key(d, op):
          assert groups[_key(d, op)] & reach[before], (op, dep)


def _loop_bodies(graph: tf.Graph) -> list[tf.Graph]:
  """The body graphs of the While ops of `graph`, in graph order."""
  bodies = []
  for op in graph.get_operations():
    if op.type in ('While', 'StatelessWhile'):
      bodies.append(graph._get_function(  # pylint: disable=protected-access
          op.get_attr('body').name).graph)
  return bodies


@pytest.mark.parametrize('name,k,m', [('gpipe', 2, 20), ('1f1b', 2, 20),
                                      ('1f1b', 4, 20), ('gpipe', 4, 20),
                                      ('interleaved', 2, 20)])
def test_loop_bodies_follow_the_schedule(name, k, m):
  # A looped step (the default in one process): inside each loop body,
  # every device's ops are chained in the schedule's order, and every
  # dependency the schedule names between two of the body's ops is a path.
  # (Between iterations a device's order is a token: test_loops compares
  # the numbers and memory with the op-by-op step.)
  net = _net(name, k, m, 'always', loop=True)
  sched = net.plan.schedule(m)
  bodies = _loop_bodies(_graph(net))
  assert bodies
  for body in bodies:
    groups, edges = _groups(body), _successors(body)
    assert groups, [op.name for op in body.get_operations()][:20]
    reach = {key: _reachable(edges, names) for key, names in groups.items()}
    for d, ops in enumerate(sched):
      keys = [(sched.stage(d, op), op.kind, op.micro_batch) for op in ops
              if op.kind != 'B' or not sched.rebuilds(sched.stage(d, op),
                                                      op.micro_batch)]
      keys = [key for key in keys if key in groups]
      for a, b in zip(keys, keys[1:]):
        assert groups[b] & reach[a], f'device {d}: {b} does not wait for {a}'
        assert not groups[a] & reach[b], f'device {d}: {a} waits for {b}'
      for op in ops:
        key = (sched.stage(d, op), op.kind, op.micro_batch)
        if key not in groups:
          continue
        for dep_d, dep in schedule_lib.dependencies(sched, d, op):
          s = sched.stage(dep_d, dep)
          kind = 'R' if dep.kind == 'B' and sched.rebuilds(
              s, dep.micro_batch) else dep.kind
          before = (s, kind, dep.micro_batch)
          if before in groups and before != key:
            assert groups[key] & reach[before], (op, dep)
