"""--timeline_steps warms each chosen step's function up on a step of the
same batch shapes: a first run of a shape pays one-off costs that would
show in the picture as longer ops."""

from absl import logging

from lingvo_pipe.core import step_timeline


def _cycle(shapes):
  """Step (from 1) → shapes, repeating `shapes`; counts the questions."""
  asked = []

  def signature(step):
    asked.append(step)
    return shapes[(step - 1) % len(shapes)]

  return signature, asked


def test_one_shape_warms_with_the_step_before():
  assert step_timeline.warm_up_steps({5, 10}, 1, None) == {4, 9}
  # The run's first step has nothing before it, even after a restart.
  assert step_timeline.warm_up_steps({1}, 1, None) == set()
  assert step_timeline.warm_up_steps({7}, 7, None) == set()
  assert step_timeline.warm_up_steps({8}, 7, None) == {7}


def test_buckets_warm_with_the_latest_step_of_the_same_shapes():
  # The translation task's order: steps 3 and 8 have the longest bucket.
  order = ['128x32', '96x48', '64x64', '128x32', '96x48', '128x32', '96x48',
           '64x64']
  signature, _ = _cycle(order)
  assert step_timeline.warm_up_steps({8}, 1, signature) == {3}
  assert step_timeline.warm_up_steps({7}, 1, signature) == {5}
  assert step_timeline.warm_up_steps({6}, 1, signature) == {4}
  # Started at step 4 (a resume): step 3 did not run here.
  assert step_timeline.warm_up_steps({8}, 4, signature) == set()


def test_a_shape_not_seen_before_runs_cold_and_says_so(monkeypatch):
  said = []
  monkeypatch.setattr(logging, 'warning',
                      lambda msg, *args: said.append(msg % args))
  signature, asked = _cycle(['a'] * 30 + ['b'])
  assert step_timeline.warm_up_steps({31}, 1, signature, search=4) == set()
  assert len(said) == 1
  assert 'step 31' in said[0] and 'from 27 to 30' in said[0]
  assert sorted(set(asked)) == [27, 28, 29, 30, 31]  # No further back.
