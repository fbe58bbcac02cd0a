"""The benchmark suite: GPipe's tables, measured side by side on this machine.

    python tools/benchmark.py all                 # the full report (~5 min, 2 cores)
    python tools/benchmark.py throughput          # one section
    python tools/benchmark.py all --tiny          # smoke test, seconds

Sub-commands: throughput (GPipe Table 2), memory (Table 1), overheads,
fidelity (simulator vs measurement), timeline (docs/timeline_k2_m4.png).
Each writes its section into docs/benchmarks.json and re-renders
docs/benchmarks.md (plus PNGs) from it. `all` runs each sub-command in its
own child process: worker clusters, logical-device set-ups and allocators
of one section cannot leak into the next.

Every process this tool starts (children, TF workers) is stopped by PID,
also on SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
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
  parser.add_argument('--devices', choices=('workers', 'logical'),
                      default=None, help='Stage devices of the timed '
                      'sections: single-core TF worker processes (default) '
                      'or logical CPU devices of this process (default with '
                      '--tiny).')
  parser.add_argument('--reps', type=int, default=0, help='Timed '
                      'repetitions per configuration (0 = the section\'s '
                      'default).')
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
  args = _parser().parse_args(argv)
  if args.devices is None:
    args.devices = 'logical' if args.tiny else 'workers'
  if args.command == 'all':
    return _run_all(args, argv)
  start = time.time()
  section: dict[str, Any] = sections.run_section(args)
  sections.store(args.out_dir, args.command, section, _command(argv),
                 time.time() - start, args)
  return 0


if __name__ == '__main__':
  # SIGTERM unwinds like Ctrl-C, so `with` blocks stop the worker processes.
  signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
  sys.exit(main())
