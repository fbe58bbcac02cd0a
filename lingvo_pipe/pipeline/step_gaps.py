"""Where a recorded step's time goes between its ops, and the schedule
replayed with it.

The simulator charges each op its duration and nothing else. On stage
processes a step also waits between ops: for the executor to pick and start
the next op (dispatch), and for a value to arrive from another process
(hand-off). `gaps` measures both in a recorded step (`timeline` records),
from the reads the schedule declares and where it places each stage, so a
V placement (zb_v) or several stages per device are counted right.
`predicted_with_gaps` replays the schedule with the step's own op durations
and mean gaps: what still differs from the measured span is waiting the
schedule does not explain (an op run out of order, a value stuck behind
compute).

    recs = timeline.normalized(records)
    sched = schedule.make_schedule('zb_v', 2, 8, 'never')
    g = step_gaps.gaps(recs, sched)       # g.mean_dispatch, g.mean_handoff
    step_gaps.predicted_with_gaps(recs, sched).step_time
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, NamedTuple

from lingvo_pipe.pipeline import actions
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import timeline

__all__ = ['Gaps', 'gaps', 'predicted_with_gaps']

# An op "ended before" the next started: their stamps can tie or cross by
# this much (two timestamp ops waiting for one tensor run in either order).
_SLACK_S = 1e-4


class Gaps(NamedTuple):
  """A recorded step's delays between ops, in seconds (see `gaps`)."""
  dispatch: list[float]  # Ops that waited last for their own device.
  handoff: list[float]  # Ops that waited last for another device's value.
  # Every op that reads a value made on another device, from the later of
  # its device's free time and its reads' making: what a transfer and its
  # dispatch cost the pipeline (the efficiency, overlap and fidelity
  # sections' hand-off gap).
  crossing: list[float]

  @property
  def mean_dispatch(self) -> float:
    return statistics.mean(self.dispatch) if self.dispatch else 0.0

  @property
  def mean_handoff(self) -> float:
    return statistics.mean(self.handoff) if self.handoff else 0.0


def gaps(records: Iterable[Any], schedule: actions.Schedule) -> Gaps:
  """Each recorded op's delay from "could start" to its start.

  An op could start once the ops its device ran before it had ended and
  what it reads (as `schedule` declares) was made. An op that waited last
  for a value made on another device gives a hand-off gap (from the
  value's making: the transfer and the op's dispatch); any other op a
  dispatch gap. A device's first op, with nothing before it and nothing to
  read, has none. An op that starts while its device's previous op still
  runs (several inter-op threads) waits for the ops that had ended.

  Raises:
    TimelineError: a record that is not an action of `schedule` (give the
      schedule, M and recompute policy the step ran).
  """
  recs = timeline.normalized(records)
  compute = schedule.compute()
  for r in recs:
    if not compute.has(r.kind, r.stage, r.micro_batch):
      raise timeline.TimelineError(
          f'Record {tuple(r)!r} is no action of schedule {schedule.name!r} '
          f'(M={schedule.num_micro_batches}, recompute={schedule.recompute}'
          '); give the schedule the step ran.')
  made = {(r.kind, r.micro_batch, r.stage): r.end for r in recs}
  out = Gaps([], [], [])
  for d in range(compute.num_devices):
    mine = [r for r in recs if compute.device_of(r.stage) == d]
    for i, r in enumerate(mine):
      reads = [(pd, made[tuple(a)]) for pd, a in compute.dependencies(
          d, actions.Action(r.kind, r.micro_batch, r.stage))
               if tuple(a) in made]
      local = [end for pd, end in reads if pd == d]
      local += [o.end for o in mine[:i] if o.end <= r.start + _SLACK_S]
      remote = [end for pd, end in reads if pd != d]
      if remote:
        out.crossing.append(max(0.0, r.start - max(local + remote)))
      if remote and (not local or max(remote) >= max(local)):
        out.handoff.append(max(0.0, r.start - max(remote)))
      elif local:
        out.dispatch.append(max(0.0, r.start - max(local)))
  return out


def predicted_with_gaps(records: Iterable[Any],
                        schedule: actions.Schedule) -> simulator.SimResult:
  """The simulator on `schedule` from the step's median op durations, each
  + the mean dispatch gap, and each transfer between devices taking the
  mean hand-off gap less that dispatch (a hand-off gap holds its op's
  dispatch, which the op's duration now carries).

  A device's first op gets a dispatch too, which the records do not show:
  the prediction of a step without other waiting is its span + about one
  dispatch gap.
  """
  recs = timeline.normalized(records)
  g = gaps(recs, schedule)
  transfer = max(0.0, g.mean_handoff - g.mean_dispatch)
  return simulator.simulate(
      timeline.calibrated_costs(recs, g.mean_dispatch),
      schedule.num_micro_batches, schedule.recompute, schedule,
      transfer_time=lambda src, dst: 0.0 if src == dst else transfer)
