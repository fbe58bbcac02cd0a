"""Stage processes train exactly like one process: K stages × R replicas.

Each case starts K·R real processes on 127.0.0.1 (tests/pipeline/
stage_proc.py), one per stage and replica, that pass stage boundaries over
TF's collective runtime and all-reduce each stage's gradients over its
replicas. Every process's gradients (by variable name), BatchNorm statistics
and the step's metrics must equal one process running the same schedule on
the whole batch (R replicas of M micro-batches = one of R·M), to 1e-5 or
float32 rounding (`transparency.Discrepancy.ok`; the float64 leg is the
single process's own).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.pipeline import transparency

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order
import runtime_procs  # pylint: disable=g-bad-import-order
import stage_runs  # pylint: disable=g-bad-import-order


@pytest.mark.parametrize('model,k,r,m,schedule,recompute', [
    ('transformer', 2, 1, 4, 'gpipe', 'except_last'),
    ('conv_bn', 2, 2, 2, '1f1b', 'always'),  # R=2 × K=2 = R=1 × K=2, M=4.
    ('nested', 2, 1, 4, 'interleaved', 'never'),
    # Middle stages receive from both neighbours; at M=8 such a period hung
    # as a loop while each iteration waited for all its transfers
    # (dependency.free_loop_body).
    ('nested', 4, 1, 8, '1f1b', 'except_last'),
    ('conv_bn', 2, 1, 4, 'gpipe', 'needed'),  # Kept F3 on both stages.
    # M=8: the steady state runs as loops in each process.
    ('transformer', 2, 1, 8, '1f1b', 'always'),
    ('nested', 2, 1, 8, 'gpipe', 'always'),
    # Zero bubble: split backward (I, then W) with kept forwards' saved
    # values; ZB-V's V map (device 0 holds stages 0 and 3) and loops.
    ('nested', 2, 1, 4, 'zb_h1', 'never'),
    ('transformer', 2, 1, 8, 'zb_v', 'always'),
    # A written schedule: 1F1B, one more warm-up forward on device 0.
    ('nested', 2, 1, 4, 'device 0: F0 F1 F2 R0 B0 F3 R1 B1 R2 B2 R3 B3\n'
     'device 1: F0 R0 B0 F1 R1 B1 F2 R2 B2 F3 R3 B3', 'always'),
    # A softmax tied to the embedding: each end holds a copy, and its
    # gradient is the sum over both copies (and replicas).
    ('tied', 2, 2, 2, 'gpipe', 'always'),
    ('tied', 4, 1, 4, '1f1b', 'except_last'),
])
def test_stage_processes_equal_one_process(tmp_path, model, k, r, m,
                                           schedule, recompute):
  runs = stage_runs.run(tmp_path, model, k, r, m, schedule, recompute)
  want_metrics, want_grads, want_stats, want64 = stage_runs.reference(
      model, k, r * m, schedule, recompute)
  seen = set()
  for run in runs:
    for name, value in run['metrics'].items():  # Everyone has the metrics.
      np.testing.assert_allclose(value, want_metrics[name], rtol=1e-5)
    names = sorted(run['grads'])
    seen |= set(names)
    got = [np.asarray(run['grads'][n]) for n in names]
    want = [want_grads[n] for n in names]
    d = transparency.discrepancy(got, want, [want64[n] for n in names])
    assert d.ok(), (names, d)
    for path, stats in run['stats'].items():
      for field, value in stats.items():
        np.testing.assert_allclose(value, want_stats[path][field], rtol=1e-5)
  assert seen == set(want_grads)  # Every variable lives in some process.


def test_profiled_partition_is_the_same_in_every_process(tmp_path):
  """costs='profile': each process times the layers itself, and timings
  differ between processes; all must still cut the same stages (else they
  would wait on transfers that never come), and train like one process."""
  runs = stage_runs.run(tmp_path, 'nested', 3, 1, 2, 'gpipe', 'always', 'profile')
  assert all(r['costs'] == runs[0]['costs'] for r in runs), [
      np.asarray(r['costs']) / runs[0]['costs'] - 1 for r in runs]
  assert all(r['boundaries'] == runs[0]['boundaries'] for r in runs)
  assert len(set(runs[0]['costs'])) > 1  # Measured, not a placeholder.
  want_metrics = stage_runs.reference('nested', 3, 2, 'gpipe', 'always')[0]
  for run in runs:
    for name, value in run['metrics'].items():
      np.testing.assert_allclose(value, want_metrics[name], rtol=1e-5)


def test_one_f_one_b_holds_the_same_activations_at_any_m(tmp_path):
  """1F1B on stage processes: a stage's step memory does not grow with M.

  Regression: Grappler dropped the control edges that post each recv behind
  an earlier op of its stage, so the last stage posted all M recvs at the
  step's start and held M received activations (4 → 16 micro-batches: +12
  × 256 KiB). GPipe, which keeps every micro-batch's activations, shows the
  measurement sees growth: it must grow by about M × a stage's layers.
  """
  proc = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'memory_proc.py')
  cluster = runtime_procs.spec(runtime_procs.free_ports(2))
  outs = [tmp_path / f'task{t}.json' for t in range(2)]
  with runtime_procs.Tasks(tmp_path) as tasks:
    for t in range(2):
      tasks.start([proc, f'--cluster_spec={cluster}', f'--task={t}',
                   f'--out={outs[t]}'], f'task{t}')
    for t, p in enumerate(tasks.procs):
      assert p.wait(timeout=runtime_procs.TIMEOUT_S) == 0, (
          t, tasks.output(t)[1][-3000:])
  boundary = 256 * 256 * 4  # One activation of one micro-batch.
  for t, path in enumerate(outs):
    growth = json.loads(path.read_text())
    extra = {s: growth[f'{s} 16'] - growth[f'{s} 4'] for s in ('1f1b',
                                                              'gpipe')}
    # Transfers in flight (up to transfers.RECV_LOOKAHEAD recvs and a send per
    # side) move the peak by a few boundaries; the bug added 12.
    assert extra['1f1b'] < 6 * boundary, (t, growth)
    # GPipe: 12 more micro-batches × 4 layers' outputs each.
    assert extra['gpipe'] > 0.75 * 12 * 4 * boundary, (t, growth)


def test_tied_copies_stay_bit_identical_over_fifty_steps(tmp_path):
  """Each end of a tied weight holds a copy; after 50 steps (gradients
  clipped at a global norm of 1, which must count the tied weight once)
  the two copies are bit-identical, and equal one process's weight."""
  runs = stage_runs.run(tmp_path, 'tied', 2, 1, 2, '1f1b', 'always',
                        extra=['--train_steps=50'])
  copies = [np.asarray(run['values']['net.emb/emb:0']) for run in runs]
  assert np.array_equal(copies[0], copies[1])
  net, inputs = stacks.net('tied', num_stages=2, num_micro_batches=2,
                           schedule='1f1b', recompute='always')
  one = stacks.train(net, inputs, stacks.loss_labels('tied'), 50)
  assert one['norms'][0] > 1.5  # The clipping is at work.
  for run in runs:
    np.testing.assert_allclose(run['norms'], one['norms'], rtol=1e-5)
    for name, value in run['values'].items():
      np.testing.assert_allclose(value, one['values'][name], rtol=1e-5,
                                 atol=1e-6)
