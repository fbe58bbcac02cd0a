"""fprop_context: defaults, nested scopes, thread isolation, stats sums."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.core import fprop_context
from lingvo_pipe.core.fprop_context import StatsCollector
from lingvo_pipe.core.nested_map import NestedMap


def test_default_is_an_inference_context():
  ctx = fprop_context.current()
  assert ctx == fprop_context.FPropContext()
  assert (ctx.training, ctx.step, ctx.micro_batch_index,
          ctx.num_micro_batches, ctx.batch_axis, ctx.first_example,
          ctx.global_batch_size) == (False, 0, 0, 1, 0, 0, None)
  assert ctx.stats is None and ctx.timeline is None


def test_nested_scopes_override_some_fields_and_restore():
  collector = StatsCollector()
  with fprop_context.scope(training=True, step=7) as outer:
    assert fprop_context.current() is outer
    with fprop_context.scope(micro_batch_index=2, stats=collector) as inner:
      assert fprop_context.current() is inner
      # Fields not overridden are inherited from the enclosing scope.
      assert (inner.training, inner.step, inner.micro_batch_index) == (
          True, 7, 2)
      assert inner.stats is collector
    assert fprop_context.current() is outer
    assert fprop_context.current().stats is None
  assert fprop_context.current() == fprop_context.FPropContext()


def test_scope_restores_after_an_exception():
  with pytest.raises(RuntimeError):
    with fprop_context.scope(training=True):
      raise RuntimeError('boom')
  assert not fprop_context.current().training


def test_context_is_immutable():
  with fprop_context.scope(training=True) as ctx:
    with pytest.raises(AttributeError):
      ctx.training = False  # type: ignore[misc]


def test_scopes_are_thread_local():
  seen: dict[str, bool] = {}
  entered, release = threading.Event(), threading.Event()

  def other() -> None:
    with fprop_context.scope(training=True, step=99):
      entered.set()
      release.wait(timeout=30)
      seen['other_inside'] = fprop_context.current().step == 99

  thread = threading.Thread(target=other)
  with fprop_context.scope(step=1):
    thread.start()
    assert entered.wait(timeout=30)
    # The other thread's open scope does not leak into this one.
    seen['main'] = (fprop_context.current().step == 1 and
                    not fprop_context.current().training)
    release.set()
    thread.join(timeout=30)
  assert seen == {'main': True, 'other_inside': True}


def test_stats_collector_add_sums_per_path():
  c = StatsCollector()
  c.add('net.bn', NestedMap(count=tf.constant(2.0), s=tf.constant([1.0, 2.0])))
  c.add('net.bn', NestedMap(count=tf.constant(3.0), s=tf.constant([10.0, 20.])))
  c.add('net.other', NestedMap(count=tf.constant(1.0)))
  stats = c.stats
  assert sorted(stats) == ['net.bn', 'net.other']
  assert float(stats['net.bn'].count) == 5.0
  np.testing.assert_allclose(stats['net.bn'].s.numpy(), [11.0, 22.0])
  assert float(stats['net.other'].count) == 1.0
  stats.clear()  # `stats` is a copy; the collector keeps its sums.
  assert sorted(c.stats) == ['net.bn', 'net.other']


def test_stats_collector_merge_sums_another_collectors_stats():
  a, b = StatsCollector(), StatsCollector()
  a.add('x', NestedMap(n=tf.constant(1.0)))
  b.add('x', NestedMap(n=tf.constant(2.0)))
  b.add('y', NestedMap(n=tf.constant(4.0)))
  a.merge(b.stats)
  assert float(a.stats['x'].n) == 3.0 and float(a.stats['y'].n) == 4.0
  assert float(b.stats['x'].n) == 2.0  # The merged-in collector is unchanged.


def test_stats_of_different_structure_do_not_mix():
  c = StatsCollector()
  c.add('x', NestedMap(n=tf.constant(1.0)))
  with pytest.raises((ValueError, TypeError)):
    c.add('x', NestedMap(m=tf.constant(1.0)))
