"""SIGTERM and Ctrl-C in the binaries: a clean, explained stop at any moment.

A binary starts slowly (TensorFlow's import, building the model, reading the
data, tracing), and a scheduler may stop it at any point. Python's default
for SIGTERM kills the process without a word, so the binaries install
`exit_on_signals` before anything slow: it prints one line and exits with
status 128 + signal number (143 for SIGTERM), running `finally` blocks and
atexit handlers on the way (a half-written file is removed, worker
processes are stopped).

Once the trainer trains, `stop_after_step` takes over: the first signal
only sets `stop_reason`, which the training loop reads after each step and
again after each save, so the run stops with a checkpoint of the step it
was on (and a signal that arrives during a save stops right after that
save, not a step later); a second signal stops at once.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from absl import logging

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What a stop means, per binary (the end of its one line).
STARTUP = 'stopped during start-up, before the first step; run again to start'
EVALER = 'stopped; every score written so far is kept, run again to continue'


def exit_on_signals(program: str, stopped: str) -> None:
  """SIGTERM/SIGINT: print `<program>: <SIGNAL> received; <stopped>`, exit.

  Args:
    program: 'trainer' or 'evaler', the first word of the line.
    stopped: What the stop means for the user, e.g. 'stopped during
      start-up, before the first step; run again to start'.
  """

  def _handler(signum: int, _: Any) -> None:
    name = signal.Signals(signum).name
    sys.stderr.flush()
    sys.stderr.write(f'{program}: {name} received; {stopped}.\n')
    sys.stderr.flush()
    raise SystemExit(128 + signum)

  for signum in _SIGNALS:
    signal.signal(signum, _handler)


def stop_after_step(run: Any) -> None:
  """First signal: sets `run.stop_reason` (the loop stops after the step
  with a checkpoint); second signal: exits at once, status 128 + signum."""

  def _handler(signum: int, _: Any) -> None:
    if run.stop_reason:  # The second signal: stop without a checkpoint.
      raise SystemExit(128 + signum)
    run.stop_reason = f'{signal.Signals(signum).name} received'
    logging.info('%s: stopping after this step with a checkpoint (send it '
                 'again to stop at once).', run.stop_reason)

  for signum in _SIGNALS:
    signal.signal(signum, _handler)
