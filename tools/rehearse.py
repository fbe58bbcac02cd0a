"""Rehearses a cluster on one machine: README's recipe on hosts h1 … hN.

    sudo python tools/rehearse.py --hosts=2 -- \\
        python -m lingvo_pipe.worker \\
        --model=synthetic.regression.MlpRegression --logdir=/tmp/two_hosts

makes hosts h1 … hN (tools/hosts.py: network namespaces on one switch),
runs the command on every host with `TF_CONFIG` naming the cluster
h1:2222 … hN:2222 and the host's own index, prefixes each host's lines
with `[h1]` …, and removes everything when the commands end (also when
this process is killed). `--rate=h2=100mbit` limits a host's link (both
ways); `--cut=h2@30` cuts it 30 s after the start and `--heal=h2@33`
heals it. SIGINT/SIGTERM reach every command as SIGTERM (the workers stop
after a step with a checkpoint); a second one kills them. The exit status
is the first failed command's (128+N for signal N).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable-next=g-import-not-at-top,wrong-import-position
from hosts import Hosts, HostsError, parse_rate


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='rehearse.py', description=__doc__.split('\n\n')[0],
      usage='sudo python tools/rehearse.py --hosts=N [options] -- command ...')
  parser.add_argument('--hosts', type=int, default=2, help='Hosts h1 … hN.')
  parser.add_argument('--port', type=int, default=2222, help='The port of '
                      'every task in TF_CONFIG (each host has its own).')
  parser.add_argument('--rate', action='append', default=[],
                      metavar='HOST=RATE', help='Limit a host\'s link, e.g. '
                      'h2=100mbit (repeatable).')
  parser.add_argument('--cut', action='append', default=[],
                      metavar='HOST@SECONDS', help='Cut a host\'s link that '
                      'many seconds after the start (repeatable).')
  parser.add_argument('--heal', action='append', default=[],
                      metavar='HOST@SECONDS', help='Heal it again.')
  parser.add_argument('command', nargs='+', help='Run on every host, with '
                      'TF_CONFIG set for it.')
  return parser


def _events(args: argparse.Namespace) -> list[tuple[float, str, str]]:
  """(seconds, 'cut' or 'heal', host), in time order."""
  events = []
  for kind in ('cut', 'heal'):
    for text in getattr(args, kind):
      host, _, at = text.partition('@')
      try:
        events.append((float(at), kind, host))
      except ValueError:
        raise HostsError(f'--{kind}={text}: write HOST@SECONDS, e.g. '
                         'h2@30') from None
  return sorted(events)


def _stream(name: str, pipe: IO[bytes], out: IO[str]) -> None:
  for raw in iter(pipe.readline, b''):
    out.write(f'[{name}] {raw.decode("utf-8", "replace")}')
    out.flush()


def _say(text: str) -> None:
  print(f'rehearse.py: {text}', file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    events = _events(args)
    rates = [r.partition('=')[::2] for r in args.rate]
    with Hosts(args.hosts) as hosts:
      for host, rate in rates:
        hosts.limit(host, parse_rate(rate))
      _say(', '.join(f'{n} = {hosts.address(n)}' for n in hosts.names) +
           ''.join(f'; {h} limited to {r}' for h, r in rates))
      procs = [hosts.popen(n, args.command, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE,
                           env=dict(os.environ, TF_CONFIG=hosts.tf_config(
                               n, args.port)))
               for n in hosts.names]
      signal.signal(signal.SIGTERM, lambda *_: _forward(procs))
      signal.signal(signal.SIGINT, lambda *_: _forward(procs))
      for n, p in zip(hosts.names, procs):
        for pipe, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
          threading.Thread(target=_stream, args=(n, pipe, out),
                           daemon=True).start()
      return _wait(hosts, procs, events)
  except HostsError as e:
    _say(f'error: {e}')
    return 2


_FORWARDED = [0]


def _forward(procs: Sequence[subprocess.Popen[Any]]) -> None:
  """SIGINT/SIGTERM: the first is passed on as SIGTERM, a second kills."""
  _FORWARDED[0] += 1
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM if _FORWARDED[0] == 1 else signal.SIGKILL)


def _wait(hosts: Hosts, procs: Sequence[subprocess.Popen[Any]],
          events: list[tuple[float, str, str]]) -> int:
  """Runs the cut/heal events until every command ended; returns the first
  failure's exit status (128+N for signal N), else 0."""
  start, status, running = time.monotonic(), 0, set(range(len(procs)))
  while running:
    while events and time.monotonic() - start >= events[0][0]:
      at, kind, host = events.pop(0)
      getattr(hosts, kind)(host)
      _say(f'{kind} {host}\'s link at {at:g} s')
    for i in sorted(running):
      rc = procs[i].poll()
      if rc is not None:
        running.discard(i)
        _say(f'{hosts.names[i]} exited with status '
             f'{rc if rc >= 0 else 128 - rc}')
        status = status or (rc if rc >= 0 else 128 - rc)
    time.sleep(0.05)
  return status


if __name__ == '__main__':
  sys.exit(main())
