"""tools/hosts.py (and rehearse.py): hosts made of network namespaces, and
nothing left after.

Needs root and iproute2/util-linux; skipped with one line elsewhere. No
TensorFlow runs here: the hosts talk through small Python sockets.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_TOOL = os.path.join(_ROOT, 'tools', 'hosts.py')
_REHEARSE = os.path.join(_ROOT, 'tools', 'rehearse.py')
sys.path.insert(0, os.path.dirname(_TOOL))
import hosts as hosts_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.bind(('0.0.0.0', 5000))
    s.listen()
    print('listening', flush=True)
    while True:
      c, _ = s.accept()
      n = 0
      while True:
        b = c.recv(1 << 16)
        if not b:
          break
        n += len(b)
      c.sendall(str(n).encode())
      c.close()
    """)
_CLIENT = textwrap.dedent("""
    import socket, sys, time
    host, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    start = time.monotonic()
    try:
      c = socket.create_connection((host, 5000), timeout=timeout)
      c.sendall(b'x' * n)
      c.shutdown(socket.SHUT_WR)
      got = c.recv(100).decode()
    except OSError as e:
      got = type(e).__name__
    print(got, time.monotonic() - start)
    """)


@pytest.fixture(name='hosts')
def _hosts():
  why = hosts_lib.unavailable()
  if why:
    pytest.skip(f'needs network namespaces: {why}')
  with hosts_lib.Hosts(2) as made:
    yield made
  assert hosts_lib.pids_in(made.namespaces) == []


def _interfaces():
  out = subprocess.run(['ip', '-o', 'link', 'show'], capture_output=True,
                       text=True, check=True).stdout
  return sorted(line.split(':')[1].strip() for line in out.splitlines())


def _serve(hosts, name):
  server = hosts.popen(name, [sys.executable, '-c', _SERVER],
                       stdout=subprocess.PIPE, text=True)
  assert server.stdout.readline() == 'listening\n'
  return server


def _send(hosts, src, dst, nbytes, timeout=5.0):
  """(what the server answered or the error's name, seconds)."""
  out = hosts.run(src, [sys.executable, '-c', _CLIENT, dst, str(nbytes),
                        str(timeout)]).stdout.split()
  return out[0], float(out[1])


def test_hosts_reach_each_other_by_name_and_a_cut_drops_silently(hosts):
  assert [hosts.address(n) for n in hosts.names] == [
      str(hosts.subnet.network_address + i) for i in (1, 2)]
  assert hosts.subnet.subnet_of(hosts_lib._NETWORK)  # 198.18.0.0/15.
  _serve(hosts, 'h2')
  assert _send(hosts, 'h1', 'h2', 1000)[0] == '1000'
  assert _send(hosts, 'h1', hosts.address('h2'), 10)[0] == '10'
  hosts.cut('h2')
  # No "connection refused": the packets vanish, the connect times out.
  assert _send(hosts, 'h1', 'h2', 10, timeout=1.0)[0] == 'TimeoutError'
  hosts.heal('h2')
  assert _send(hosts, 'h1', 'h2', 10)[0] == '10'
  # Each host has its own ports: h1 has no server on 5000.
  assert _send(hosts, 'h2', 'h1', 10)[0] == 'ConnectionRefusedError'


def test_a_rate_limit_holds_both_ways(hosts):
  """tbf at 20 Mbit/s: 1 MB needs at least 0.4 s on the wire, whatever the
  machine's load (no upper bound is asserted: load only slows it)."""
  _serve(hosts, 'h1')
  _serve(hosts, 'h2')
  hosts.limit('h2', 20e6)
  nbytes = 1_000_000
  least = nbytes * 8 / 20e6 * 0.95  # The bucket's burst goes at once.
  for src, dst in (('h1', 'h2'), ('h2', 'h1')):
    got, seconds = _send(hosts, src, dst, nbytes, timeout=30)
    assert got == str(nbytes) and seconds >= least, (src, dst, seconds)
  hosts.unlimit('h2')
  got, seconds = _send(hosts, 'h1', 'h2', nbytes)
  assert got == str(nbytes) and seconds < least


_RATE_SINK = textwrap.dedent("""
    import socket, time
    s = socket.socket()
    s.bind(('0.0.0.0', 5001))
    s.listen()
    print('listening', flush=True)
    c, _ = s.accept()
    n, start = 0, None
    while True:
      b = c.recv(1 << 20)
      if not b:
        break
      start = start or time.monotonic()
      n += len(b)
    print(n * 8 / (time.monotonic() - start), flush=True)
    """)
_RATE_SOURCE = ('import socket, sys; c = socket.create_connection(('
                'sys.argv[1], 5001)); c.sendall(bytes(int(sys.argv[2]))); '
                'c.close()')


