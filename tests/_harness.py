"""Run a function on real ranks: separate processes on 127.0.0.1, a free port,
a hard timeout, and every rank's traceback reported when one fails."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import random
import socket
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable

RANK_TIMEOUT_S = float(os.environ.get("GROUPCOMM_TEST_TIMEOUT", "240"))
# Ranks are forked from multiprocessing's fork server, a process of its own
# that imports torch once: a spawned rank imports torch anew (a set of 2-4
# ranks took 3-10 s to start on two cores, a forked set 0.1-0.3 s). The server
# runs nothing else, so each rank still starts from a clean process.
mp.set_forkserver_preload(["torch", "torch.distributed"])
GROUP_TIMEOUT = timedelta(seconds=60)
# For tests that time how fast a failure surfaces: torch 2.15 attaches its
# flight recorder to every group and, at the first failure or timeout, writes
# the recorder's dump on the failing op's thread before the error reaches the
# caller (1-4 s here), which would be timed instead of our detection. The
# recorder stays on; tests/test_flight_recorder.py covers the dump.
NO_FR_DUMP = {"TORCH_FR_DUMP_ON_TIMEOUT": "0"}


def _ephemeral_ports() -> range:
    """The ports the kernel hands out to connecting sockets (and to bind(0))."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port() -> int:
    """A port free now and outside the ephemeral range: a port bind(0) picked
    could be taken, before a rank listens on it, by the local end of one of the
    many connections the ranks open meanwhile (the store's, gloo's)."""
    ephemeral = _ephemeral_ports()
    low, high = (10000, ephemeral.start) if ephemeral.start > 11000 else (ephemeral.stop, 65536)
    for _ in range(200 if high - low > 100 else 0):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, backend, port, environ, env, args, group_timeout, conn, crash_log) -> None:
    # a fatal signal leaves every thread's Python stack here for the parent
    faulthandler.enable(open(crash_log, "w"), all_threads=True)  # noqa: SIM115 - open until the process ends
    os.environ.clear()  # the caller's environment now, not the fork server's
    os.environ.update(environ)
    os.environ.update({k: v[rank] if isinstance(v, (list, tuple)) else v for k, v in env.items()})
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.set_debug_level_from_env()  # torch read it at import, before our env was set
        if os.environ.get("GROUPCOMM_TEST_NO_IMPORT") != "1":
            import torch_groupcomm  # noqa: F401
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=group_timeout,
            )
        result = fn(rank, world_size, *args)
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    backend: str | None = "groupcomm",
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout: float = RANK_TIMEOUT_S,
    group_timeout: timedelta = GROUP_TIMEOUT,
    may_die: Sequence[int] = (),
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks after
    ``init_process_group(backend)`` (skipped when backend is None); return each
    rank's result, or raise with every failing rank's traceback. An ``env``
    value that is a list gives each rank its own value. Ranks listed
    in ``may_die`` may exit without a result (their result is None).
    ``fresh=True`` spawns the ranks instead of forking them from the fork
    server, for tests of how a process ends: a forked rank leaves through
    ``os._exit`` (no atexit handlers, no interpreter finalization)."""
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    port = free_port()
    pipes, procs, crash_logs = [], [], []
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            fd, crash_log = tempfile.mkstemp(prefix=f"groupcomm-rank{rank}-", suffix=".log")
            os.close(fd)
            crash_logs.append(crash_log)
            rank_args = (fn, rank, world_size, backend, port, dict(os.environ), dict(env or {}), args, group_timeout)
            proc = ctx.Process(target=_rank_main, args=(*rank_args, child, crash_log), daemon=False)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        return _collect(pipes, procs, crash_logs, timeout, may_die)
    finally:
        for crash_log in crash_logs:
            with contextlib.suppress(OSError):
                os.unlink(crash_log)


def _died(proc: mp.process.BaseProcess, crash_log: str) -> str:
    """How a rank that sent no result ended: its exit code and, after a fatal
    signal, the stacks faulthandler left."""
    proc.join(5)
    code = proc.exitcode
    how = "still running" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"
    with open(crash_log, errors="replace") as f:
        dump = f.read().strip()
    return f"rank exited without a result ({how})" + (f"\n{dump}" if dump else "")


def _collect(pipes, procs, crash_logs, timeout: float, may_die: Sequence[int]) -> list[Any]:
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    failures = []
    deadline = time.monotonic() + timeout
    for rank, (pipe, proc) in enumerate(zip(pipes, procs)):
        if pipe.poll(max(0.0, deadline - time.monotonic())):
            try:
                status, payload = pipe.recv()
            except EOFError:
                status, payload = ("ok", None) if rank in may_die else ("error", _died(proc, crash_logs[rank]))
        else:
            status, payload = "error", f"no result within {timeout:.0f}s (hang?)"
        if status == "ok":
            results[rank] = payload
        else:
            failures.append(f"--- rank {rank} ---\n{payload}")
    for rank, proc in enumerate(procs):
        proc.join(10 if not failures else 1)
        if proc.is_alive():
            proc.kill()
            proc.join()
        elif proc.exitcode != 0 and rank not in may_die and not failures:
            # a crash on the way out (after the result was sent) is a failure too
            failures.append(f"--- rank {rank} ---\nexited with code {proc.exitcode} after its result")
    if failures:
        raise AssertionError("\n".join(failures))
    return results


def shm_segments() -> list[str]:
    """Our shared-memory segments currently visible in /dev/shm."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("groupcomm-"))
    except FileNotFoundError:
        return []


