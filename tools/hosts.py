"""Several hosts on one machine: network namespaces joined by a switch.

    with hosts.Hosts(2) as h:                  # h1, h2
      proc = h.popen('h1', ['python', ...])      # runs inside h1
      h.limit('h2', 100e6)                       # 100 Mbit/s, both ways
      h.cut('h2'); h.heal('h2')

Each host has a network stack of its own (its own interfaces, ports and
routes) and reaches the others only through a switch. Tests, benchmarks
(`benchmark.py links`) and `tools/rehearse.py` (README's multi-host recipe
on hosts h1 … hN, from the command line) use it. Needs root on Linux;
`unavailable()` says why not, in one line.

How, and why this way:
- A host is a process (`sleep`) in a new network and mount namespace,
  started with PR_SET_PDEATHSIG=SIGKILL. Nothing is named in /var/run/netns
  and nothing is made in this machine's own namespace: the switch (a
  bridge) lives in a namespace of its own, and each host's veth pair is
  created there, one end moved into the host. So when this process dies,
  even by SIGKILL, its hosts die with it, and a namespace that no process
  holds is freed by the kernel with its interfaces. `close` also kills, by
  PID, every process found in one of its namespaces.
- Addresses come from 198.18.0.0/15 (RFC 2544, reserved for network
  benchmarks), a /24 per harness; hosts have no route beyond it, so traffic
  can only reach the addresses the harness assigned. Two harnesses at once
  (parallel tests) do not meet: each has its own switch.
- Host names resolve inside the hosts: each host's mount namespace has its
  own /etc/hosts (a bind mount), so the recipe's `h1:2222` works verbatim.
- A cut takes the host's port off the switch: packets vanish silently and
  the link stays up, as when a switch or cable between racks fails (no
  "connection refused", no carrier loss). A rate limit is `tc htb` in the
  switch, both ways, small packets first (`limit`; `netem` and the
  flow-queuing qdiscs are not in every kernel): shaped at the host's
  own interface, its socket buffers filled, and gRPC then interleaved
  concurrent messages instead of sending them one after another.
- Processes are started through util-linux (`setpriv --pdeathsig`,
  `nsenter`), not a `preexec_fn`, which is unsafe in a threaded parent
  such as a test process that imported TensorFlow.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

_NETWORK = ipaddress.ip_network('198.18.0.0/15')
_TOOLS = ('ip', 'tc', 'unshare', 'nsenter', 'setpriv', 'mount', 'sleep')
_RATE = re.compile(r'^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)?$', re.IGNORECASE)
_UNITS = {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}


class HostsError(RuntimeError):
  """The hosts cannot be made or driven; the message says why."""


def unavailable() -> str | None:
  """Why hosts cannot be made on this machine, or None if they can."""
  if not sys.platform.startswith('linux'):
    return 'network namespaces need Linux'
  if os.geteuid() != 0:
    return 'making network namespaces needs root'
  missing = [t for t in _TOOLS if shutil.which(t) is None]
  if missing:
    return f'missing tools: {", ".join(missing)} (iproute2, util-linux)'
  probe = subprocess.run(['unshare', '--net', '--mount', '--', 'ip', 'link',
                          'add', 'lp_probe', 'type', 'bridge'],
                         capture_output=True, text=True, check=False)
  if probe.returncode:
    return ('cannot make a network namespace with a bridge here: '
            + ' '.join(probe.stderr.split())[:200])
  return None


def parse_rate(text: str) -> float:
  """Bits per second of '100mbit', '1gbit', '2.5e9' (bits/s)."""
  m = _RATE.match(text.strip())
  try:
    value = float(text) if not m else float(m[1]) * _UNITS[m[2].lower()]
  except ValueError:
    raise HostsError(f'rate {text!r}: write e.g. 100mbit or 1gbit') from None
  if m and (m[3] or '').lower() == 'bps':
    value *= 8
  if value <= 0:
    raise HostsError(f'rate {text!r} must be > 0')
  return value


class Hosts:
  """`num_hosts` hosts h1 … hN on one switch; `close` removes them all."""

  _subnets_open: set[int] = set()  # Of this process's open harnesses.
  _subnets_lock = threading.Lock()

  def __init__(self, num_hosts: int, workdir: str | None = None) -> None:
    if not 1 <= num_hosts <= 250:
      raise HostsError(f'num_hosts={num_hosts}: give 1 to 250 hosts')
    why = unavailable()
    if why:
      raise HostsError(why)
    self.names = [f'h{i + 1}' for i in range(num_hosts)]
    self._own_dir = workdir is None
    self._dir = workdir or tempfile.mkdtemp(prefix='lp_hosts_')
    # A /24 per harness, none shared by two open harnesses of this process:
    # a host that sends to another harness's address must find no one, not
    # a host of its own that took the same address.
    with Hosts._subnets_lock:
      start = os.getpid() * 7919
      free = (i % 512 for i in range(start, start + 512)
              if i % 512 not in Hosts._subnets_open)
      self._subnet: int | None = next(free)
      Hosts._subnets_open.add(self._subnet)
    self.subnet = list(_NETWORK.subnets(new_prefix=24))[self._subnet]
    self._holders: dict[str, subprocess.Popen[bytes]] = {}
    self._procs: list[subprocess.Popen[Any]] = []
    self._ifbs: set[str] = set()  # Ifb devices made for rate limits.
    self.namespaces: set[str] = set()  # 'net:[inode]' of every namespace.
    self._lock = threading.Lock()
    try:
      self._make()
    except BaseException:
      self.close()
      raise

  # ---- Making and removing -------------------------------------------------
  def _make(self) -> None:
    for name in ['switch'] + self.names:
      self._holders[name] = self._hold()
    for proc in self._holders.values():
      self.namespaces.add(self._wait_ready(proc))
    hosts_file = os.path.join(self._dir, 'hosts')
    with open(hosts_file, 'w') as f:
      f.write('127.0.0.1 localhost\n' + ''.join(
          f'{self.address(n)} {n}\n' for n in self.names))
    self._ip('switch', ['link add br0 type bridge', 'link set br0 up'])
    for i, name in enumerate(self.names):
      pid = self._holders[name].pid
      self._ip('switch', [f'link add p{i + 1} type veth peer name eth0',
                          f'link set eth0 netns {pid}',
                          f'link set p{i + 1} master br0 up'])
      self._ip(name, [f'addr add {self.address(name)}/24 dev eth0',
                      'link set eth0 up', 'link set lo up'])
      self._check(['nsenter', '-t', str(pid), '-m', '--', 'mount', '--bind',
                   hosts_file, '/etc/hosts'])

  def _hold(self) -> subprocess.Popen[bytes]:
    """A process in a new network and mount namespace that dies with us."""
    return subprocess.Popen(
        ['setpriv', '--pdeathsig', 'KILL', '--', 'unshare', '--net',
         '--mount', '--', 'sleep', 'infinity'], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)

  def _wait_ready(self, proc: subprocess.Popen[bytes]) -> str:
    own = os.readlink('/proc/self/ns/net')
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      if proc.poll() is not None:
        err = proc.stderr.read().decode() if proc.stderr else ''
        raise HostsError(f'a host did not start: {" ".join(err.split())}')
      try:
        with open(f'/proc/{proc.pid}/comm') as f:
          comm = f.read().strip()
        ns = os.readlink(f'/proc/{proc.pid}/ns/net')
      except OSError:
        ns, comm = own, ''
      if comm == 'sleep' and ns != own:
        return ns
      time.sleep(0.01)
    raise HostsError('a host did not start within 30 s')

  def close(self) -> list[int]:
    """Kills every process in the hosts and the hosts themselves (by PID);
    returns the PIDs that were still in a namespace (killed now)."""
    with self._lock:
      left = self.processes()
      for pid in left + [p.pid for p in self._procs]:
        _kill(pid)
      for proc in self._procs:
        _reap(proc)
      for proc in self._holders.values():
        _kill(proc.pid)
        _reap(proc)
        if proc.stderr:
          proc.stderr.close()
      self._holders.clear()
      if self._own_dir:
        shutil.rmtree(self._dir, ignore_errors=True)
    with Hosts._subnets_lock:
      if self._subnet is not None:
        Hosts._subnets_open.discard(self._subnet)
        self._subnet = None  # Twice closed: another may hold it by then.
    return left

  def processes(self) -> list[int]:
    """PIDs in one of these hosts' namespaces, other than the hosts' own."""
    held = {p.pid for p in self._holders.values()}
    return [pid for pid in pids_in(self.namespaces) if pid not in held]

  def __enter__(self) -> 'Hosts':
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # ---- Using them ----------------------------------------------------------
  def address(self, name: str) -> str:
    """The IPv4 address of host `name` ('h1' …)."""
    return str(self.subnet.network_address + self._index(name) + 1)

  def popen(self, name: str, args: Sequence[str], cwd: str | None = None,
            **kwargs: Any) -> subprocess.Popen[Any]:
    """Starts `args` inside host `name` (it dies with this process);
    `kwargs` go to subprocess.Popen (env, stdout, …)."""
    pid = self._holders[self._host(name)].pid
    cmd = ['setpriv', '--pdeathsig', 'KILL', '--', 'nsenter', '-t', str(pid),
           '-n', '-m', f'--wd={os.path.abspath(cwd or os.getcwd())}', '--',
           *args]
    proc = subprocess.Popen(cmd, **kwargs)
    self._procs.append(proc)
    return proc

  def run(self, name: str, args: Sequence[str], timeout: float = 60,
          **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Runs `args` in host `name` to the end; output captured as text."""
    proc = self.popen(name, args, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, **kwargs)
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      _kill(proc.pid)
      _reap(proc)
      raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

  def cut(self, name: str) -> None:
    """Takes `name`'s port off the switch: its packets vanish silently."""
    self._ip('switch', [f'link set p{self._index(name) + 1} nomaster'])

  def heal(self, name: str) -> None:
    """Puts `name`'s port back on the switch."""
    self._ip('switch', [f'link set p{self._index(name) + 1} master br0'])

  def limit(self, name: str, bits_per_s: float) -> None:
    """Limits `name`'s link to `bits_per_s` each way, in the switch: a
    shaper on its port toward the host, and one on an ifb device that the
    port's ingress (from the host) is redirected through. So the host's own
    sending is never held back, as when the slow part is the network.

    The shaper is htb with two classes: IPv4 packets under 256 bytes (TCP
    acknowledgements, HTTP/2 window updates, RPC requests) go before bulk
    data, which queues for up to 0.5 s. With one FIFO (tbf), a stream's
    acknowledgements waited behind the other direction's data: two TCP
    streams, one each way over 100 Mbit/s, carried 95 and 56-84 Mbit/s
    where each alone carried 96; with the small packets first, 95.5 and
    95.5 (1 Gbit/s: 949 and 947). The bucket holds 1 ms at the rate
    (≥ 16 KiB, about ten full-size frames), so no burst much beats the
    rate. The queue holds 0.5 s: with 50 ms, TCP losses stalled 1 MiB
    transfers by ~100 ms at 100 Mbit/s."""
    rate = int(bits_per_s)
    burst = max(16384, rate // 8000)
    limit = max(4 * burst, rate // 8 // 2)
    i = self._index(name) + 1
    port, ifb = f'p{i}', f'ifb{i}'
    if ifb not in self._ifbs:
      self._ip('switch', [f'link add {ifb} type ifb', f'link set {ifb} up'])
      self._tc('switch', f'qdisc add dev {port} handle ffff: ingress')
      self._tc('switch', f'filter add dev {port} parent ffff: protocol all '
               f'u32 match u32 0 0 action mirred egress redirect dev {ifb}')
      self._ifbs.add(ifb)
    buckets = f'burst {burst} cburst {burst}'
    small = rate // 10  # Guaranteed to the small packets; either may borrow.
    for dev in (port, ifb):
      self._tc_batch('switch', [
          # Whatever shaped the link before goes first (a rate changes).
          f'qdisc replace dev {dev} root pfifo',
          f'qdisc replace dev {dev} root handle 1: htb default 20',
          f'class add dev {dev} parent 1: classid 1:1 htb rate {rate}bit '
          f'ceil {rate}bit {buckets}',
          f'class add dev {dev} parent 1:1 classid 1:10 htb rate '
          f'{small}bit ceil {rate}bit {buckets} prio 0',
          f'class add dev {dev} parent 1:1 classid 1:20 htb rate '
          f'{rate - small}bit ceil {rate}bit {buckets} prio 1',
          f'qdisc add dev {dev} parent 1:10 handle 10: pfifo limit 10000',
          f'qdisc add dev {dev} parent 1:20 handle 20: bfifo limit {limit}',
          # The IPv4 header's total length (bytes 2-3) below 256.
          f'filter add dev {dev} parent 1: protocol ip prio 1 u32 match '
          'u16 0x0000 0xff00 at 2 flowid 1:10'])

  def unlimit(self, name: str) -> None:
    """Removes `name`'s rate limit (both ways)."""
    i = self._index(name) + 1
    if f'ifb{i}' in self._ifbs:
      self._tc('switch', f'qdisc del dev p{i} root')
      self._tc('switch', f'qdisc del dev ifb{i} root')
      self._tc('switch', f'qdisc replace dev ifb{i} root pfifo')

  def tf_config(self, name: str, port: int = 2222, job: str = 'worker'
                ) -> str:
    """README's TF_CONFIG for host `name` of a cluster of every host."""
    return json.dumps({'cluster': {job: [f'{n}:{port}' for n in self.names]},
                       'task': {'type': job, 'index': self._index(name)}})

  # ---- Helpers -------------------------------------------------------------
  def _index(self, name: str) -> int:
    return self.names.index(self._host(name))

  def _host(self, name: str) -> str:
    if name not in self.names:
      raise HostsError(f'no host {name!r}; the hosts are {self.names}')
    return name

  def _ip(self, where: str, commands: Sequence[str]) -> None:
    self._check(['nsenter', '-t', str(self._holders[where].pid), '-n', '--',
                 'ip', '-batch', '-'], '\n'.join(commands) + '\n')

  def _tc(self, where: str, command: str) -> None:
    self._check(['nsenter', '-t', str(self._holders[where].pid), '-n', '--',
                 'tc', *command.split()])

  def _tc_batch(self, where: str, commands: Sequence[str]) -> None:
    self._check(['nsenter', '-t', str(self._holders[where].pid), '-n', '--',
                 'tc', '-batch', '-'], '\n'.join(commands) + '\n')

  @staticmethod
  def _check(cmd: Sequence[str], stdin: str | None = None) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True,
                          check=False, timeout=60)
    if done.returncode:
      raise HostsError(f'{" ".join(cmd)} failed: '
                       f'{" ".join(done.stderr.split())}')


def pids_in(namespaces: set[str]) -> list[int]:
  found = []
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        if os.readlink(f'/proc/{entry}/ns/net') in namespaces:
          found.append(int(entry))
      except OSError:
        pass  # Gone, or a kernel thread.
  return found


def _kill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _reap(proc: subprocess.Popen[Any]) -> None:
  try:
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    pass
