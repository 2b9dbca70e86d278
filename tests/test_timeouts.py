"""Timeouts with gloo's semantics on every CPU path: c10d's per-op
``opts.timeout`` bounds that op only, ``dist.set_timeout`` (``ProcessGroup.
set_timeout`` on torch 2.13) changes the group's timeout for the ops issued
after it, and an op that runs out of time raises CommTimeoutError naming op,
group, rank and the timeout. (``Work.wait(timeout)``: tests/test_errors.py.)

A timed-out collective leaves its group out of step, as gloo's does, so each
case that times out runs on a group of its own."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _harness import on_cpu_paths, run_ranks
from torch._C import _distributed_c10d as c10d

ONE_SECOND = timedelta(seconds=1)


def _opts(cls, timeout=None):
    opts = cls()
    if timeout is not None:
        opts.timeout = timeout
    return opts


def _allreduce(backend, t, timeout=None):
    return backend.allreduce([t], _opts(c10d.AllreduceOptions, timeout))


def _allgather(backend, t, world, timeout=None):
    # a list all-gather always goes through Python, whatever the communicator
    outs = [[torch.empty_like(t) for _ in range(world)]]
    return backend.allgather(outs, [t], _opts(c10d.AllgatherOptions, timeout)), outs[0]


def _times_out(name: str, group_name: str, world: int, call, limit_ms: int) -> float:
    """Run ``call`` on rank 0 alone: it must raise CommTimeoutError naming the op,
    the group, rank 0 and ``limit_ms``; returns how long it took."""
    from torch_groupcomm import CommTimeoutError

    start = time.monotonic()
    try:
        call()
    except CommTimeoutError as exc:
        message = str(exc)
        assert f"{name} on group '{group_name}' (rank 0 of {world})" in message, message
        assert str(limit_ms) in message, message
        assert exc.op == name, (exc.op, name)
    else:
        raise AssertionError(f"{name} returned with every peer away")
    return time.monotonic() - start


def check_timeouts(rank: int, world: int) -> str:
    cpu = torch.device("cpu")
    full = float(world * (world + 1) // 2)

    # 1. an op's own timeout: honoured, then forgotten (the next op has the group's 60 s)
    group = dist.new_group(backend="groupcomm")
    backend = group._get_backend(cpu)
    t = torch.full((8,), float(rank + 1))
    _allreduce(backend, t, ONE_SECOND).wait()
    assert torch.equal(t, torch.full((8,), full)), t
    work, outs = _allgather(backend, torch.full((4,), float(rank)), world, ONE_SECOND)
    work.wait()
    assert [o[0].item() for o in outs] == [float(r) for r in range(world)]
    if rank != 0:
        time.sleep(2.5)  # rank 0 waits longer than 1 s on ops without a timeout of their own
    t = torch.full((8,), float(rank + 1))
    _allreduce(backend, t).wait()
    assert torch.equal(t, torch.full((8,), full)), t
    work, outs = _allgather(backend, torch.full((4,), float(rank)), world)
    work.wait()
    assert [o[0].item() for o in outs] == [float(r) for r in range(world)]

    # 2. ... and when the peers never come: the native all-reduce, then the Python path
    if rank == 0:
        took = _times_out(
            "allreduce", group.group_name, world, lambda: _allreduce(backend, torch.ones(8), ONE_SECOND).wait(), 1000
        )
        assert took < 5, took
    python_path = dist.new_group(backend="groupcomm")
    if rank == 0:
        took = _times_out(
            "allgather",
            python_path.group_name,
            world,
            lambda: _allgather(python_path._get_backend(cpu), torch.ones(4), world, ONE_SECOND)[0].wait(),
            1000,
        )
        assert took < 5, took

    # 3. the group's timeout, changed after it was made
    changed = dist.new_group(backend="groupcomm")
    t = torch.ones(4)
    dist.all_reduce(t, group=changed)  # builds its communicators with the 60 s timeout
    set_timeout = getattr(dist, "set_timeout", None)  # torch 2.14+
    if set_timeout is not None:
        set_timeout(timedelta(milliseconds=1500), group=changed)
    else:
        changed.set_timeout(timedelta(milliseconds=1500))
    if rank == 0:
        took = _times_out(
            "allreduce", changed.group_name, world, lambda: dist.all_reduce(torch.ones(8), group=changed), 1500
        )
        assert took < 6, took
    dist.barrier()  # the default group is untouched
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    return "ok"


@on_cpu_paths("shm-2", "gloo-3", "hosts-aab")
def test_timeouts(backend: str, world: int, env: dict, communicator: str) -> None:
    assert run_ranks(check_timeouts, world, backend, env=env) == ["ok"] * world


def check_peers_fail_with_a_timed_out_rank(rank: int, world: int) -> float:
    """Rank 0 gives up on an all-reduce after 1 s (rank 2 is away): rank 1,
    waiting with the group's 30 s, fails at once and says why; rank 2, arriving
    3 s late, fails at once too (its first op may still complete when it needs
    nothing more from its peers than they had already put in: then its next
    one fails). On shared memory, a receive rank 1 posted from rank 0 fails
    too, within the progress thread's liveness check. Returns how long this
    rank took to fail."""
    from torch_groupcomm import CommTimeoutError, GroupCommError

    group = dist.new_group(backend="groupcomm", timeout=timedelta(seconds=30))
    backend = group._get_backend(torch.device("cpu"))
    t = torch.ones(8)
    _allreduce(backend, t).wait()  # the group's communicators exist
    shm = "GROUPCOMM_HOST_ID" not in os.environ
    pending = backend.recv([torch.empty(4)], 0, 99) if shm and rank == 1 else None
    if rank == 2:
        time.sleep(3)
    start = time.monotonic()
    failure = None
    for numel in (1024, 1 << 18, 1 << 18):
        try:
            _allreduce(backend, torch.ones(numel), ONE_SECOND if rank == 0 else None).wait()
        except GroupCommError as exc:
            failure = exc
            break
        assert rank == 2, f"rank {rank}: the all-reduce completed without rank 2"
    took = time.monotonic() - start
    assert failure is not None, f"rank {rank}: three all-reduces completed without rank 0"
    assert isinstance(failure, CommTimeoutError) == (rank == 0), (rank, failure)
    assert "timed out" in str(failure).lower(), str(failure)  # every rank's error says what went first
    if rank == 1:
        assert "peer rank 0" in str(failure), str(failure)
    if pending is not None:
        start = time.monotonic()
        try:
            pending.wait()
        except GroupCommError as exc:
            assert "peer rank 0 left the shared-memory group" in str(exc), str(exc)
            assert time.monotonic() - start < 2, time.monotonic() - start
        else:
            raise AssertionError("a receive from rank 0 completed after rank 0 gave up")
    dist.barrier()
    return took


@on_cpu_paths("shm-3", "hosts-aab")
def test_peers_of_a_timed_out_rank_fail_at_once(backend: str, world: int, env: dict, communicator: str) -> None:
    took = run_ranks(check_peers_fail_with_a_timed_out_rank, world, backend, env=env)
    assert took[0] < 5 and took[1] < 5 and took[2] < 2, took
