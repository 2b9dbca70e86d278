"""Groups across simulated hosts: Linux network namespaces with their own
hostname, /dev/shm and network stack, joined through a bridge by veth links
shaped with tc (torch_groupcomm/bench/netns.py). The ranks find their hosts
themselves (no GROUPCOMM_HOST_ID) and run the hierarchical communicator
(gloo's, with one rank a host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _harness import RANK_TIMEOUT_S

from torch_groupcomm.bench import netns
from torch_groupcomm.bench.netns import SimulatedHosts, wait_all

try:
    netns.check_prerequisites()
    _MISSING = ""
except RuntimeError as exc:
    _MISSING = str(exc)
needs_hosts = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)

RANK_SCRIPT = Path(__file__).with_name("hosts_rank.py")
# What the rank processes get on top of ours: one thread each (two cores for
# four ranks), and no flight-recorder dump delaying the error being timed.
RANK_ENV = {"OMP_NUM_THREADS": "1", "TORCH_FR_DUMP_ON_TIMEOUT": "0"}


def _our_namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _logs(log_dir: Path, world: int) -> list[str]:
    return [(log_dir / f"rank{r}.log").read_text(errors="replace") for r in range(world)]


def _report(logs: list[str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{text[-4000:]}" for r, text in enumerate(logs))


def _assert_torn_down(hosts: SimulatedHosts, pids: list[int]) -> None:
    assert _our_namespaces(hosts.prefix) == []
    assert not any(Path("/etc/netns", hosts.namespace(h)).exists() for h in range(hosts.hosts))
    assert [p for p in pids if not _gone(p)] == []


def _env(layout: list[int]) -> dict[str, str]:
    return {**os.environ, **RANK_ENV, "HOSTS_LAYOUT": ",".join(map(str, layout))}


@needs_hosts
def test_hosts_are_separate() -> None:
    """Own hostname, address and /dev/shm per host, shared by the host's
    processes; each link shaped at both ends; everything gone afterwards."""
    with SimulatedHosts([2, 1], rate="1gbit") as hosts:
        assert hosts.link_bytes_per_s == 125e6
        assert [hosts.address(h) for h in range(2)] == ["198.18.0.1", "198.18.0.2"]
        probe = "gcprobe-" + os.urandom(4).hex()

        def on(host: int, script: str) -> str:
            done = hosts.popen(host, ["sh", "-c", script], stdout=subprocess.PIPE, text=True)
            out, _ = done.communicate(timeout=30)
            assert done.returncode == 0, (script, out)
            return out

        assert on(0, f"hostname; touch /dev/shm/{probe}").split() == ["gchost0"]
        assert on(0, f"ls /dev/shm/{probe}").strip() == f"/dev/shm/{probe}"  # a second process of host 0
        assert on(1, "hostname; ls /dev/shm").split() == ["gchost1"]
        assert hosts.shm_entries(0) == [probe] and hosts.shm_entries(1) == []
        assert probe not in os.listdir("/dev/shm")
        assert "inet 198.18.0.2/24" in on(1, "ip -4 addr show dev eth0")
        assert "gchost0" in on(1, "getent hosts gchost0")
        for host in range(2):
            assert "tbf" in on(host, "tc qdisc show dev eth0")
            shaped = subprocess.run(
                ["ip", "netns", "exec", hosts.switch, "tc", "qdisc", "show", "dev", f"p{host}"],
                capture_output=True,
                text=True,
            ).stdout
            assert "rate 1Gbit" in shaped, shaped
        pids = [hosts.holder_pid(h) for h in range(2)]
    _assert_torn_down(hosts, pids)


@needs_hosts
@pytest.mark.parametrize(
    "layout,rate",
    [([2, 2], None), ([3, 3], None), ([3, 1], "10gbit"), ([1, 1, 1], None)],
    ids=["2x2-unshaped", "2x3-unshaped", "3+1-10gbit", "3x1-unshaped"],
)
def test_collectives_across_hosts(layout: list[int], rate: str | None, tmp_path: Path) -> None:
    start = time.monotonic()
    world = sum(layout)
    with SimulatedHosts(layout, rate=rate) as hosts:
        procs = hosts.launch([sys.executable, str(RANK_SCRIPT), "collectives"], env=_env(layout), log_dir=tmp_path)
        codes = wait_all(procs, RANK_TIMEOUT_S)
        logs = _logs(tmp_path, world)
        assert codes == [0] * world, f"exit codes {codes} (None: killed after {RANK_TIMEOUT_S:.0f}s)\n{_report(logs)}"
        for rank, text in enumerate(logs):
            assert f"rank {rank} ok collectives" in text, _report(logs)
        leaks = {h: [e for e in hosts.shm_entries(h) if e.startswith("groupcomm-")] for h in range(hosts.hosts)}
        assert leaks == dict.fromkeys(range(hosts.hosts), []), leaks
        pids = [p.pid for p in procs] + [hosts.holder_pid(h) for h in range(hosts.hosts)]
    _assert_torn_down(hosts, pids)
    print(f"{layout} {rate}: {time.monotonic() - start:.1f}s")


@needs_hosts
def test_rank_killed_on_other_host(tmp_path: Path) -> None:
    """2x2: rank 3 (host 1) is SIGKILLed while the others wait in all_reduce
    (group timeout 10 s): they raise an error naming the op well within the
    timeout (hosts_rank.py checks time and message), nothing is left."""
    layout, world = [2, 2], 4
    with SimulatedHosts(layout, rate=None) as hosts:
        procs = hosts.launch([sys.executable, str(RANK_SCRIPT), "dies"], env=_env(layout), log_dir=tmp_path)
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while not all(f"rank {r} warm" in text for r, text in enumerate(_logs(tmp_path, world))):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                wait_all(procs, 0)
                pytest.fail(f"ranks did not all warm up\n{_report(_logs(tmp_path, world))}")
            time.sleep(0.1)
        time.sleep(1)  # the others are inside all_reduce now
        procs[3].kill()
        killed = time.monotonic()
        codes = wait_all(procs, 30)
        raised_within = time.monotonic() - killed
        logs = _logs(tmp_path, world)
        assert codes == [0, 0, 0, -signal.SIGKILL], f"exit codes {codes}\n{_report(logs)}"
        for rank in range(3):
            assert f"rank {rank} ok raised" in logs[rank], _report(logs)
        assert "all_reduce" in logs[0] or "allreduce" in logs[0], logs[0]
        leaks = {h: [e for e in hosts.shm_entries(h) if e.startswith("groupcomm-")] for h in range(hosts.hosts)}
        assert leaks == {0: [], 1: []}, leaks
        pids = [p.pid for p in procs] + [hosts.holder_pid(h) for h in range(hosts.hosts)]
    _assert_torn_down(hosts, pids)
    print(f"survivors done {raised_within:.1f}s after the kill")


# A process that makes two hosts, runs a sleep on one and waits to be signalled;
# netns.py is loaded from its file, so that it starts without importing torch.
# SIGINT raises KeyboardInterrupt there, as in a program started from a
# terminal, also where this test runs in a background job that ignores it
# (argv[2]: SIG_IGN makes it ignore SIGINT).
_CREATOR = """
import importlib.util, signal, sys, time
signal.signal(signal.SIGINT, getattr(signal, sys.argv[2]))
spec = importlib.util.spec_from_file_location("netns", sys.argv[1])
netns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netns)
with netns.SimulatedHosts([1, 1], rate="1gbit") as hosts:
    sleeper = hosts.popen(1, ["sleep", "600"])
    print(hosts.prefix, sleeper.pid, hosts.holder_pid(0), hosts.holder_pid(1), flush=True)
    time.sleep(600)
