"""A recorded step's dispatch and hand-off gaps, and its replay with them."""

import pytest

from lingvo_pipe.pipeline import schedule as schedule_lib
from lingvo_pipe.pipeline import simulator
from lingvo_pipe.pipeline import step_gaps
from lingvo_pipe.pipeline import timeline

# GPipe, K=2, M=1, recompute never (seconds): F(1) starts 0.5 s after F(0)
# ends (a hand-off), B(1) 0.2 s after its own F (dispatch), B(0) 0.3 s
# after B(1) (a hand-off).
_GPIPE = [(0, 0, 'F', 0.0, 1.0), (1, 0, 'F', 1.5, 2.5),
          (1, 0, 'B', 2.7, 3.7), (0, 0, 'B', 4.0, 5.0)]


def _gpipe(m: int = 1) -> schedule_lib.Schedule:
  return schedule_lib.make_schedule('gpipe', 2, m, 'never')


def test_dispatch_and_handoff_gaps():
  gaps = step_gaps.gaps(_GPIPE, _gpipe())
  assert gaps.dispatch == [pytest.approx(0.2)]
  assert sorted(gaps.handoff) == [pytest.approx(0.3), pytest.approx(0.5)]
  assert sorted(gaps.crossing) == [pytest.approx(0.3), pytest.approx(0.5)]
  assert gaps.mean_handoff == pytest.approx(0.4)


def test_prediction_with_gaps_replays_the_step():
  """Ops 1 + 0.2 s (dispatch), transfers 0.4 − 0.2 s (the hand-offs' mean
  less the dispatch their op now carries): the span, 5.0 s, + the first
  op's dispatch, which no record shows."""
  assert step_gaps.predicted_with_gaps(_GPIPE, _gpipe()).step_time == (
      pytest.approx(5.0 + 0.2))
  # From op durations alone the simulator gives the ops' 4 s.
  assert simulator.simulate(timeline.calibrated_costs(_GPIPE), 1, 'never',
                            _gpipe()).step_time == pytest.approx(4.0)


def test_a_value_that_arrived_before_the_device_was_free_is_dispatch():
  """F(1, 1) reads F(0, 1) (ended 2.0), but its device was busy until 2.5:
  it waited last for its own device, a dispatch gap of 0.1; as a crossing
  it counts from 2.5 too."""
  recs = [(0, 0, 'F', 0.0, 1.0), (0, 1, 'F', 1.0, 2.0),
          (1, 0, 'F', 1.5, 2.5), (1, 1, 'F', 2.6, 3.6)]
  gaps = step_gaps.gaps(recs, _gpipe(2).compute())
  assert gaps.handoff == [pytest.approx(0.5)]  # F(1, 0) only.
  assert gaps.dispatch == [pytest.approx(0.0), pytest.approx(0.1)]
  assert sorted(gaps.crossing) == [pytest.approx(0.1), pytest.approx(0.5)]


def test_an_op_overlapping_its_devices_previous_op_keeps_its_handoff():
  """With two inter-op threads B(0, 0) can start while B(0, 1) still runs:
  it waited for its gradient from stage 1 (ended 5.8), not for B(0, 1)."""
  recs = [(0, 0, 'F', 0.0, 1.0), (0, 1, 'F', 1.0, 2.0),
          (1, 0, 'F', 1.5, 2.5), (1, 1, 'F', 2.5, 3.5),
          (1, 1, 'B', 3.5, 4.5), (1, 0, 'B', 4.5, 5.8),
          (0, 1, 'B', 5.2, 8.0), (0, 0, 'B', 6.3, 7.0)]
  gaps = step_gaps.gaps(recs, _gpipe(2))
  # F(1, 0) 0.5 after F(0, 0); B(0, 1) 0.7 after B(1, 1); B(0, 0) 0.5.
  assert sorted(gaps.handoff) == [pytest.approx(0.5), pytest.approx(0.5),
                                  pytest.approx(0.7)]


def test_gaps_follow_the_v_placement():
  """zb_v, K=2, M=1 holds stages 0 and 3 on process 0 and 1 and 2 on
  process 1: F1, F3, I2 and I0 wait for the other process (hand-offs); F2,
  I1, I3 and the four Ws for their own (round-robin would make F2 and I1
  hand-offs too)."""
  sched = schedule_lib.make_schedule('zb_v', 2, 1, 'never')
  sim = simulator.simulate([simulator.StageCost(forward=1.0, backward=2.0)] *
                           4, 1, 'never', sched)
  gaps = step_gaps.gaps([tuple(e) for e in sim.events], sched)
  assert len(gaps.handoff) == 4
  assert len(gaps.dispatch) == 7
  assert max(gaps.handoff + gaps.dispatch) == pytest.approx(0.0)


def test_a_record_the_schedule_does_not_have_is_refused():
  with pytest.raises(timeline.TimelineError, match="no action of schedule"):
    step_gaps.gaps(_GPIPE + [(0, 0, 'R', 3.0, 3.5)], _gpipe())
