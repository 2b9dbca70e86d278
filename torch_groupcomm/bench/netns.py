"""Simulated hosts on one Linux machine: network namespaces joined by shaped links.

    with SimulatedHosts([2, 2], rate="1gbit") as hosts:
        ranks = hosts.launch([sys.executable, "train.py"])
        ...

Each simulated host has its own network stack (an ``eth0`` with its own
address), its own hostname and its own ``/dev/shm``, so a group's ranks find
their hosts the way they would on real machines (hostname + boot id, no
``GROUPCOMM_HOST_ID``) and shared memory works only within a host. Needs root
and iproute2 (``ip``, ``tc``) plus util-linux (``unshare``, ``nsenter``).

Layout. One "switch" namespace holds a Linux bridge ``br0``. Each host is a
namespace of its own, joined to the bridge by a veth pair: the switch end is
enslaved to the bridge, the host end is renamed ``eth0`` inside the host (so
``GLOO_SOCKET_IFNAME=eth0`` is right for every host) and gets 198.18.0.<i+1>/24,
from the RFC 2544 benchmarking range, which is never routed anywhere. A
link is shaped with a token bucket (``tc qdisc ... tbf``) on the egress of
both of its ends: the host end limits what the host sends, the switch end what
it receives, so each direction of each link carries at most ``rate`` on its
own (full duplex, like a switched Ethernet port). Traffic between two ranks
of one host never touches the link (it goes through the host's loopback).

The hostname, IPC namespace and ``/dev/shm`` (a private tmpfs) belong to one
"holder" process per host, a ``sleep`` started inside the host's network
namespace in new UTS, IPC and mount namespaces; every command run on the host
enters the holder's namespaces with ``nsenter``, so all ranks of a host share
one ``/dev/shm`` and no two hosts do.

Everything is named ``gc<pid>-...`` after the creating process and removed on
exit, on an exception, on SIGTERM/SIGINT and at interpreter exit; what a
killed creator left behind is removed by the next one (``sweep_stale``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["SimulatedHosts", "check_prerequisites", "parse_rate", "sweep_stale", "wait_all"]

REQUIRED_TOOLS = ("ip", "tc", "unshare", "nsenter")
_PREFIX = "gc"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-(?:sw|h\d+)$")
# `ip netns exec NS` bind-mounts the files in /etc/netns/NS over /etc: each host's /etc/hosts.
_ETC_NETNS = Path("/etc/netns")
# tc's rate units, in bits per second ("bit" forms) or bytes per second ("bps").
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 1024,
    "mibit": 1024**2,
    "gibit": 1024**3,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def parse_rate(rate: str) -> float:
    """Bytes per second of a rate written as tc writes it (``"1gbit"``, ``"500mbit"``, ``"1gbps"``)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", rate)
    if not match or match.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. '1gbit', '10gbit', '500mbit')")
    return float(match.group(1)) * _RATE_UNITS[match.group(2).lower()] / 8


