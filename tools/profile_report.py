"""Per task, what the trainer's `--profile_steps` trace shows, as text.

    python tools/profile_report.py LOGDIR [--top 12]

reads each task's latest trace (LOGDIR/profile/task<i>/plugins/profile/
<time>/*.xplane.pb, TensorFlow's XSpace) and prints, per task:

* the traced steps: the step function's runs, and their median time;
* busy: the part of a step in which at least one kernel ran on the task's
  inter-op threads (the rest waited: on another stage, a transfer, or the
  host), and overlap: kernel time ÷ busy time (above 1, kernels shared a
  core);
* per op type, its time and count per step (the top ones);
* the collectives (sends, receives, all-reduces): count and median time
  per step; a receive's time includes its wait for the sender.

For the whole picture (threads, flame charts) use TensorBoard's Profile tab.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
from typing import Any, Iterable, Sequence

from tensorflow.tsl.profiler.protobuf import xplane_pb2

from lingvo_pipe.core import step_profile

# Kernel events are 'name:Type'; the runtime's own are 'Class::method'.
_KERNEL = re.compile(r'^[^:]+:(?P<type>[A-Za-z_0-9]+)$')
_STEP = re.compile(r'^EagerLocalExecute: __inference_(?P<fn>.+)_\d+$')
_COLLECTIVE = ('CollectiveBcastSendV2', 'CollectiveBcastRecvV2',
               'CollectiveReduceV2', 'CollectiveGatherV2')
_MS = 1e9  # Picoseconds per millisecond.


def _events(path: str) -> Iterable[tuple[str, str, int, int]]:
  """(thread, event name, start, end) in picoseconds, host plane only."""
  space = xplane_pb2.XSpace()
  with open(path, 'rb') as f:
    space.ParseFromString(f.read())
  for plane in space.planes:
    if not plane.name.startswith('/host:'):
      continue
    for line in plane.lines:
      for e in line.events:
        start = line.timestamp_ns * 1000 + e.offset_ps
        yield (line.name, plane.event_metadata[e.metadata_id].name, start,
               start + e.duration_ps)


def _union(spans: Sequence[tuple[int, int]]) -> int:
  total, end = 0, None
  for s, e in sorted(spans):
    if end is None or s > end:
      total, end = total + e - s, e
    elif e > end:
      total, end = total + e - end, e
  return total


def summarize(path: str) -> dict[str, Any] | None:
  """The step function, its runs, and per step: busy, overlap, op types
  and collectives; None if no step function ran while traced."""
  runs: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
  kernels: list[tuple[str, int, int]] = []
  for thread, name, start, end in _events(path):
    step = _STEP.match(name)
    if step:
      runs[step['fn']].append((start, end))
    kernel = _KERNEL.match(name)
    if kernel and (thread.startswith('tf_Compute') or
                   kernel['type'] in _COLLECTIVE):
      kernels.append((kernel['type'], start, end))
  if not runs:
    return None
  fn, steps = max(runs.items(), key=lambda kv: sum(e - s for s, e in kv[1]))
  inside = [(t, s, e) for t, s, e in kernels
            if any(a <= s < b for a, b in steps)]
  compute = [(s, e) for t, s, e in inside if t not in _COLLECTIVE]
  busy = _union(compute)
  by_type: dict[str, list[int]] = collections.defaultdict(list)
  for t, s, e in inside:
    by_type[t].append(e - s)
  return {'function': fn, 'steps_ms': [(e - s) / _MS for s, e in steps],
          'busy': busy / max(1, sum(e - s for s, e in steps)),
          'overlap': sum(e - s for s, e in compute) / max(1, busy),
          'types': by_type}


def render(name: str, s: dict[str, Any], top: int) -> str:
  n = len(s['steps_ms'])
  lines = [f'{name}: {s["function"]}, {n} step(s) traced, median '
           f'{statistics.median(s["steps_ms"]):.1f} ms; busy '
           f'{100 * s["busy"]:.0f}% of the step, overlap {s["overlap"]:.2f}']
  ranked = sorted(s['types'].items(), key=lambda kv: -sum(kv[1]))
  compute = [kv for kv in ranked if kv[0] not in _COLLECTIVE][:top]
  lines.append('  op type                          ms/step  count/step')
  lines += [f'  {t:32s} {sum(d) / n / _MS:7.2f}  {len(d) / n:10.1f}'
            for t, d in compute]
  collectives = [kv for kv in ranked if kv[0] in _COLLECTIVE]
  if collectives:
    lines.append('  collective                   count/step  median ms')
    lines += [f'  {t:28s} {len(d) / n:10.1f}  '
              f'{statistics.median(d) / _MS:9.2f}' for t, d in collectives]
  return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('logdir')
  parser.add_argument('--top', type=int, default=12,
                      help='Op types listed per task.')
  args = parser.parse_args(argv)
  found = step_profile.latest_traces(args.logdir)
  if not found:
    where = os.path.join(args.logdir, step_profile.PROFILE_DIR)
    print(f'profile_report: no trace under {where}; train with '
          '--profile_steps=FIRST,LAST first.', file=sys.stderr)
    return 2
  for name, path in found.items():
    summary = summarize(path)
    if summary is None:
      print(f'profile_report: {path} holds no run of a step function; '
            'trace whole steps (--profile_steps=FIRST,LAST).',
            file=sys.stderr)
      return 2
    print(render(name, summary, args.top))
  return 0


if __name__ == '__main__':
  sys.exit(main())
