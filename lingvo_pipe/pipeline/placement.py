"""Which of a pipeline's devices this process runs, and who runs the others.

One engine serves one process and many: in one process every device of the
pipeline is local (logical CPUs, GPUs); in a run of R replicas × K stage
processes, task i runs device i mod K of replica i // K, and a stage
boundary between two processes is a collective send/recv (`collective.py`).

    placement = Placement.current(num_devices=K)   # after processes.start
    placement.is_local(d)    # emit device d's ops here?
    placement.task(d)        # which task runs device d of this replica

The process's peers are registered once, at start-up, with `use(peers)`;
until then (and in every single-process program) they are
`collective.Peers.local()`.
"""

from __future__ import annotations

import dataclasses

from lingvo_pipe.pipeline import collective

_PEERS = [collective.Peers.local()]


class PlacementError(ValueError):
  """A cluster whose size does not fit the pipeline; names the fix."""


def use(peers: collective.Peers) -> None:
  """Registers this process's peers (processes.start's) for every pipeline."""
  _PEERS[0] = peers


def peers() -> collective.Peers:
  return _PEERS[0]


@dataclasses.dataclass(frozen=True)
class Placement:
  """K pipeline devices × R replicas over the run's tasks."""
  peers: collective.Peers
  num_devices: int
  num_replicas: int = 1

  @classmethod
  def current(cls, num_devices: int, where: str = 'pipeline') -> 'Placement':
    """The placement of a K-device pipeline in this process's run."""
    tasks = _PEERS[0].num_tasks
    if tasks == 1:  # One process runs every device.
      return cls(_PEERS[0], num_devices, 1)
    if tasks % num_devices:
      raise PlacementError(
          f'{where}: {num_devices} pipeline stages cannot share a run of '
          f'{tasks} processes: start num_stages × num_replicas processes '
          f'(e.g. {num_devices} or {2 * num_devices}).')
    return cls(_PEERS[0], num_devices, tasks // num_devices)

  @property
  def multi_process(self) -> bool:
    return self.peers.num_tasks > 1

  @property
  def device(self) -> int | None:
    """The pipeline device this process runs; None: every one."""
    return self.peers.task % self.num_devices if self.multi_process else None

  @property
  def replica(self) -> int:
    return self.peers.task // self.num_devices

  def is_local(self, device: int) -> bool:
    return not self.multi_process or device == self.device

  def task(self, device: int) -> int:
    """The task that runs `device` of this process's replica."""
    return self.replica * self.num_devices + device

  def replica_tasks(self) -> list[int]:
    """The tasks that hold this process's device in every replica."""
    return [r * self.num_devices + (self.device or 0)
            for r in range(self.num_replicas)]

  def all_tasks(self) -> list[int]:
    return list(range(self.peers.num_tasks))
