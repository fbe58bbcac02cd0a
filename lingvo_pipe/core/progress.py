"""The trainer's progress line: step, loss, examples per second, ETA.

    step 120/2000  loss 0.4213  1530 examples/s  ETA 00:03:12

logged every `PROGRESS_SECS` seconds of training; the first step, which
traces the step function, is not timed.
"""

from __future__ import annotations

import time

from absl import logging

PROGRESS_SECS = 5.0


class Rate:
  """Examples per second since the previous call (the first step, which
  includes tracing the step function, is not timed)."""

  def __init__(self, batch_size: int) -> None:
    self._batch = batch_size
    self._mark: tuple[float, int] | None = None

  def examples_per_sec(self, step: int) -> float:
    now = time.monotonic()
    if self._mark is None or now <= self._mark[0] or step <= self._mark[1]:
      rate = 0.0
    else:
      rate = (step - self._mark[1]) * self._batch / (now - self._mark[0])
    self._mark = (now, step)
    return rate


class Progress:
  """A console line every few seconds: step, loss, examples/s, ETA."""

  def __init__(self, max_steps: int, batch_size: int) -> None:
    self._max = max_steps
    self._rate = Rate(batch_size)
    self._steps_per_sec = 0.0
    self._batch = batch_size
    self._step, self._loss = 0, float('nan')
    self._last_log: float | None = None
    self._first: tuple[float, int] = (0.0, 0)

  def update(self, step: int, loss: float) -> None:
    self._step, self._loss = step, loss
    now = time.monotonic()
    if self._last_log is None:  # First step: starts the clock.
      self._rate.examples_per_sec(step)
      self._last_log, self._first = now, (now, step)
      self.log()
    elif now - self._last_log >= PROGRESS_SECS:
      self._steps_per_sec = self._rate.examples_per_sec(step) / self._batch
      self._last_log = now
      self.log()

  def log(self, overall: bool = False) -> None:
    """Logs the progress line; `overall`: the rate since the first step."""
    elapsed = time.monotonic() - self._first[0]
    if overall and elapsed > 0 and self._step > self._first[1]:
      self._steps_per_sec = (self._step - self._first[1]) / elapsed
    left = self._max - self._step
    eta = (time.strftime('%H:%M:%S', time.gmtime(left / self._steps_per_sec))
           if self._steps_per_sec > 0 else '?')
    logging.info('step %d/%d  loss %.5g  %.0f examples/s  ETA %s',
                 self._step, self._max, self._loss,
                 self._steps_per_sec * self._batch, eta)
