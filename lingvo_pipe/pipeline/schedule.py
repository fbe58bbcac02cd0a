"""The schedules: which actions each device runs in one step, in order.

A schedule is data (`actions.Schedule`: one action list per device, with
the stage → device map), and the one object drives the engine, the
simulator, the memory model and the tests, which check it as a picture:
under unit costs, GPipe's forward pass is the fill-drain diagonal "device
k runs micro-batch m at tick k + m".

Built-in schedules, by name (`make_schedule`):

  gpipe        all forwards, then all backwards (M micro-batches of
               activations per stage).
  1f1b         PipeDream-flush: device k holds at most K−k micro-batches.
  interleaved  Megatron's virtual stages: device d holds chunks c = 0..v−1,
               stages c·K + d; the bubble shrinks by v.
  zb_h1        zero bubble (`zero_bubble.py`): 1F1B with each backward
               split into I (input gradient) and W (weight gradients), W
               filling the cool-down; a third of 1F1B's bubble.
  zb_v         zero bubble over 2K stages in a V (device d holds stages d
               and 2K−1−d); a sixth of 1F1B's bubble, 1F1B's memory.

Or any schedule written as text (`schedule_text.py`): one row per device,
e.g. "device 0: F0 F1 R0 B0 R1 B1".

Recompute policies ('always', 'needed', 'except_last', 'never') decide
which micro-batches have R actions. 'needed' is 'always' less each R that
would directly follow its own F on the device (the last micro-batch of
GPipe on every stage, every micro-batch of 1F1B's last stage): nothing runs
between the two, so keeping that forward's activations holds no more memory
than rebuilding them at once, and the R is only extra time on the critical
path (torchgpipe's 'except_last' skips the last micro-batch's checkpoint for
the same reason). `Schedule.rebuilds(stage, m)` says which have an R.

>>> [a.label(False) for a in gpipe_schedule(2, 2, 'never')[0]]
['F0', 'F1', 'B1', 'B0']
"""

from __future__ import annotations

import os
from typing import Sequence

from lingvo_pipe.pipeline.actions import (Action, Schedule, ScheduleError,
                                          clock_cycles, emission_order,
                                          run_times)

__all__ = [
    'Action', 'RECOMPUTE_POLICIES', 'SCHEDULES', 'Schedule', 'ScheduleError',
    'check_schedule', 'clock_cycles', 'emission_order', 'gpipe_schedule',
    'chunks_of', 'interleaved_schedule', 'make_schedule',
    'one_f_one_b_schedule', 'recomputes', 'run_times', 'splits_backward',
    'stage_devices',
]

RECOMPUTE_POLICIES = ('always', 'needed', 'except_last', 'never')
SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zb_h1', 'zb_v')


