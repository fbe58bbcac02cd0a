"""What moving bytes between devices costs: links, hosts, all-reduces.

A pipeline's stage boundaries and its replicas' gradient all-reduces cross
links, and a link inside a host (NVLink, PCIe, a veth) is often ten or a
hundred times faster than one between hosts. The simulator charges each
boundary crossing a transfer time; this module says what that time is on a
described cluster:

    transfer = bytes ÷ (bandwidth × efficiency) + latency

per link (or the larger of the two, for a latency that passes while the
bytes flow: `Link.latency_overlaps`), and a ring all-reduce of B bytes over
R devices sends 2·(R−1)/R·B over its slowest link in 2·(R−1) hops. The
simulator takes the transfer time as a callable of the two devices, and, to
let transfers queue for a link, the part of it that holds the link (the
bytes' share):

    cluster = Cluster(num_hosts=8, devices_per_host=8,
                      inside=Link(1.2e12, 5e-6), between=Link(100e9, 10e-6))
    sizes = [0.0] + [boundary_bytes] * (K - 1)
    result = simulator.simulate(
        costs, M, transfer_time=cluster.transfer_time_fn(sizes),
        link_busy=cluster.link_busy_fn(sizes))

Device (task) i sits on host i // devices_per_host; a run of K stages × R
replicas puts stage s of replica r on task r·K + s (`processes.task_of`).

Why a queue: GPipe sends every micro-batch's activations as soon as it is
computed, so on a slow link they wait for each other; measured between
two hosts at 100 Mbit/s (benchmark.py links) they arrived one after
another, each a transfer time after the previous one, as one TCP
connection carries them in order. The latency overlaps (it is the
receiver's and sender's fixed cost, not the wire's).

What the model leaves out: links shared by other traffic (a boundary and
an all-reduce at once), and an all-reduce that overlaps the backward or
uses a host-aware (hierarchical) ring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from lingvo_pipe import errors

# TCP/IPv4 with timestamps on Ethernet frames of MTU 1500: 1448 payload bytes
# per 1514-byte frame as Linux traffic control counts it (no preamble/FCS).
TCP_ETHERNET_EFFICIENCY = 1448 / 1514


class LinkError(errors.LingvoPipeError):
  """A link or cluster described with impossible numbers."""


def _check(name: str, value: float, positive: bool = False) -> None:
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or
      math.isnan(value) or math.isinf(value) or value < 0 or
      (positive and value == 0)):
    raise LinkError(f'{name} = {value!r} must be a finite number '
                    f'{"> 0" if positive else "≥ 0"}.')


@dataclasses.dataclass(frozen=True)
class Link:
  """One way of a link: `bandwidth` in bits/s on the wire, `latency` in
  seconds per transfer, `efficiency` the payload's share of wire bytes.

  `latency_overlaps`: the latency is time the two ends spend while the
  bytes flow (thread hand-offs on hosts whose cores are busy computing), not
  after them, so a transfer takes max(wire, latency), not wire + latency.
  Stage processes of one core each between network-namespace hosts behave
  so: where the wire and the latency are about as long, adding them
  overpredicted steps (`benchmark.py links`, docs/benchmarks.md).
  """
  bandwidth: float
  latency: float = 0.0
  efficiency: float = 1.0
  latency_overlaps: bool = False

  def __post_init__(self) -> None:
    _check('Link.bandwidth', self.bandwidth, positive=True)
    _check('Link.latency', self.latency)
    _check('Link.efficiency', self.efficiency, positive=True)
    if self.efficiency > 1:
      raise LinkError(f'Link.efficiency = {self.efficiency!r} must be ≤ 1 '
                      '(payload bytes per wire byte).')

  def wire_time(self, nbytes: float) -> float:
    """Seconds `nbytes` of payload hold the link (latency left out)."""
    _check('nbytes', nbytes)
    return nbytes * 8 / (self.bandwidth * self.efficiency)

  def transfer_time(self, nbytes: float) -> float:
    """Seconds to move `nbytes` of payload across this link."""
    wire = self.wire_time(nbytes)
    if self.latency_overlaps:
      return max(wire, self.latency)
    return wire + self.latency

  def describe(self) -> str:
    """'100 Gbit/s, 10 µs' (payload efficiency if < 1)."""
    text = f'{format_rate(self.bandwidth)}, {self.latency * 1e6:.3g} µs'
    if self.efficiency < 1:
      text += f', {100 * self.efficiency:.1f}% payload'
    if self.latency_overlaps:
      text += ', latency beside the wire'
    return text


@dataclasses.dataclass(frozen=True)
class Cluster:
  """`num_hosts` hosts of `devices_per_host` devices each; devices of one
  host talk over `inside`, devices of two hosts over `between`.

  >>> c = Cluster(2, 2, inside=Link(8e9), between=Link(8e8, latency=1e-3))
  >>> c.transfer_time(1e6, 0, 1), c.transfer_time(1e6, 1, 2)
  (0.001, 0.011)
  """
  num_hosts: int
  devices_per_host: int
  inside: Link
  between: Link

  def __post_init__(self) -> None:
    for name in ('num_hosts', 'devices_per_host'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LinkError(f'Cluster.{name} = {value!r} must be an int ≥ 1.')

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.devices_per_host

  def host_of(self, device: int) -> int:
    if not 0 <= device < self.num_devices:
      raise LinkError(f'device {device} is not in this cluster of '
                      f'{self.num_devices} devices ({self.describe()}).')
    return device // self.devices_per_host

  def link(self, a: int, b: int) -> Link:
    """The link between devices `a` and `b`."""
    return self.inside if self.host_of(a) == self.host_of(b) else self.between

  def transfer_time(self, nbytes: float, a: int, b: int) -> float:
    """Seconds to move `nbytes` from device `a` to device `b` (0 if same)."""
    return 0.0 if a == b else self.link(a, b).transfer_time(nbytes)

  def all_reduce_time(self, nbytes: float, devices: Sequence[int]) -> float:
    """A ring all-reduce of `nbytes` over `devices` (in this order): each
    sends 2·(R−1)/R·nbytes in 2·(R−1) steps, paced by the ring's slowest
    link."""
    r = len(devices)
    if r <= 1:
      return 0.0
    links = [self.link(a, b) for a, b in zip(devices, list(devices[1:]) +
                                              [devices[0]])]
    slowest = min(links, key=lambda l: l.bandwidth * l.efficiency)
    latency = max(l.latency for l in links)
    share = 2 * (r - 1) / r * nbytes
    return share * 8 / (slowest.bandwidth * slowest.efficiency) + (
        2 * (r - 1) * latency)

  def transfer_time_fn(self, boundary_bytes: Sequence[float],
                       first_device: int = 0) -> Callable[[int, int], float]:
    """The simulator's `transfer_time` for one pipeline replica whose
    device d is cluster device `first_device` + d.

    Args:
      boundary_bytes: per pipeline device d, the bytes entering it per
        micro-batch (its input forward, the same gradient backward); entry
        0 is unused.
      first_device: the replica's stage 0 (r·K for replica r).
    """
    sizes = [float(b) for b in boundary_bytes]

    def hop(src: int, dst: int) -> float:
      return self.transfer_time(sizes[max(src, dst)], first_device + src,
                                first_device + dst)

    return hop

  def link_busy_fn(self, boundary_bytes: Sequence[float],
                   first_device: int = 0) -> Callable[[int, int], float]:
    """The simulator's `link_busy`: how long a transfer of
    `transfer_time_fn` holds its link, its latency left out."""
    sizes = [float(b) for b in boundary_bytes]

    def busy(src: int, dst: int) -> float:
      a, b = first_device + src, first_device + dst
      return 0.0 if a == b else self.link(a, b).wire_time(
          sizes[max(src, dst)])

    return busy

  def describe(self) -> str:
    return (f'{self.num_hosts} host(s) × {self.devices_per_host} device(s); '
            f'inside a host {self.inside.describe()}, between hosts '
            f'{self.between.describe()}')


def step_with_all_reduce(stage_ends: Sequence[float],
                         stage_param_bytes: Sequence[float], cluster: Cluster,
                         num_replicas: int) -> float:
  """A synchronous step of R replicas: each stage all-reduces its gradients
  over its R replicas (tasks s, K+s, …) once its last backward ends.

  Args:
    stage_ends: per stage, when its last op of the step ends (from the
      simulator's events).
    stage_param_bytes: per stage, its gradients' bytes.
    cluster: where the K·R tasks run (task i on device i).
    num_replicas: R.
  """
  k = len(stage_ends)
  return max(end + cluster.all_reduce_time(
      nbytes, [r * k + s for r in range(num_replicas)])
             for s, (end, nbytes) in enumerate(zip(stage_ends,
                                                   stage_param_bytes)))


def format_rate(rate: float) -> str:
  """'1 Gbit/s' for 1e9 bits/s."""
  for unit, scale in (('Tbit/s', 1e12), ('Gbit/s', 1e9), ('Mbit/s', 1e6),
                      ('kbit/s', 1e3)):
    if rate >= scale:
      return f'{rate / scale:.4g} {unit}'
  return f'{rate:.4g} bit/s'
