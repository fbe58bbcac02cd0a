"""Pipeline schedules as data: which op each stage runs, in which order.

A schedule is a list with one entry per stage: the ordered list of `Op`s that
stage's device runs in one training step. Keeping it as plain data lets the
same object drive the engine, the simulator (`simulator.py`) and the tests,
which check it as a picture: under unit op costs, GPipe's forward pass is the
fill-drain diagonal "stage k runs micro-batch m at tick k + m".

Op kinds, for micro-batch m on stage k:

  F  forward. Needs F of (k-1, m): the stage's input activations.
  R  recompute: re-runs the forward to rebuild the activations that F threw
     away. With recompute, the backward of a micro-batch is R then B on that
     stage. R starts when the gradient of (k+1, m) has arrived, as in the
     engine, so at most one micro-batch's activations are alive per stage.
  B  backward. Needs B of (k+1, m) (the output gradient) or, on the last
     stage, its own F (the loss).

Recompute policies: 'always' (R on every stage), 'except_last' (no R on the
last stage: its backward follows its forward closely, so keeping activations
there is cheap in time), 'never' (no R; every stage keeps activations of all
micro-batches in flight).

>>> [str(op) for op in gpipe_schedule(2, 2, 'never')[0]]
['F0', 'F1', 'B1', 'B0']
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from lingvo_pipe import errors

__all__ = [
    'Op', 'RECOMPUTE_POLICIES', 'SCHEDULES', 'Schedule', 'ScheduleError',
    'check_schedule', 'clock_cycles', 'dependencies', 'gpipe_schedule',
    'make_schedule', 'one_f_one_b_schedule', 'run_times',
]

RECOMPUTE_POLICIES = ('always', 'except_last', 'never')
SCHEDULES = ('gpipe', '1f1b')


class ScheduleError(errors.LingvoPipeError):
  """A schedule that is malformed, or that cannot run to completion."""


class Op(NamedTuple):
  """One unit of work on a stage: kind 'F', 'R' or 'B' of one micro-batch."""
  kind: str
  micro_batch: int

  def __str__(self) -> str:
    return f'{self.kind}{self.micro_batch}'


Schedule = list[list[Op]]


def _check(num_stages: int, num_micro_batches: int, recompute: str) -> None:
  for name, value in (('num_stages', num_stages),
                      ('num_micro_batches', num_micro_batches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ScheduleError(f'{name} must be an int ≥ 1, got {value!r}.')
  if recompute not in RECOMPUTE_POLICIES:
    raise ScheduleError(f'recompute={recompute!r} is not one of '
                        f'{RECOMPUTE_POLICIES}.')


def _recomputes(stage: int, num_stages: int, recompute: str) -> bool:
  return recompute == 'always' or (recompute == 'except_last' and
                                   stage < num_stages - 1)


def _backward(stage: int, m: int, num_stages: int, recompute: str) -> list[Op]:
  if _recomputes(stage, num_stages, recompute):
    return [Op('R', m), Op('B', m)]
  return [Op('B', m)]


def gpipe_schedule(num_stages: int, num_micro_batches: int,
                   recompute: str = 'always') -> Schedule:
  """GPipe fill-drain: all forwards in order, then backwards in reverse.

  This is the order the engine emits. Stage k runs F0 .. F(M-1), then
  [R(M-1)] B(M-1) .. [R0] B0.
  """
  _check(num_stages, num_micro_batches, recompute)
  out = []
  for k in range(num_stages):
    ops = [Op('F', m) for m in range(num_micro_batches)]
    for m in reversed(range(num_micro_batches)):
      ops += _backward(k, m, num_stages, recompute)
    out.append(ops)
  return out


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int,
                         recompute: str = 'always') -> Schedule:
  """PipeDream-Flush (1F1B): the same step time as GPipe, less memory.

  Stage k warms up with min(K-k-1, M) forwards, then alternates one forward
  and one backward, then cools down with the remaining backwards. A stage
  holds at most K-k micro-batches in flight instead of M.
  """
  _check(num_stages, num_micro_batches, recompute)
  out = []
  for k in range(num_stages):
    warmup = min(num_stages - k - 1, num_micro_batches)
    ops = [Op('F', m) for m in range(warmup)]
    for m in range(num_micro_batches - warmup):
      ops.append(Op('F', m + warmup))
      ops += _backward(k, m, num_stages, recompute)
    for m in range(num_micro_batches - warmup, num_micro_batches):
      ops += _backward(k, m, num_stages, recompute)
    out.append(ops)
  return out


def make_schedule(name: str, num_stages: int, num_micro_batches: int,
                  recompute: str = 'always') -> Schedule:
  """The schedule called `name` ('gpipe' or '1f1b')."""
  if name == 'gpipe':
    return gpipe_schedule(num_stages, num_micro_batches, recompute)
  if name == '1f1b':
    return one_f_one_b_schedule(num_stages, num_micro_batches, recompute)
  raise ScheduleError(f'schedule={name!r} is not one of {SCHEDULES}.')


def dependencies(schedule: Sequence[Sequence[Op]], stage: int,
                 op: Op) -> list[tuple[int, Op]]:
  """The (stage, op) pairs that must finish before `op` starts on `stage`."""
  recomputes = any(o.kind == 'R' for o in schedule[stage])
  return _dependencies(stage, op, len(schedule), recomputes)


def _dependencies(k: int, op: Op, num_stages: int,
                  recomputes: bool) -> list[tuple[int, Op]]:
  m = op.micro_batch
  if op.kind == 'F':
    return [(k - 1, Op('F', m))] if k > 0 else []
  # The output gradient; on the last stage, the loss from its own F.
  upstream = [(k + 1, Op('B', m))] if k < num_stages - 1 else []
  if op.kind == 'R':
    return [(k, Op('F', m))] + upstream
  return [(k, Op('R', m) if recomputes else Op('F', m))] + upstream


def check_schedule(schedule: Sequence[Sequence[Op]]) -> int:
  """Checks that every stage runs F and B of each micro-batch exactly once.

  R, where present on a stage, must also appear exactly once per micro-batch.

  Returns:
    The number of micro-batches M.

  Raises:
    ScheduleError: naming the stage and the missing or extra ops.
  """
  if not schedule:
    raise ScheduleError('The schedule has no stages; give one op list per '
                        'stage, e.g. gpipe_schedule(num_stages, M).')
  num_micro_batches = sum(op.kind == 'F' for op in schedule[0])
  want = {Op(kind, m) for kind in 'FB' for m in range(num_micro_batches)}
  for k, ops in enumerate(schedule):
    bad = [str(op) for op in ops if op.kind not in 'FRB' or len(op.kind) != 1]
    if bad:
      raise ScheduleError(f'Stage {k} has ops of unknown kind {bad}; kinds '
                          'are F, R and B.')
    expected = want | ({Op('R', m) for m in range(num_micro_batches)}
                       if any(op.kind == 'R' for op in ops) else set())
    if len(ops) != len(set(ops)) or set(ops) != expected:
      missing = sorted(str(op) for op in expected - set(ops))
      extra = sorted({str(op) for op in ops if ops.count(op) > 1} |
                     {str(op) for op in set(ops) - expected})
      raise ScheduleError(
          f'Stage {k} must run F and B (and R, if any) of micro-batches '
          f'0..{num_micro_batches - 1} exactly once; missing {missing}, '
          f'repeated or unexpected {extra}.')
  return num_micro_batches


def run_times(schedule: Sequence[Sequence[Op]],
              op_time: Callable[[int, Op], float],
              transfer_time: float = 0.0) -> list[list[tuple[float, float]]]:
  """(start, end) of every op when each stage runs its list in order.

  An op starts once its stage is free and its dependencies are done; a
  dependency on another stage also pays `transfer_time` (activations or
  gradients crossing devices).

  Args:
    schedule: ops per stage, e.g. from `gpipe_schedule`.
    op_time: duration of `op` on `stage`.
    transfer_time: per micro-batch stage-to-stage transfer time.

  Returns:
    Same shape as `schedule`: the (start, end) of each op.

  Raises:
    ScheduleError: a malformed schedule (`check_schedule`), or stages that
      wait on each other forever (the message lists the stuck ops).
  """
  check_schedule(schedule)
  num_stages = len(schedule)
  recomputes = [any(op.kind == 'R' for op in ops) for ops in schedule]
  done: dict[tuple[int, Op], float] = {}
  times: list[list[tuple[float, float]]] = [[] for _ in schedule]
  free = [0.0] * num_stages
  while True:
    progressed = False
    for k, ops in enumerate(schedule):
      while len(times[k]) < len(ops):
        op = ops[len(times[k])]
        deps = _dependencies(k, op, num_stages, recomputes[k])
        if any(d not in done for d in deps):
          break
        start = max([free[k]] + [
            done[(s, d)] + (transfer_time if s != k else 0.0)
            for s, d in deps])
        end = start + op_time(k, op)
        times[k].append((start, end))
        done[(k, op)] = free[k] = end
        progressed = True
    if all(len(t) == len(ops) for t, ops in zip(times, schedule)):
      return times
    if not progressed:
      stuck = [f'stage {k}: {ops[len(times[k])]}'
               for k, ops in enumerate(schedule) if len(times[k]) < len(ops)]
      raise ScheduleError('The schedule cannot finish; these ops wait on '
                          f'ops that never run first: {", ".join(stuck)}.')


def clock_cycles(schedule: Sequence[Sequence[Op]]) -> list[list[int]]:
  """The tick each op starts at when every op takes one tick.

  >>> clock_cycles(gpipe_schedule(2, 2, 'never'))
  [[0, 1, 4, 5], [1, 2, 3, 4]]
  """
  times = run_times(schedule, lambda k, op: 1.0)
  return [[int(start) for start, _ in stage] for stage in times]