def _check(num_stages: int, num_micro_batches: int, recompute: str) -> None:
  for name, value in (('num_stages', num_stages),
                      ('num_micro_batches', num_micro_batches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ScheduleError(f'{name} must be an int ≥ 1, got {value!r}.')
  if recompute not in RECOMPUTE_POLICIES:
    raise ScheduleError(f'recompute={recompute!r} is not one of '
                        f'{RECOMPUTE_POLICIES}.')


def recomputes(stage: int, num_stages: int, recompute: str) -> bool:
  """Whether the policy `recompute` rebuilds `stage`'s activations (before
  'needed' drops the R that would directly follow its F)."""
  return recompute in ('always', 'needed') or (
      recompute == 'except_last' and stage < num_stages - 1)


def backward(stage: int, num_stages: int, recompute: str,
             m: int) -> list[Action]:
  """[R, B] of (stage, m) if the policy recomputes the stage, else [B]."""
  if recomputes(stage, num_stages, recompute):
    return [Action('R', m, stage), Action('B', m, stage)]
  return [Action('B', m, stage)]


def _without_adjacent_r(ops: list[Action]) -> list[Action]:
  """`ops` less each R that directly follows its own F ('needed')."""
  out: list[Action] = []
  for a in ops:
    if not (a.kind == 'R' and out and
            out[-1] == Action('F', a.micro_batch, a.stage)):
      out.append(a)
  return out


def build(name: str, ops: list[list[Action]], num_micro_batches: int,
          recompute: str, stage_devices: Sequence[int]) -> Schedule:
  """A Schedule from per-device lists (the 'needed' policy applied)."""
  if recompute == 'needed':
    ops = [_without_adjacent_r(o) for o in ops]
  return Schedule(name, tuple(tuple(o) for o in ops), num_micro_batches,
                  recompute, tuple(stage_devices))


def gpipe_schedule(num_stages: int, num_micro_batches: int,
                   recompute: str = 'always') -> Schedule:
  """GPipe fill-drain: all forwards in order, then backwards in reverse.

  Stage k runs F0 .. F(M-1), then [R(M-1)] B(M-1) .. [R0] B0; every
  stage holds all M micro-batches in flight.
  """
  _check(num_stages, num_micro_batches, recompute)
  out = []
  for k in range(num_stages):
    ops = [Action('F', m, k) for m in range(num_micro_batches)]
    for m in reversed(range(num_micro_batches)):
      ops += backward(k, num_stages, recompute, m)
    out.append(ops)
  return build('gpipe', out, num_micro_batches, recompute, range(num_stages))


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int,
                         recompute: str = 'always') -> Schedule:
  """PipeDream-flush (1F1B): the same step time as GPipe, less memory.

  Stage k warms up with min(K-k-1, M) forwards, then alternates one forward
  and one backward, then drains the remaining backwards; one synchronous
  update follows the step, as in GPipe. A stage holds at most K-k
  micro-batches in flight instead of M.
  """
  _check(num_stages, num_micro_batches, recompute)
  out = []
  for k in range(num_stages):
    warmup = min(num_stages - k - 1, num_micro_batches)
    ops = [Action('F', m, k) for m in range(warmup)]
    for m in range(num_micro_batches - warmup):
      ops.append(Action('F', m + warmup, k))
      ops += backward(k, num_stages, recompute, m)
    for m in range(num_micro_batches - warmup, num_micro_batches):
      ops += backward(k, num_stages, recompute, m)
    out.append(ops)
  return build('1f1b', out, num_micro_batches, recompute, range(num_stages))


def interleaved_schedule(num_devices: int, num_micro_batches: int,
                         recompute: str = 'always',
                         num_chunks: int = 2) -> Schedule:
  """Interleaved 1F1B (Megatron-LM): v chunks per device, bubble ÷ v.

  Device d holds stages d, d+K, …, d+(v-1)·K. Forwards go in groups of K
  micro-batches per chunk (chunk 0 of micro-batches 0..K-1, then chunk 1
  of the same, …); device d warms up with 2·(K-d-1) + (v-1)·K forwards,
  then alternates one forward and one backward (backwards visit the chunks
  in reverse), then drains. M must be a multiple of K.
  """
  _check(num_devices, num_micro_batches, recompute)
  if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or (
      num_chunks < 1):
    raise ScheduleError(f'num_chunks must be an int ≥ 1, got {num_chunks!r}.')
  k, m_total, v = num_devices, num_micro_batches, num_chunks
  if m_total % k:
    raise ScheduleError(
        f'The interleaved schedule needs num_micro_batches to be a multiple '
        f'of the {k} devices, got {m_total}; use e.g. num_micro_batches='
        f'{k * max(1, round(m_total / k))}.')
  total = m_total * v

  def _pick(d: int, i: int, backward_pass: bool) -> tuple[int, int]:
    chunk = (i // k) % v
    chunk = v - 1 - chunk if backward_pass else chunk
    return (i // (k * v)) * k + i % k, chunk * k + d

  out = []
  for d in range(k):
    warmup = min((k - d - 1) * 2 + (v - 1) * k, total)
    ops = [Action('F', *_pick(d, i, False)) for i in range(warmup)]
    for i in range(total):
      if warmup + i < total:
        ops.append(Action('F', *_pick(d, warmup + i, False)))
      m, s = _pick(d, i, True)
      ops += backward(s, k * v, recompute, m)
    out.append(ops)
  return build('interleaved', out, num_micro_batches, recompute,
               [s % k for s in range(k * v)])


def stage_devices(name: str, num_devices: int,
                  num_chunks: int = 1) -> tuple[int, ...]:
  """Where each stage of the built-in schedule `name` runs: zb_v's V
  (`zero_bubble.v_stage_devices`; it always has 2 chunks), else stage s on
  device s mod K (a written schedule says so itself)."""
  if name == 'zb_v':
    from lingvo_pipe.pipeline import zero_bubble  # pylint: disable=C0415
    return zero_bubble.v_stage_devices(num_devices)
  return tuple(s % num_devices for s in range(num_devices * num_chunks))


def chunks_of(name: str, num_chunks: int = 1) -> int:
  """Stages per device of the built-in schedule `name` (`num_chunks`, the
  interleaved schedule's v, applies to it alone)."""
  return {'interleaved': num_chunks, 'zb_v': 2}.get(name, 1)


def is_text(spec: str) -> bool:
  """Whether `p.schedule` is a schedule's text or a file holding one
  (else it names a built-in schedule)."""
  return isinstance(spec, str) and spec not in SCHEDULES and (
      '\n' in spec or ':' in spec or os.path.isfile(spec))


def splits_backward(spec: 'str | Schedule') -> bool:
  """Whether `p.schedule` (a name, a schedule's text or file, or a
  Schedule) splits a backward into I and W. Text that does not parse is
  False here: `make_schedule` reports it."""
  if isinstance(spec, Schedule):
    return any(a.kind == 'I' for ops in spec.actions for a in ops)
  if spec in ('zb_h1', 'zb_v'):
    return True
  if not is_text(spec):
    return False
  from lingvo_pipe.pipeline import schedule_text  # pylint: disable=C0415
  try:
    return splits_backward(schedule_text.read(spec))
  except ScheduleError:
    return False


def make_schedule(name: str, num_stages: int, num_micro_batches: int,
                  recompute: str = 'always', num_chunks: int = 1) -> Schedule:
  """The schedule called `name`, or written in `name` (text or a file).

  `num_stages` counts devices; `num_chunks` (virtual stages per device)
  applies to 'interleaved' only (zb_v always has two). A written schedule carries its own
  recompute actions and micro-batches: it must have `num_stages` devices
  and `num_micro_batches` micro-batches.
  """
  if name == 'gpipe':
    return gpipe_schedule(num_stages, num_micro_batches, recompute)
  if name == '1f1b':
    return one_f_one_b_schedule(num_stages, num_micro_batches, recompute)
  if name == 'interleaved':
    return interleaved_schedule(num_stages, num_micro_batches, recompute,
                                num_chunks)
  if name in ('zb_h1', 'zb_v'):
    from lingvo_pipe.pipeline import zero_bubble  # pylint: disable=C0415
    build_zb = zero_bubble.zb_h1 if name == 'zb_h1' else zero_bubble.zb_v
    return build_zb(num_stages, num_micro_batches, recompute)
  if is_text(name):
    from lingvo_pipe.pipeline import schedule_text  # pylint: disable=C0415
    return schedule_text.load(name, num_stages, num_micro_batches)
  raise ScheduleError(f'schedule={name!r} is not one of {SCHEDULES}, nor a '
                      'schedule\'s text (rows such as "device 0: F0 F1 B1 B0") '
                      'or a file holding one.')


def check_schedule(schedule: Schedule) -> int:
  """Checks that every stage runs F and B (or I and W) of each micro-batch
  exactly once, R at most once, on the stage's device.

  Returns:
    The number of micro-batches M.

  Raises:
    ScheduleError: naming the device and the missing or extra actions.
  """
  from lingvo_pipe.pipeline import schedule_text  # pylint: disable=C0415
  return schedule_text.check_actions(schedule)


def dependencies(schedule: Schedule, device: int,
                 action: Action) -> list[tuple[int, Action]]:
  """The (device, action) pairs that make what `action` reads."""
  return schedule.dependencies(device, action)

