"""The benchmark suite: the project's targets, measured side by side here.

    python tools/benchmark.py all                 # the full report (quiet machine)
    python tools/benchmark.py efficiency          # one section
    python tools/benchmark.py all --tiny          # smoke test, a few minutes

Sub-commands (sections.py), one per topic: stage processes and data
parallelism (efficiency, overlap, table1, peer, slices); schedules and
their cost (schedules, fidelity, partition, overheads, tracing, timeline);
the backward split into I and W and the zero-bubble schedules (split,
zero_bubble); Keras models (keras: a wrapped Keras CNN vs the same network
in lingvo_pipe layers); several hosts (links: K=2 over rate-limited links
between hosts made of network namespaces, as root; the simulator at scale
on paper); mt_timeline (a translation step on 2 stage processes,
--timeline_steps merged); training (the translation and language models'
60-minute runs and test scores: four hours, so `all` leaves it out).
Each writes its section into docs/benchmarks.json and re-renders
docs/benchmarks.md (plus PNGs) from it. `all` runs each sub-command in its own child process,
so the allocator and TF runtime of one section cannot leak into the next;
speed and memory come from stage processes that each section starts
(stage_procs.py), one per stage and replica, pinned to cores.

Every process this tool starts (children, stage processes) is stopped by
PID, also on SIGTERM / Ctrl-C. Run the full suite on a quiet machine: each
section records the load average before and after it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# The memory section reads TF's allocator statistics, which TF's default CPU
# allocator keeps only when oneDNN is on (Intel CPUs with AVX-512/AMX, where
# TF turns it on itself). The BFC allocator keeps them on every CPU: set it
# before TensorFlow starts, in this process and (inherited) in its children.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import sections  # pylint: disable=g-import-not-at-top

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='benchmark.py', description=__doc__.split('\n\n')[0])
  parser.add_argument('command', choices=list(sections.NAMES) + ['all'])
  parser.add_argument('--tiny', action='store_true', help='Tiny sizes, one '
                      'repetition: checks the machinery in seconds; the '
                      'numbers mean nothing.')
  parser.add_argument('--reps', type=int, default=0, help='Timed (or '
                      'recorded) repetitions per configuration (0 = the '
                      'section\'s default).')
  parser.add_argument('--rounds', type=int, default=0, help='Independent '
                      'runs of the sections that repeat themselves '
                      '(efficiency, fidelity; 0 = 3, or 1 with --tiny).')
  parser.add_argument('--runs_dir', default=os.path.join(
      tempfile.gettempdir(), 'lingvo_pipe_training'), help='training: the '
                      'runs\' logdirs; a finished one is scored, not trained '
                      'again.')
  parser.add_argument('--runs', default='', help='training: the runs to '
                      'train and score, e.g. mt_k2,mt_one (default: all); '
                      'the stored rows of the others stay.')
  parser.add_argument('--out_dir', default=os.path.join(_ROOT, 'docs'),
                      help='Where benchmarks.json/.md and the PNGs go.')
  return parser


def _command(argv: list[str]) -> str:
  return 'python tools/benchmark.py ' + ' '.join(argv)


def _stop(child: subprocess.Popen[bytes]) -> None:
  """SIGTERM (the child then stops its workers), SIGKILL if it hangs."""
  if child.poll() is not None:
    return
  child.terminate()
  try:
    child.wait(timeout=60)
  except subprocess.TimeoutExpired:
    child.kill()
    child.wait()


def _run_all(args: argparse.Namespace, argv: list[str]) -> int:
  """Each section in a child process; then the header of the whole run."""
  start = time.time()
  rest = argv[1:]
  for name in sections.NAMES:
    if name in sections.NOT_IN_ALL:
      continue
    cmd = [sys.executable, os.path.abspath(__file__), name] + rest
    child = subprocess.Popen(cmd)
    try:
      rc = child.wait()
    finally:
      _stop(child)
    if rc:
      print(f'benchmark.py: section {name!r} failed (exit {rc}).',
            file=sys.stderr)
      return rc
  sections.finish(args.out_dir, _command(argv), time.time() - start)
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args = parser.parse_args(argv)
  if args.runs:
    if args.command != 'training':
      parser.error(f'--runs={args.runs}: only the training section has '
                   'runs; drop the flag.')
    try:
      sections.training.selected(args.runs)
    except ValueError as e:
      parser.error(str(e))
  if args.command == 'all':
    return _run_all(args, argv)
  start, load = time.time(), os.getloadavg()[0]
  section: dict[str, Any] = sections.run_section(args)
  sections.store(args.out_dir, args.command, section, _command(argv),
                 time.time() - start, args, (load, os.getloadavg()[0]))
  return 0


if __name__ == '__main__':
  # SIGTERM unwinds like Ctrl-C, so `with` blocks stop the worker processes.
  signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
  sys.exit(main())