"""


@needs_hosts
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_creator_signalled(sig: signal.Signals) -> None:
    """SIGTERM/SIGINT: the creator tears down before it ends. SIGKILL: what it
    left is removed by the next creator's sweep."""
    creator = _start_creator("default_int_handler")
    try:
        prefix, pids = _created(creator)
        creator.send_signal(sig)
        creator.wait(30)
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()
    if sig == signal.SIGKILL:
        left = _our_namespaces(prefix)
        assert len(left) == 3  # nobody cleaned up
        assert {n for n in netns.sweep_stale() if n.startswith(prefix)} == set(left)
    else:
        assert creator.returncode in (-sig, 128 + sig, 1), creator.returncode  # SIGINT: KeyboardInterrupt
    assert _our_namespaces(prefix) == []
    assert not list(Path("/etc/netns").glob(f"{prefix}*"))
    deadline = time.monotonic() + 10
    while [p for p in pids if not _gone(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if not _gone(p)] == []


@needs_hosts
def test_creator_ignoring_sigint() -> None:
    """A creator that ignores SIGINT keeps its hosts through one; SIGTERM
    still tears them down."""
    creator = _start_creator("SIG_IGN")
    try:
        prefix, _ = _created(creator)
        creator.send_signal(signal.SIGINT)
        time.sleep(1)
        assert creator.poll() is None
        assert len(_our_namespaces(prefix)) == 3
        creator.send_signal(signal.SIGTERM)
        creator.wait(30)
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()
    assert creator.returncode == -signal.SIGTERM, creator.returncode
    assert _our_namespaces(prefix) == []


def _start_creator(sigint: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CREATOR, netns.__file__, sigint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _created(creator: subprocess.Popen) -> tuple[str, list[int]]:
    """The creator's namespace prefix and the pids it printed, once its three namespaces are up."""
    line = creator.stdout.readline().split() if creator.stdout else []
    assert len(line) == 4, (line, creator.stderr.read() if creator.stderr else "")
    prefix, pids = line[0], [int(p) for p in line[1:]]
    assert len(_our_namespaces(prefix)) == 3
    return prefix, pids


def test_refuses_without_root_or_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs everywhere: the refusal says what is missing, before anything is made."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")
    with pytest.raises(RuntimeError, match=r"need root and iproute2.*not root.*missing tools: tc"):
        with SimulatedHosts([1, 1]):
            pass