def test_two_streams_one_each_way_both_carry_the_rate(hosts):
  """Over h2's 20 Mbit/s link, a stream h1 → h2 and one h2 → h1 at once
  each carry ≥ 85% of the rate (payload, measured by the receivers): each
  one's acknowledgements go before the other's data. In one FIFO (tbf)
  they queued behind it, and one of the two carried 12-14 Mbit/s (0.6-0.7
  of the rate; 56-84 of 100 Mbit/s). A CPU-light rate: load does not
  bring a Python socket near it."""
  hosts.limit('h2', 20e6)
  sinks = [hosts.popen(n, [sys.executable, '-c', _RATE_SINK],
                       stdout=subprocess.PIPE, text=True) for n in ('h1', 'h2')]
  for sink in sinks:
    assert sink.stdout.readline() == 'listening\n'
  sources = [hosts.popen(src, [sys.executable, '-c', _RATE_SOURCE, dst,
                               str(3 << 20)])
             for src, dst in (('h2', 'h1'), ('h1', 'h2'))]
  for source in sources:
    assert source.wait(timeout=60) == 0
  rates = [float(sink.communicate(timeout=60)[0]) for sink in sinks]
  assert min(rates) >= 0.85 * 20e6, rates


def test_two_harnesses_do_not_meet(hosts):
  with hosts_lib.Hosts(2) as other:
    assert other.subnet != hosts.subnet  # Else h1 would reach its own h2.
    _serve(other, 'h2')
    assert _send(other, 'h1', 'h2', 10)[0] == '10'
    # From the first harness, the other's hosts are not reachable at all.
    got, _ = _send(hosts, 'h1', other.address('h2'), 10, timeout=1.0)
    assert got in ('TimeoutError', 'OSError'), got
  assert hosts_lib.pids_in(other.namespaces) == []


_KILLED = textwrap.dedent("""
    import json, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    import hosts
    made = hosts.Hosts(3)
    made.limit('h2', 1e8)
    made.popen('h1', ['sleep', '1000'])
    while not made.processes():  # Until the sleep is inside h1.
      time.sleep(0.01)
    print(json.dumps(sorted(made.namespaces)), flush=True)
    time.sleep(1000)
    """)


def test_a_harness_killed_midway_leaves_nothing(hosts):
  """SIGKILL gives no chance to clean up: the hosts and their processes
  die with the harness, and the kernel frees the namespaces."""
  before = _interfaces()
  proc = subprocess.Popen([sys.executable, '-c', _KILLED,
                           os.path.dirname(_TOOL)], stdout=subprocess.PIPE,
                          text=True)
  namespaces = set(json.loads(proc.stdout.readline()))
  assert len(hosts_lib.pids_in(namespaces)) == 5  # 4 holders and a sleep.
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  deadline = time.monotonic() + 30
  while hosts_lib.pids_in(namespaces) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert hosts_lib.pids_in(namespaces) == []
  assert _interfaces() == before


def test_the_command_line_runs_a_command_on_every_host_with_tf_config(
    hosts):
  del hosts  # Only for the skip.
  code = ('import json, os, socket; c = json.loads(os.environ["TF_CONFIG"]); '
          'print(c["task"]["index"], c["cluster"]["worker"], '
          'socket.gethostbyname("h2")); '
          'raise SystemExit(3 if c["task"]["index"] == 1 else 0)')
  proc = subprocess.run([sys.executable, _REHEARSE, '--hosts=2',
                         '--rate=h1=1gbit',
                         '--', sys.executable, '-c', code],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 3, proc.stderr
  lines = sorted(proc.stdout.splitlines())
  assert len(lines) == 2, proc.stdout
  for i, line in enumerate(lines):
    assert line.startswith(f"[h{i + 1}] {i} ['h1:2222', 'h2:2222'] 198.1")
  assert 'h2 exited with status 3' in proc.stderr
  assert 'h1 limited to 1gbit' in proc.stderr


def test_without_root_the_reason_is_one_line():
  code = (f'import sys; sys.path.insert(0, {os.path.dirname(_TOOL)!r}); '
          'import hosts; print(hosts.unavailable())')
  if os.geteuid() != 0:
    pytest.skip('already not root')
  proc = subprocess.run(['setpriv', '--reuid=65534', '--regid=65534',
                         '--clear-groups', sys.executable, '-c', code],
                        capture_output=True, text=True, timeout=60)
  if proc.returncode and proc.stderr.startswith('setpriv:'):
    # Bazel's sandbox is a user namespace that maps no uid 65534.
    pytest.skip(f'cannot become another user here: {proc.stderr.strip()}')
  assert proc.stdout.strip() == 'making network namespaces needs root', (
      proc.stdout + proc.stderr)


def test_rates_are_read_as_bits_per_second():
  assert hosts_lib.parse_rate('100mbit') == 100e6
  assert hosts_lib.parse_rate('1gbit') == 1e9
  assert hosts_lib.parse_rate('2.5e6') == 2.5e6
  assert hosts_lib.parse_rate('10mbps') == 80e6
  with pytest.raises(hosts_lib.HostsError, match='write e.g. 100mbit'):
    hosts_lib.parse_rate('fast')
