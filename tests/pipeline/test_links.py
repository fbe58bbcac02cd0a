"""lingvo_pipe.pipeline.links: transfer and all-reduce costs on a cluster,
and the simulator charging them per pair of devices."""

import pytest

from lingvo_pipe.pipeline import links
from lingvo_pipe.pipeline import simulator


def test_a_transfer_is_bytes_over_payload_bandwidth_plus_latency():
  link = links.Link(100e6, latency=2e-3, efficiency=0.5)
  assert link.transfer_time(1e6) == pytest.approx(1e6 * 8 / 50e6 + 2e-3)
  assert links.Link(1e9).transfer_time(0) == 0.0
  assert links.TCP_ETHERNET_EFFICIENCY == pytest.approx(0.9564, abs=1e-4)
  assert links.Link(1e9, 5e-6).describe() == '1 Gbit/s, 5 µs'


def test_an_overlapping_latency_passes_while_the_bytes_flow():
  link = links.Link(1e9, latency=3e-3, latency_overlaps=True)
  assert link.transfer_time(125e3) == pytest.approx(3e-3)  # 1 ms of wire.
  assert link.transfer_time(500e3) == pytest.approx(4e-3)  # 4 ms of wire.
  assert link.wire_time(500e3) == pytest.approx(4e-3)
  assert link.describe() == '1 Gbit/s, 3e+03 µs, latency beside the wire'
  # The link is held for the wire alone, either way.
  cluster = links.Cluster(2, 1, inside=link, between=link)
  assert cluster.link_busy_fn([0.0, 125e3])(0, 1) == pytest.approx(1e-3)
  assert cluster.transfer_time_fn([0.0, 125e3])(0, 1) == pytest.approx(3e-3)


@pytest.mark.parametrize('kwargs, match', [
    (dict(bandwidth=0), r'Link.bandwidth = 0 must be a finite number > 0'),
    (dict(bandwidth=1e9, latency=-1), r'Link.latency = -1 must be .* ≥ 0'),
    (dict(bandwidth=1e9, efficiency=1.5), r'efficiency = 1.5 must be ≤ 1'),
])
def test_impossible_links_are_named(kwargs, match):
  with pytest.raises(links.LinkError, match=match):
    links.Link(**kwargs)


def _cluster():
  """2 hosts × 2 devices: 8 Gbit/s inside, 0.8 Gbit/s + 1 ms between."""
  return links.Cluster(2, 2, inside=links.Link(8e9),
                       between=links.Link(8e8, latency=1e-3))


def test_devices_of_one_host_share_the_fast_link():
  c = _cluster()
  assert [c.host_of(d) for d in range(4)] == [0, 0, 1, 1]
  assert c.link(0, 1) is c.inside and c.link(1, 2) is c.between
  assert c.transfer_time(1e6, 2, 2) == 0.0
  assert c.transfer_time(1e6, 3, 0) == pytest.approx(1e-2 + 1e-3)
  with pytest.raises(links.LinkError, match='device 4 is not in this '
                     'cluster of 4 devices'):
    c.host_of(4)
  with pytest.raises(links.LinkError, match='num_hosts = 0'):
    links.Cluster(0, 2, c.inside, c.between)


def test_a_ring_all_reduce_is_paced_by_its_slowest_link():
  c = _cluster()
  assert c.all_reduce_time(1e6, [0]) == 0.0
  # Inside one host: 2·(2−1)/2 of the bytes, 2 hops of no latency.
  assert c.all_reduce_time(1e6, [0, 1]) == pytest.approx(1e6 * 8 / 8e9)
  # Over both hosts (tasks 0 and 2, e.g. stage 0 of K=2 × R=2): 6/4 of the
  # bytes at 0.8 Gbit/s and 6 hops of 1 ms for R=4.
  assert c.all_reduce_time(1e6, [0, 1, 2, 3]) == pytest.approx(
      1.5e6 * 8 / 8e8 + 6e-3)


