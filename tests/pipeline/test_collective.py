"""Tests of lingvo_pipe.pipeline.collective.

In this process (no cluster): what both sides of a transfer derive from a
key, the single-process case, and the errors. With real processes on
127.0.0.1 (tests/pipeline/runtime_worker.py, one process per task): nests
along a chain of three, in both directions, under tf.function on two steps;
all-reduces and the barrier; a mismatched key that times out by name.
"""

import json
import re

import pytest
import tensorflow as tf

from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.pipeline import boundary
from lingvo_pipe.pipeline import collective
from runtime_procs import spawn_tasks  # pylint: disable=g-bad-import-order

_ADDRESSES = ('127.0.0.1:1', '127.0.0.1:2', '127.0.0.1:3')


def _peers(task, timeout_s=300.0):
  return collective.Peers(task=task, addresses=_ADDRESSES,
                          timeout_s=timeout_s)


def _trace(fn, *specs):
  return tf.function(fn, autograph=False).get_concrete_function(*specs)


def _op_names(fn):
  graph = _trace(fn).graph
  return sorted(op.name for op in graph.get_operations()
                if op.type.startswith('Collective'))


def test_sender_and_receiver_derive_the_same_keys():
  spec = NestedMap(x=tf.TensorSpec([2], tf.float32), mask=None,
                   ids=tf.TensorSpec([3], tf.int32))
  value = NestedMap(x=tf.ones([2]), mask=None, ids=tf.range(3))
  sent = _op_names(lambda: _peers(1).send(value, 2, ('F', 1, 7)))
  received = _op_names(lambda: _peers(2).recv(spec, 1, ('F', 1, 7)))
  assert [n.replace('send', 'recv') for n in sent] == received
  assert len(sent) == 2  # The None leaf does not travel.
  # A group key is the bitmask of its tasks: 1 and 2 → 0b110.
  assert all('_g6_' in n for n in sent)
  # The other direction, and another micro-batch, are other transfers.
  back = _op_names(lambda: _peers(2).send(value, 1, ('F', 1, 7)))
  other = _op_names(lambda: _peers(1).send(value, 2, ('F', 1, 8)))
  assert not set(back) & set(sent) and not set(other) & set(sent)


def test_a_send_runs_even_if_its_token_is_not_used():
  tokens = []

  def send_two_leaves():
    tokens.append(_peers(0).send([tf.ones([2]), tf.ones([3])], 1, ('F', 0)))

  graph = _trace(send_two_leaves).graph
  sends = [op for op in graph.get_operations()
           if op.type == 'CollectiveBcastSendV2']
  assert len(sends) == 2
  assert all(op.get_attr('_independent_side_effects') for op in sends)
  # The token waits for both.
  assert set(sends) <= set(tokens[0].op.control_inputs)


def test_local_peers_reduce_over_task_0_alone():
  peers = collective.Peers.local()
  value = {'g': tf.constant([1.0, 2.0]), 'n': tf.constant([3]), 'none': None}
  reduced = peers.all_reduce(value, [0], ('grads',))
  assert reduced['none'] is None
  assert reduced['g'].numpy().tolist() == [1.0, 2.0]
  assert reduced['n'].numpy().tolist() == [3]
  assert peers.barrier(tf.constant([4.0, 1.0])).numpy().tolist() == [4.0, 1.0]
  assert peers.num_tasks == 1 and peers.device.startswith('/job:localhost')
  with pytest.raises(collective.CollectiveError, match=r'another task in'):
    peers.send(tf.ones([1]), 1, ('F', 0))


@pytest.mark.parametrize('call, match', [
    (lambda p: p.send(tf.ones([1]), 1, ['F', 0]), r'tuple of str and int'),
    (lambda p: p.send(tf.ones([1]), 0, ('F', 0)), r'names task 0'),
    (lambda p: p.recv(tf.TensorSpec([None, 2]), 1, ('F', 0)),
     r'not fully defined.*full static shape'),
    (lambda p: p.send(tf.constant(['a']), 1, ('F', 0)),
     r'dtype string cannot travel'),
    (lambda p: p.all_reduce(tf.ones([1]), [1, 2], ('g',)),
     r'must include this task'),
    (lambda p: p.all_reduce(tf.ones([1]), [0, 1], ('g',), op='max'),
     r"'sum' or 'mean'"),
])
def test_misuse_names_the_key_and_the_fix(call, match):
  with pytest.raises(collective.CollectiveError, match=match):
    _trace(lambda: call(_peers(0)))


def test_one_key_twice_in_one_function_is_refused():
  peers = _peers(0)

  def twice():
    peers.send(tf.ones([1]), 1, ('F', 0, 0))
    peers.send(tf.ones([1]), 1, ('F', 0, 0))

  with pytest.raises(collective.CollectiveError, match=r'built twice'):
    _trace(twice)
  # Tracing the same function again (a new step signature) is fine.
  once = tf.function(lambda x: peers.send(x, 1, ('F', 0, 1)),
                     autograph=False)
  once.get_concrete_function(tf.TensorSpec([1]))
  once.get_concrete_function(tf.TensorSpec([2]))


