"""Notices a dead peer and ends this process with one line that names it.

A stage process whose neighbour died cannot go on: its collectives would
wait out their timeout, and TF aborts every collective of the process after
the first failure anyway. Nothing is saved by lingering, and a run resumes
from its last checkpoint. So a thread probes every peer about once a second
with TF's own health RPC (`check_collective_ops_peer_health`, as
MultiWorkerMirroredStrategy does); when one stays unreachable (or came back
as a new process) for a few probes, it writes

    lingvo_pipe: error: task 0: peer task 2 at 10.0.0.3:2222 is gone
    (connection refused); exiting with status 75 ...

and leaves with `os._exit(75)` (EX_TEMPFAIL: retrying may work), which
cannot hang in TF's shutdown or in a blocked step. Before it exits it waits
`grace_s`, its own server still answering, so that every other task's probe
finds the task that really died, not this one: each names the same task.

The main thread asks too (`exit_if_peer_dead`) when a step raises, because a
step talking to the dead task fails before the next probe.

It also ends a task that stops making progress while every peer answers (a
peer stuck, or tasks that disagree on the model and wait on collectives
the others never build): the in-step collectives carry no TF timeout
(collective.py says why), so the trainer calls `expect_step()` after each
step, and a step that does not finish within the peers' `timeout_s`
(`--collective_timeout_secs`; the first step, which traces, gets
`FIRST_STEP_FACTOR` times as long) ends the process with one line.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context

from lingvo_pipe.pipeline import collective

EXIT_PEER_GONE = 75  # EX_TEMPFAIL: restart the run.
FIRST_STEP_FACTOR = 6  # The first step traces: minutes for a deep pipeline.
_ACTIVE: list['Watchdog'] = []  # This process's started watchdog.


def expect_step(first: bool = False) -> None:
  """The next step must finish within the peers' timeout (× FIRST_STEP_
  FACTOR if `first`), or the running watchdog ends this process. A no-op
  without one (a single process)."""
  for watch in _ACTIVE:
    watch.set_deadline(watch.peers_timeout_s * (FIRST_STEP_FACTOR if first
                                                  else 1))


def no_step_expected() -> None:
  """Disarms the step deadline (after the last step)."""
  for watch in _ACTIVE:
    watch.set_deadline(None)


class Watchdog:
  """Probes every peer of `peers` from a daemon thread."""

  def __init__(self, peers: collective.Peers, interval_s: float = 1.0,
               probe_timeout_s: float = 10.0, retries: int = 3,
               grace_s: float = 3.0) -> None:
    """Args:
      peers: this task and its peers.
      interval_s: seconds between two rounds of probes.
      probe_timeout_s: a peer that does not answer in this long is down.
      retries: probes a peer must fail in a row before it counts as gone.
      grace_s: seconds to stay up after the verdict (see module docstring).
    """
    self._peers = peers
    self._interval_s = interval_s
    self._probe_timeout_s = probe_timeout_s
    self._retries = retries
    self._grace_s = grace_s
    self._stop = threading.Event()
    self._verdict = threading.Lock()
    self._thread: threading.Thread | None = None
    self._deadline: tuple[float, float] | None = None  # (limit_s, until)

  @property
  def peers_timeout_s(self) -> float:
    return self._peers.timeout_s

  def set_deadline(self, limit_s: float | None) -> None:
    """Ends the process unless this is called again within `limit_s`
    seconds (None: never)."""
    self._deadline = (None if limit_s is None else
                      (limit_s, time.monotonic() + limit_s))

  def _others(self) -> list[int]:
    return [t for t in range(self._peers.num_tasks) if t != self._peers.task]

  def probe(self, task: int, timeout_s: float) -> str | None:
    """None if `task` answers within `timeout_s`, else why not."""
    name = f'/job:{self._peers.job}/replica:0/task:{task}'
    try:
      context.context().check_collective_ops_peer_health(
          name, timeout_in_ms=max(1, int(timeout_s * 1000)))
      return None
    except tf.errors.FailedPreconditionError:
      return 'it restarted: a new process answers at its address'
    except tf.errors.DeadlineExceededError:
      return f'no answer within {timeout_s:g} s'
    except tf.errors.UnavailableError as e:
      text = str(e).lower()
      for needle in ('connection refused', 'socket closed',
                     'connection reset'):
        if needle in text:
          return needle
      return 'unreachable'

  def wait_until_up(self, timeout_s: float) -> list[int]:
    """Waits until every peer answers; returns those that never did."""
    deadline = time.monotonic() + timeout_s
    missing = self._others()
    while missing:
      missing = [t for t in missing if self.probe(t, 2.0) is not None]
      if not missing or time.monotonic() > deadline:
        break
      time.sleep(0.25)
    return missing

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name='lingvo_pipe_'
                                    'watchdog', daemon=True)
    self._thread.start()
    _ACTIVE.append(self)

  def stop(self) -> None:
    """Stops probing (before a clean exit, when peers may leave first)."""
    self._stop.set()
    if self in _ACTIVE:
      _ACTIVE.remove(self)
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def exit_if_peer_dead(self, cause: Any = None) -> None:
    """Probes every peer now; ends the process if one is gone.

    Returns only if all peers answer.
    """
    del cause  # The line names the dead task; its own error is a symptom.
    for task in self._others():
      reason = self._probe_repeatedly(task)
      if reason:
        self._give_up(task, reason)

  def _probe_repeatedly(self, task: int) -> str | None:
    reason = None
    for attempt in range(self._retries):
      reason = self.probe(task, self._probe_timeout_s)
      if reason is None:
        return None
      if attempt + 1 < self._retries:
        time.sleep(min(0.5, self._interval_s))
    return reason

  def _run(self) -> None:
    while not self._stop.wait(self._interval_s):
      for task in self._others():
        reason = self._probe_repeatedly(task)
        if reason and not self._stop.is_set():
          self._give_up(task, reason)
      deadline = self._deadline
      if (deadline and time.monotonic() > deadline[1]
          and not self._stop.is_set()):
        self._stuck(deadline[0])

  def _stuck(self, limit_s: float) -> None:
    """Every peer answers, but no step finished within `limit_s`."""
    if not self._verdict.acquire(blocking=False):
      return  # Another verdict is ending the process.
    os.write(2, (
        f'lingvo_pipe: error: task {self._peers.task}: no step finished '
        f'within {limit_s:g} s though every peer answers: a task is stuck, '
        'or the tasks disagree on the model, flags or data and wait on '
        'transfers the others never make (compare their params.txt); '
        f'exiting with status {EXIT_PEER_GONE}. A step that is only slow '
        'needs a larger --collective_timeout_secs.\n').encode())
    os._exit(EXIT_PEER_GONE)  # pylint: disable=protected-access

  def _give_up(self, task: int, reason: str) -> None:
    """Writes the one line, waits `grace_s`, exits. Only the first caller
    writes; a second one (main thread and watchdog both) just waits."""
    if not self._verdict.acquire(blocking=False):
      time.sleep(10 * self._grace_s + 60)  # The first caller exits us.
      os._exit(EXIT_PEER_GONE)  # pylint: disable=protected-access
    line = (f'lingvo_pipe: error: task {self._peers.task}: peer '
            f'{self._peers.describe(task)} is gone ({reason}); exiting with '
            f'status {EXIT_PEER_GONE}. Restart the run: it resumes from its '
            'last checkpoint.\n')
    os.write(2, line.encode())
    time.sleep(self._grace_s)
    os._exit(EXIT_PEER_GONE)  # pylint: disable=protected-access