def test_the_simulator_charges_each_hop_its_own_link():
  """K=4 over 2 hosts × 2 devices, M=1: the one micro-batch crosses the
  slow link (device 1 → 2) forward and back; the others are fast."""
  c = _cluster()
  stages = [simulator.StageCost(forward=0.01, boundary_bytes=1e6)] * 4
  hop = c.transfer_time_fn([0.0] + [1e6] * 3)
  result = simulator.simulate(stages, 1, 'never', transfer_time=hop)
  fast, slow = 1e6 * 8 / 8e9, 1e6 * 8 / 8e8 + 1e-3
  want = 4 * 0.01 + 4 * 0.02 + 2 * (2 * fast + slow)
  assert result.step_time == pytest.approx(want)
  assert 'transfer_time=per link' in result.to_text()
  # A constant callable is the constant transfer time.
  same = simulator.simulate(stages, 4, 'always', '1f1b',
                            transfer_time=lambda a, b: 0.003)
  assert same.step_time == pytest.approx(simulator.simulate(
      stages, 4, 'always', '1f1b', transfer_time=0.003).step_time)


def test_replica_r_starts_at_task_r_times_k():
  c = _cluster()
  hop = c.transfer_time_fn([0.0, 1e6], first_device=2)  # Replica 1, K=2.
  assert hop(0, 1) == pytest.approx(1e6 * 8 / 8e9)  # Tasks 2 and 3: host 1.
  hop = c.transfer_time_fn([0.0, 1e6], first_device=1)  # Tasks 1 and 2.
  assert hop(1, 0) == pytest.approx(1e6 * 8 / 8e8 + 1e-3)


def test_a_step_of_replicas_ends_with_each_stages_all_reduce():
  c = _cluster()
  # K=2 × R=2: stage 0 on tasks 0 and 2 (two hosts), stage 1 on 1 and 3.
  ends, grads = [1.0, 0.9], [1e6, 4e6]
  want = max(1.0 + c.all_reduce_time(1e6, [0, 2]),
             0.9 + c.all_reduce_time(4e6, [1, 3]))
  assert links.step_with_all_reduce(ends, grads, c, 2) == pytest.approx(want)
  assert links.step_with_all_reduce(ends, grads, c, 1) == 1.0


def test_transfers_in_one_direction_queue_for_their_link():
  """K=2, M=3, GPipe: F 1 s, B 2 s, a hop of 2 s on the wire + 0.5 s of
  latency. Activations leave at 1, 2, 3 s and queue: they arrive at 3.5,
  5.5, 7.5 s; stage 1 ends its backwards at 14.5 s, its gradients leave at
  10.5, 12.5, 14.5 s and arrive at 13, 15, 17 s; the step ends at 19 s.
  Without the queue they would arrive 1 s apart from 3.5 s: 17 s."""
  link = links.Link(bandwidth=4.0, latency=0.5)  # 1 byte: 2 s on the wire.
  cluster = links.Cluster(2, 1, inside=link, between=link)
  stages = [simulator.StageCost(forward=1.0, boundary_bytes=1.0)] * 2
  kwargs = dict(num_micro_batches=3, recompute='never',
                transfer_time=cluster.transfer_time_fn([0.0, 1.0]))
  queued = simulator.simulate(
      stages, link_busy=cluster.link_busy_fn([0.0, 1.0]), **kwargs)
  assert queued.step_time == pytest.approx(19.0)
  starts = {(e.stage, e.kind, e.micro_batch): e.start for e in queued.events}
  assert [starts[(1, 'F', m)] for m in range(3)] == pytest.approx(
      [3.5, 5.5, 7.5])
  assert simulator.simulate(stages, **kwargs).step_time == pytest.approx(17)
  assert cluster.link_busy_fn([0.0, 1.0])(1, 0) == pytest.approx(2.0)
  # M=1 with recompute: R and B of stage 0 both read the one gradient; it
  # crosses the link once, so nothing queues.
  kwargs.update(num_micro_batches=1, recompute='always')
  assert simulator.simulate(
      stages, link_busy=cluster.link_busy_fn([0.0, 1.0]),
      **kwargs).step_time == pytest.approx(
          simulator.simulate(stages, **kwargs).step_time)