def _run(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"simulated hosts: `{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def check_prerequisites() -> None:
    """Raise RuntimeError saying what is missing when this process cannot make simulated hosts."""
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    problems = []
    if os.geteuid() != 0:
        problems.append("this process is not root")
    if missing:
        problems.append(f"missing tools: {', '.join(missing)}")
    if problems:
        raise RuntimeError(
            "simulated hosts need root and iproute2 (ip, tc) plus util-linux (unshare, nsenter): " + "; ".join(problems)
        )


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in network namespace ``name``, wait until they are gone, delete it."""
    deadline = time.monotonic() + 10
    while True:
        pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).split()]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    _run("ip", "netns", "delete", name, check=False)
    shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Delete the namespaces (and kill their processes) left by a creator
    that is gone, e.g. one killed by SIGKILL; return their names."""
    names = set(_namespaces())
    with contextlib.suppress(OSError):
        names.update(p.name for p in _ETC_NETNS.iterdir())
    stale = sorted(n for n in names if (m := _NAME.match(n)) and not _alive(int(m.group(1))))
    for name in stale:
        _kill_namespace(name)
    return stale


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process until ``timeout`` seconds from now; the ones
    still running then are killed. Returns each exit status (None: killed at the deadline)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for proc, code in zip(procs, codes):
        if code is None:
            proc.kill()
            proc.wait()
    return codes


class SimulatedHosts:
    """``len(ranks_per_host)`` simulated hosts, host ``i`` meant for
    ``ranks_per_host[i]`` ranks, linked through one switch; each link shaped
    to ``rate`` per direction (a tc rate such as ``"1gbit"``; None: unshaped).
    A context manager: the hosts exist inside the ``with`` block."""

    def __init__(self, ranks_per_host: Sequence[int], rate: str | None = "1gbit") -> None:
        if not ranks_per_host or any(n < 1 for n in ranks_per_host):
            raise ValueError(f"ranks_per_host needs one positive count per host, got {list(ranks_per_host)}")
        if len(ranks_per_host) > 250:
            raise ValueError("at most 250 simulated hosts")
        self.ranks_per_host = list(ranks_per_host)
        self.rate = rate
        self._rate_bytes = parse_rate(rate) if rate is not None else None
        self._creator = os.getpid()
        self.prefix = f"{_PREFIX}{self._creator}-"
        self._holders: list[subprocess.Popen] = []
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._saved_handlers: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._open = False
        self._closing = False
        self._pending_signal: int | None = None

    # -- names and facts -------------------------------------------------------------------

    @property
    def hosts(self) -> int:
        """How many hosts."""
        return len(self.ranks_per_host)

    @property
    def world_size(self) -> int:
        """How many ranks ``launch`` starts."""
        return sum(self.ranks_per_host)

    @property
    def link_bytes_per_s(self) -> float | None:
        """The bound of each host's link, per direction, in bytes per second (None: unshaped)."""
        return self._rate_bytes

    def namespace(self, host: int) -> str:
        """The network namespace of ``host`` (for ``ip netns exec``)."""
        return f"{self.prefix}h{host}"

    @property
    def switch(self) -> str:
        """The namespace that holds the bridge."""
        return f"{self.prefix}sw"

    def hostname(self, host: int) -> str:
        """The hostname ``host`` reports."""
        return f"gchost{host}"

    def address(self, host: int) -> str:
        """The IPv4 address of ``host``'s ``eth0``."""
        self._check_host(host)
        return f"198.18.0.{host + 1}"  # each set of hosts is a network of its own

    def holder_pid(self, host: int) -> int:
        """The pid of the process whose UTS, IPC and mount namespaces ``host`` has."""
        self._check_host(host)
        return self._holders[host].pid

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise IndexError(f"no host {host} among {self.hosts}")

    # -- set up and tear down --------------------------------------------------------------

    def __enter__(self) -> SimulatedHosts:
        check_prerequisites()
        sweep_stale()
        self._open = True
        self._catch_signals()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def _build(self) -> None:
        sw = self.switch
        self._netns_add(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for host in range(self.hosts):
            ns = self.namespace(host)
            self._netns_add(ns)
            port = f"p{host}"
            # Both ends are made in the switch; the host end moves into its namespace as eth0.
            _run("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                self._shape(ns, "eth0")
                self._shape(sw, port)
            self._write_hosts_file(host)
            self._holders.append(self._start_holder(host))

    def _shape(self, ns: str, dev: str) -> None:
        """A token bucket on ``dev``'s egress. The bucket must hold what the
        link sends between two timer ticks (rate / 250 at HZ=250) or the rate
        is not reached; the queue holds 2 ms of traffic beyond it."""
        assert self._rate_bytes is not None
        burst = max(int(self._rate_bytes / 250), 128 * 1024)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", str(self.rate), "burst", str(burst), "latency", "2ms")  # fmt: skip

    def _write_hosts_file(self, host: int) -> None:
        """``host``'s /etc/hosts: its own name and every other host's resolve, as on a real cluster."""
        etc = _ETC_NETNS / self.namespace(host)
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{self.address(h)} {self.hostname(h)}" for h in range(self.hosts)]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def _start_holder(self, host: int) -> subprocess.Popen:
        """Start ``host``'s holder and return once its hostname and /dev/shm are in place."""
        script = (
            f"hostname {self.hostname(host)} && "
            "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && "
            "echo ready && exec sleep infinity"
        )
        holder = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(host),
             "unshare", "--uts", "--ipc", "--mount", "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = holder.stdout.readline() if holder.stdout else ""
        if line.strip() != "ready":
            holder.kill()
            _, err = holder.communicate()
            raise RuntimeError(f"simulated hosts: host {host}'s namespaces failed: {err.strip()}")
        # `ip netns exec` and `unshare` exec'ed in place: the pid is the sleep's, in every namespace.
        return holder

    def close(self) -> None:
        """Kill everything started on the hosts and delete the namespaces (idempotent)."""
        if os.getpid() != self._creator:  # a forked child leaving: the hosts are its parent's
            return
        with self._lock:
            if not self._open:
                return
            self._open = False
            self._closing = True
            try:
                for name in reversed(self._created):  # hosts first: their processes go first
                    _kill_namespace(name)
                for proc in self._procs + self._holders:
                    with contextlib.suppress(OSError):
                        proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)  # reap: no zombie left behind
                self._created.clear()
            finally:
                self._closing = False
                self._restore_signals()
                atexit.unregister(self.close)
        if self._pending_signal is not None:  # arrived while tearing down: its turn now
            os.kill(os.getpid(), self._pending_signal)

    def _catch_signals(self) -> None:
        """On SIGTERM/SIGINT: tear down, then let the signal do what it did
        before. A signal the process ignores (SIGINT in a job started with
        ``&`` from a script) stays ignored: the hosts outlive it."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if self._closing:  # the teardown under way finishes first
                self._pending_signal = signum
                return
            previous = self._saved_handlers.get(signum, signal.SIG_DFL)
            self.close()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) != signal.SIG_IGN:
                self._saved_handlers[signum] = signal.signal(signum, handler)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._saved_handlers.items():
            signal.signal(signum, previous)
        self._saved_handlers.clear()

    # -- running things on the hosts -------------------------------------------------------

    def popen(
        self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Run ``argv`` on ``host`` (its network, hostname, IPC and /dev/shm),
        in this process's working directory, with ``env`` (default: ours).
        Other keyword arguments go to ``subprocess.Popen``. The process is
        killed when the hosts are torn down."""
        if not self._open:
            raise RuntimeError("simulated hosts: not set up (use them inside `with`)")
        pid = self.holder_pid(host)
        cwd = kwargs.pop("cwd", None) or os.getcwd()
        # nsenter's --wd: entering a mount namespace moves the process to its root.
        command = ["nsenter", "-t", str(pid), "--net", "--uts", "--ipc", "--mount", f"--wd={cwd}", "--", *argv]
        proc = subprocess.Popen(command, env=dict(env) if env is not None else None, **kwargs)
        self._procs.append(proc)
        return proc

    def shm_entries(self, host: int) -> list[str]:
        """What is in ``host``'s /dev/shm, sorted (for leak checks)."""
        # /proc/<pid>/root resolves paths in that process's mount namespace.
        return sorted(os.listdir(f"/proc/{self.holder_pid(host)}/root/dev/shm"))

    def placement(self) -> list[tuple[int, int]]:
        """``(host, local rank)`` of each global rank, ranks numbered host by host."""
        return [(host, local) for host, n in enumerate(self.ranks_per_host) for local in range(n)]

    def launch(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        port: int = 29500,
        log_dir: str | os.PathLike | None = None,
    ) -> list[subprocess.Popen]:
        """Start ``argv`` once per rank, on its host, with torch's env://
        rendezvous in the environment (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, MASTER_ADDR: host 0, MASTER_PORT: ``port``,
        GLOO_SOCKET_IFNAME=eth0) on top of ``env`` (default: ours, less
        ``GROUPCOMM_HOST_ID``: the ranks discover their hosts). With
        ``log_dir``, rank r's stdout and stderr go to ``log_dir/rank<r>.log``.
        Returns the processes, in rank order."""
        base = dict(os.environ if env is None else env)
        base.pop("GROUPCOMM_HOST_ID", None)
        procs = []
        for rank, (host, local) in enumerate(self.placement()):
            rank_env = {
                **base,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(self.ranks_per_host[host]),
                "MASTER_ADDR": self.address(0),
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "eth0",
            }
            out: IO[Any] | None = None
            if log_dir is not None:
                out = open(Path(log_dir) / f"rank{rank}.log", "w")  # the child keeps its own copy
            try:
                procs.append(self.popen(host, argv, rank_env, stdout=out, stderr=subprocess.STDOUT if out else None))
            finally:
                if out is not None:
                    out.close()
        return procs