def test_a_large_reduction_goes_in_chunks_of_whole_tensors():
  mib = [tf.zeros([256, 1024]), tf.zeros([3, 256, 1024]), tf.zeros([8]),
         tf.zeros([6, 256, 1024]), tf.zeros([1])]  # 1, 3, 0, 6, 0 MiB.
  assert collective.CHUNK_BYTES == 4 << 20
  runs = collective._buckets(mib, 4)  # pylint: disable=protected-access
  assert [[t.shape.num_elements() for t in r] for r in runs] == [
      [262144, 786432], [8], [1572864], [1]]  # In order, ≤ 4 MiB or one.


def test_widened_dtypes_travel_and_come_back_in_their_own_dtype():
  spec = tf.TensorSpec([2], tf.bfloat16)
  traced = _trace(lambda: _peers(1).recv(spec, 0, ('F', 0)))
  assert traced.structured_outputs.dtype == tf.bfloat16


def test_explain_names_key_peer_and_address():
  peers = _peers(2, timeout_s=7)
  names = _op_names(lambda: peers.recv(tf.TensorSpec([2]), 1, ('B', 2, 5)))
  error = tf.errors.DeadlineExceededError(
      None, None, 'Graph execution error:\n\nDetected at node ...\n'
      'Collective has timed out waiting for other workers.\n\t '
      f'[[{{{{node stage/{names[0]}}}}}]] [Op:__inference_step_9]')
  line = peers.explain(error)
  assert "('B', 2, 5)" in line and 'task 1 at 127.0.0.1:2' in line
  assert 'timed out after 7 s' in line and '\n' not in line
  assert peers.explain(ValueError('unrelated')) is None


# ---- Real processes ----------------------------------------------------------
def _results(out):
  return [json.loads(m) for m in re.findall(r'RESULT (.*)', out)]


def test_nests_travel_a_chain_of_three_both_ways_on_two_steps(tmp_path):
  runs = spawn_tasks(3, ['--scenario=chain'], tmp_path)
  for task, run in enumerate(runs):
    assert run.returncode == 0, run.stderr[-3000:]
    results = _results(run.stdout)
    assert [r['step'] for r in results] == [0, 1]
    for r in results:
      s = r['step']
      # x accumulates s + 10·t along the chain; ids are task 0's.
      expected_x = sum(s + 10.0 * t for t in range(task + 1))
      assert r['x'] == [[expected_x] * 3] * 2
      assert r['ids'] == [100 * s + i for i in range(4)]
      # The gradient starts as −x on the last task, doubled per hop back.
      last_x = sum(s + 10.0 * t for t in range(3))
      assert r['grad'] == [[-last_x * 2 ** (2 - task)] * 3] * 2
      assert r['sum_v'] == [6.0] * 3 and r['sum_n'] == [6]
      assert r['mean'] == [2.0]  # mean of 0, 2, 4.
      assert r['big'] == [[6.0 * (i + 1)] * 2 for i in range(3)]  # Chunked.
      assert r['shared'] == [6 * last_x, 3.0]  # The last task's loss.


def test_a_mismatched_key_times_out_naming_key_and_peer(tmp_path):
  # Task 1 waits longer, so task 0 times out first, always: with equal
  # timeouts either could, and the other then finds its peer gone (exit 75).
  runs = spawn_tasks(2, ['--scenario=mismatch'], tmp_path,
                     {0: ['--collective_timeout_secs=3'],
                      1: ['--collective_timeout_secs=8']})
  assert runs[0].returncode == 1, runs[0].stderr[-3000:]
  assert re.search(r"CollectiveError: task 0: transfer of key \('F', 0, 0\) "
                   r'.*task 1 at 127\.0\.0\.1:\d+\) timed out after 3 s',
                   runs[0].stderr), runs[0].stderr[-3000:]
  # Task 1 names its own key when it times out, or task 0 once it is gone.
  assert runs[1].returncode in (1, 75), runs[1].stderr[-3000:]
  assert re.search(r"task 1: transfer of key \('F', 0, 1\) .*task 0 at "
                   r'127\.0\.0\.1:\d+\)|task 1: peer task 0 at '
                   r'127\.0\.0\.1:\d+ is gone', runs[1].stderr), (
                       runs[1].stderr[-3000:])


def test_a_boundary_has_one_instance_key_per_shape():
  """TF keeps an instance key's shape for the life of the process, so the
  length buckets of one boundary leaf need keys of their own; a shape seen
  again gets its key back (both sides trace the same steps in order)."""
  key = boundary._instance  # pylint: disable=protected-access
  short, long = key('F', 3, 1, (4, 8)), key('F', 3, 1, (4, 16))
  assert short != long and key('F', 3, 1, (4, 8)) == short
  assert len({short, long, key('B', 3, 1, (4, 8)), key('F', 3, 0, (4, 8)),
              key('F', 2, 1, (4, 8))}) == 5
  assert all(k % boundary.MAX_MICRO_BATCHES == 0 and 2**30 <= k < 2**31
             for k in (short, long))
  for n in range(boundary.MAX_SHAPES - 2):
    key('F', 3, 1, (n, 1))
  with pytest.raises(collective.CollectiveError, match='length buckets'):
    key('F', 3, 1, (99, 1))