# CPU paths the correctness suites run on: (id, backend, world, env, communicator)
CPU_PATHS = [
    ("shm-1", "groupcomm", 1, {}, "shm"),
    ("shm-2", "groupcomm", 2, {}, "shm"),
    ("shm-3", "groupcomm", 3, {}, "shm"),
    ("shm-4", "groupcomm", 4, {}, "shm"),
    ("cpu-only-2", "cpu:groupcomm", 2, {}, "shm"),
    ("gloo-2", "groupcomm", 2, {"GROUPCOMM_CPU_COMMUNICATOR": "gloo"}, "gloo"),
    ("gloo-3", "groupcomm", 3, {"GROUPCOMM_CPU_COMMUNICATOR": "gloo"}, "gloo"),
    ("chunked-3", "groupcomm", 3, {"GROUPCOMM_SHM_CHUNK_BYTES": "4096", "GROUPCOMM_SPIN_US": "0"}, "shm"),
    ("hosts-aabb", "groupcomm", 4, {"GROUPCOMM_HOST_ID": ["a", "a", "b", "b"]}, "hierarchical"),
    ("hosts-abab", "groupcomm", 4, {"GROUPCOMM_HOST_ID": ["a", "b", "a", "b"]}, "hierarchical"),
    ("hosts-aab", "groupcomm", 3, {"GROUPCOMM_HOST_ID": ["a", "a", "b"]}, "hierarchical"),
    ("hosts-aabc", "groupcomm", 4, {"GROUPCOMM_HOST_ID": ["a", "a", "b", "c"]}, "hierarchical"),
]


def on_cpu_paths(*ids: str):
    """``pytest.mark.parametrize`` over the CPU_PATHS named ``ids``, as
    (backend, world, env, communicator)."""
    import pytest

    chosen = [p for p in CPU_PATHS if p[0] in ids]
    return pytest.mark.parametrize(
        "backend,world,env,communicator", [p[1:] for p in chosen], ids=[p[0] for p in chosen]
    )


def assert_cpu_communicator(expected: str) -> None:
    """Inside a rank: the default group's CPU traffic uses ``expected``, and
    no segment of ours is left in /dev/shm once the communicator exists."""
    import torch

    from torch_groupcomm import get_coordinator

    coordinator = get_coordinator()
    comm = coordinator.communicator_for(torch.device("cpu"))
    assert comm.name == expected, f"CPU communicator is {comm.name}, expected {expected}"
    assert coordinator.p2p_communicator_for(torch.device("cpu")) is comm, "send/recv bypass the CPU communicator"
    assert shm_segments() == [], shm_segments()


def last_rank_dies(
    rank: int, world: int, op: Callable[[], None], words: Sequence[str] = ("exited",), within_s: float = 10
) -> str:
    """Inside a rank: the last rank kills itself (SIGKILL), the others run
    ``op`` until it raises a GroupCommError naming one of ``words``, which
    must happen within ``within_s`` seconds. Returns "raised"."""
    import signal

    from torch_groupcomm import GroupCommError

    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100000):
            op()
    except GroupCommError as exc:
        assert any(w in str(exc) for w in words), str(exc)
    else:
        raise AssertionError("collectives kept working with a killed peer")
    assert time.monotonic() - start < within_s, time.monotonic() - start
    return "raised"


@contextlib.contextmanager
def frontend_calls(names: Sequence[str]):
    """Inside a rank: the names of the C10dFrontend methods among ``names``
    that are called inside the block, in order (what reached Python)."""
    from torch_groupcomm.c10d.frontend import C10dFrontend

    entered: list[str] = []
    saved = {name: getattr(C10dFrontend, name) for name in names}

    def watched(name, method):
        def call(self, *args, **kwargs):
            entered.append(name)
            return method(self, *args, **kwargs)

        return call

    for name, method in saved.items():
        setattr(C10dFrontend, name, watched(name, method))
    try:
        yield entered
    finally:
        for name, method in saved.items():
            setattr(C10dFrontend, name, method)
