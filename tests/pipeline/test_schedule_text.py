"""Schedules as text: written, read back, refused with the grid marked, run.

A user who wants another schedule writes its rows (`p.schedule` takes the
text or a file); the validator refuses, before any op runs, a schedule that
would deadlock, misses or repeats an action, or separates an R from its
B — one line naming the device and the action, then the grid with the
action marked. A written schedule trains like the unpipelined model.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from lingvo_pipe.core import gpipe
from lingvo_pipe.pipeline import schedule
from lingvo_pipe.pipeline import schedule_text
from lingvo_pipe.pipeline import transparency
from lingvo_pipe.pipeline.schedule import Schedule, ScheduleError

import pipeline_stacks as stacks  # pylint: disable=g-bad-import-order

# 1F1B at K=2, M=4 with one more warm-up forward on device 0 than usual.
WARM = """\
# 1F1B, device 0 warms up with 3 forwards
device 0: F0 F1 F2 R0 B0 F3 R1 B1 R2 B2 R3 B3
device 1: F0 R0 B0 F1 R1 B1 F2 R2 B2 F3 R3 B3
"""


@pytest.mark.parametrize('name,k,m,recompute', [
    ('gpipe', 3, 4, 'always'), ('1f1b', 4, 8, 'needed'),
    ('interleaved', 2, 4, 'never'), ('1f1b', 1, 3, 'except_last')])
def test_every_builtin_schedule_reads_back_as_written(name, k, m, recompute):
  sched = schedule.make_schedule(name, k, m, recompute,
                                 2 if name == 'interleaved' else 1)
  again = Schedule.from_text(sched.to_text())
  assert again.actions == sched.actions
  assert again.stage_devices == sched.stage_devices
  assert again.num_micro_batches == m


def test_text_is_one_row_per_device():
  text = schedule.one_f_one_b_schedule(2, 2, 'never').to_text()
  assert text.splitlines()[1:] == ['device 0: F0 F1 B0 B1',
                                   'device 1: F0 B0 F1 B1']
  # Devices that hold several stages name each action's stage.
  inter = schedule.interleaved_schedule(2, 2, 'never').to_text()
  assert inter.splitlines()[1].startswith('device 0: F0@0 F1@0 F0@2')


def _refused(text: str) -> str:
  with pytest.raises(ScheduleError) as e:
    Schedule.from_text(text)
  return str(e.value)


def test_a_deadlock_is_refused_with_the_action_marked():
  message = _refused('device 0: F0 F1 R0 B0 R1 B1\n'
                     'device 1: R0 B0 F0 F1 R1 B1')
  first, *grid = message.splitlines()
  assert first == ("Schedule 'custom', device 1: R0@1 waits for F0@1, which "
                   'device 1 runs after it: the schedule deadlocks.')
  assert grid == ['  device 0: F0 F1 R0 B0 R1 B1',
                  '  device 1: [R0] B0 F0 F1 R1 B1   <-- here']


def test_a_deadlock_across_devices_is_refused():
  # Each device waits on the other: device 0 wants B1's gradient before it
  # runs F1, device 1 needs F1 first.
  message = _refused('device 0: F0 R1 B1 F1 R0 B0\n'
                     'device 1: F0 F1 R1 B1 R0 B0')
  assert 'deadlocks' in message and '[R1]' in message, message


@pytest.mark.parametrize('text, first_line', [
    ('device 0: F0 F1 R1 B1\ndevice 1: F0 F1 R1 B1 R0 B0',
     "Schedule 'custom', device 0: stage 0 lacks B0"),
    ('device 0: F0 R0 B0 B0\ndevice 1: F0 R0 B0',
     "Schedule 'custom', device 0: B0@0 is repeated"),
    ('device 0: F0 R0 F1 B0 R1 B1\ndevice 1: F0 R0 B0 F1 R1 B1',
     "Schedule 'custom', device 0: R0@0 must directly precede its B or I"),
    ('device 0: F0 B0 X1\ndevice 1: F0 B0', "'X1' is not an action"),
    ('device 0: F0 SEND_F0 B0\ndevice 1: F0 B0',
     'transfers are inserted by the engine'),
    ('device 0: F0 B0\ndevice 2: F0 B0', 'devices [0, 2]'),
    ('first: F0 B0', 'is not a row'),
])
def test_bad_schedules_are_refused_in_one_line(text, first_line):
  message = _refused(text)
  assert first_line in message.splitlines()[0], message


def test_a_missing_action_shows_the_grid():
  message = _refused('device 0: F0 F1 R1 B1\n'
                     'device 1: F0 F1 R1 B1 R0 B0')
  assert message.splitlines()[1:] == ['  device 0: F0 F1 R1 B1',
                                      '  device 1: F0 F1 R1 B1 R0 B0']


def _net(schedule_spec, **kw):
  kw = dict(dict(num_stages=2, num_micro_batches=4), **kw)
  return stacks.net('nested', schedule=schedule_spec, **kw)


@pytest.mark.parametrize('kw, message', [
    ({'num_micro_batches': 8}, 'runs 4 micro-batches but the pipeline '
     'splits the batch into 8; set num_micro_batches=4'),
    ({'recompute': 'never'}, "recompute='never' with a written schedule"),
    ({'num_stages': 4}, 'has 2 device rows but the pipeline has '
     'num_stages=4'),
])
def test_a_written_schedule_must_fit_the_pipeline(kw, message):
  with pytest.raises(ValueError, match=message):
    net, inputs = _net(WARM, **kw)
    net.FPropLoss(net.theta, inputs, stacks.loss_labels('nested'),
                  stacks.weighted_loss)


def test_a_schedule_name_that_is_neither_is_refused():
  with pytest.raises(ValueError, match=r"schedule='zigzag'; use one of"):
    _net('zigzag')


@pytest.mark.parametrize('from_file', [False, True])
def test_a_written_schedule_trains_like_the_unpipelined_model(tmp_path,
                                                              from_file):
  spec = WARM
  if from_file:
    spec = str(tmp_path / 'warm.schedule')
    with open(spec, 'w') as f:
      f.write(WARM)
  net, inputs = _net(spec)
  assert net.plan.schedule(4).actions == Schedule.from_text(WARM).actions
  got = tf.function(lambda: stacks.pipelined_loss(
      net, inputs, stacks.loss_labels('nested')))()
  want, want64 = stacks.loss_reference('nested', 4)
  for i in range(3):  # Loss, gradients, statistics.
    d = transparency.discrepancy(got[i], want[i], want64[i])
    assert d.ok(), d


def test_inspect_prints_the_grid():
  net, _ = _net(WARM)
  text = net.Inspect()
  assert 'schedule=written (text)' in text
  assert 'device 0: F0 F1 F2 R0 B0 F3 R1 B1 R2 B2 R3 B3' in text


def test_load_checks_against_the_pipeline(tmp_path):
  path = tmp_path / 's.txt'
  path.write_text(WARM)
  sched = schedule_text.load(str(path), 2, 4)
  assert sched.name == 's.txt'
  with pytest.raises(ScheduleError, match='has 2 device rows'):
    schedule_text.load(str(path), 3, 4)
