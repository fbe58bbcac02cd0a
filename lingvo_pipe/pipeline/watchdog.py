"""Notices a dead or unreachable peer and ends this process naming it.

A stage process whose neighbour died, or whose host can no longer be
reached, cannot go on: its collectives would wait for ever (they carry no
TF timeout: collective.py says why), and TF aborts every collective of the
process after the first failure anyway. Nothing is saved by lingering, and
a run resumes from its last checkpoint. So a thread probes every peer about
once a second with TF's own health RPC (`check_collective_ops_peer_health`,
as MultiWorkerMirroredStrategy does), and ends the process when a peer

- refuses or resets the connection `refusals` times in a row (its process
  ended while its host still answers): within about a second;
- answers as a new process (it restarted): at once;
- has not answered for `unreachable_s` (a network partition: packets
  vanish silently, every probe waits out its `probe_timeout_s`).

It then writes one line, which states how long the peer has been silent
and when this process ends, so the deadline it states is the real one:

    lingvo_pipe: error: task 0: peer task 1 at h2:2222 is unreachable: no
    answer for 10.8 s (limit 10 s); exiting with status 75 in 3 s. ...

and leaves with `os._exit(75)` (EX_TEMPFAIL: retrying may work), which
cannot hang in TF's shutdown or in a blocked step. Before it exits it waits
`grace_s`, its own server still answering, so that every other task finds
the task that really failed, not this one: among the peers that fail, the
line names the one silent longest (a partitioned host's peers all name it,
though one of them may have left by then), and a host that can reach none
of its peers says that its own link may be down.

A brief outage (a "blip") that drops packets silently is ridden out: TCP
resends them once the link heals, the step goes on, and the silence stays
under `unreachable_s`. One that fails a collective is not: TF aborts every
collective of the process after one fails, so the process must restart.

The main thread asks too (`exit_if_peer_dead`) when a step raises, because a
step talking to a dead task fails before the next probe.

It also ends a task that stops making progress while every peer answers (a
peer stuck, or tasks that disagree on the model and wait on collectives
the others never build): the trainer calls `expect_step()` after each
step, and a step that does not finish within the peers' `timeout_s`
(`--collective_timeout_secs`; the first step, which traces, gets
`FIRST_STEP_FACTOR` times as long) ends the process with one line.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context

from lingvo_pipe import errors
from lingvo_pipe.pipeline import collective

EXIT_PEER_GONE = 75  # EX_TEMPFAIL: restart the run.
FIRST_STEP_FACTOR = 6  # The first step traces: minutes for a deep pipeline.
_ACTIVE: list['Watchdog'] = []  # This process's started watchdog.
_FAST_FAILURES = ('connection refused', 'socket closed', 'connection reset')


class PeerUnreachableError(errors.LingvoPipeError):
  """Peers that did not answer at start-up; the binaries exit 75."""
  exit_status = EXIT_PEER_GONE


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


@dataclasses.dataclass
class _Peer:
  """What the probes found out about one peer."""
  heard: float  # time.monotonic() of its last answer (or of the watch start).
  failure: str = ''  # Why the last probe failed; '' if it answered.
  refusals: int = 0  # Probes refused or reset in a row.
  restarted: bool = False


class Watchdog:
  """Probes every peer of `peers` from a daemon thread."""

  def __init__(self, peers: collective.Peers, interval_s: float = 1.0,
               unreachable_s: float = 10.0, probe_timeout_s: float = 2.0,
               refusals: int = 3, grace_s: float = 3.0) -> None:
    """Args:
      peers: this task and its peers.
      interval_s: seconds between two rounds of probes.
      unreachable_s: a peer silent this long is gone.
      probe_timeout_s: how long one probe waits for an answer.
      refusals: refused probes in a row that make a peer gone.
      grace_s: seconds to stay up after the verdict (see module docstring).
    """
    self._peers = peers
    self._interval_s = interval_s
    self._unreachable_s = unreachable_s
    self._probe_timeout_s = min(probe_timeout_s, unreachable_s)
    self._refusals = refusals
    self._grace_s = grace_s
    self._stop = threading.Event()
    self._verdict = threading.Lock()
    self._state = threading.Lock()
    self._thread: threading.Thread | None = None
    self._deadline: tuple[float, float] | None = None  # (limit_s, until)
    now = time.monotonic()
    self._seen = {t: _Peer(now) for t in self._others()}

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
      return 'no answer'
    except tf.errors.UnavailableError as e:
      text = str(e).lower()
      return next((n for n in _FAST_FAILURES if n in text), 'unreachable')

  def _check(self, task: int, timeout_s: float | None = None) -> bool:
    """Probes `task` once and records the result; True if it answered.

    A silent peer's probe waits at most until its silence reaches
    `unreachable_s`, so the verdict comes when the limit is reached, not a
    probe later."""
    if timeout_s is None:
      left = self._seen[task].heard + self._unreachable_s - time.monotonic()
      timeout_s = min(self._probe_timeout_s, max(0.1, left))
    reason = self.probe(task, timeout_s)
    with self._state:
      peer = self._seen[task]
      if reason is None:
        self._seen[task] = _Peer(time.monotonic())
        return True
      peer.failure = reason
      peer.refusals = peer.refusals + 1 if reason in _FAST_FAILURES else 0
      peer.restarted = reason.startswith('it restarted')
    return False

  def wait_until_up(self, timeout_s: float) -> list[int]:
    """Waits until every peer answers; returns those that never did."""
    deadline = time.monotonic() + timeout_s
    missing = self._others()
    while missing:
      left = deadline - time.monotonic()
      missing = [t for t in missing
                 if not self._check(t, max(0.1, min(2.0, left)))]
      if not missing or time.monotonic() >= deadline:
        break
      time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
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
    """Probes every peer until each answers (then returns) or one is gone
    (then ends the process): within `unreachable_s`."""
    del cause  # The line names the failed task; its own error is a symptom.
    failing = self._others()
    while failing:
      failing = [t for t in failing if not self._check(t)]
      self._judge()
      if failing:
        time.sleep(min(0.5, self._interval_s))

  def _run(self) -> None:
    pause = self._interval_s
    while not self._stop.wait(pause):
      answered = True
      for task in self._others():
        answered = self._check(task) and answered
        if self._stop.is_set():
          return
        self._judge()
      # A failing peer is probed again soon: its verdict is due on time.
      pause = self._interval_s if answered else min(0.25, self._interval_s)
      deadline = self._deadline
      if (deadline and time.monotonic() > deadline[1]
          and not self._stop.is_set()):
        self._stuck(deadline[0])

  def _judge(self) -> None:
    """Ends the process if a peer is gone (see the module docstring)."""
    now = time.monotonic()
    with self._state:
      failing = {t: p for t, p in self._seen.items() if p.failure}
      gone = [t for t, p in failing.items() if p.restarted or
              p.refusals >= self._refusals or
              now - p.heard >= self._unreachable_s]
      if not gone:
        return
      line = self._line(failing, gone, now)
    self._give_up(line)

  def _line(self, failing: dict[int, _Peer], gone: list[int],
            now: float) -> str:
    """The one line: the peer silent longest first, and what else failed."""
    def what(t: int) -> str:
      p = failing[t]
      if p.failure == 'no answer' or p.failure == 'unreachable':
        return (f'no answer for {now - p.heard:.1f} s (limit '
                f'{self._unreachable_s:g} s)')
      return p.failure
    describe = self._peers.describe
    me = f'task {self._peers.task}'
    order = sorted(failing, key=lambda t: failing[t].heard)
    if len(order) > 1 and len(order) == len(self._seen) and all(
        what(t).startswith('no answer') for t in order):
      head = (f'{me}: every peer is unreachable: ' + ', '.join(
          f'{describe(t)} ({what(t)})' for t in order) + '; this host\'s '
          'own network link may be down')
    else:
      first = order[0]
      verb = 'is unreachable' if what(first).startswith('no') else 'is gone'
      head = f'{me}: peer {describe(first)} {verb}: {what(first)}'
      also = [f'{describe(t)}: {what(t)}' for t in order[1:] if t in gone]
      if also:
        head += f' (also gone: {"; ".join(also)})'
    return (f'lingvo_pipe: error: {head}; exiting with status '
            f'{EXIT_PEER_GONE} in {self._grace_s:g} s. Restart the run: it '
            'resumes from its last checkpoint.\n')

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

  def _give_up(self, line: str) -> None:
    """Writes the line, waits `grace_s`, exits. Only the first caller
    writes; a second one (main thread and watchdog both) just waits."""
    if not self._verdict.acquire(blocking=False):
      time.sleep(10 * self._grace_s + 60)  # The first caller exits us.
      os._exit(EXIT_PEER_GONE)  # pylint: disable=protected-access
    os.write(2, line.encode())
    time.sleep(self._grace_s)
    os._exit(EXIT_PEER_GONE)  # pylint: disable=protected-access
