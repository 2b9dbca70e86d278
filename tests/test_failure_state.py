"""What c10d asks a backend about its ops and its health, on every CPU path:
``getError`` (SUCCESS until an op times out or fails), abort hooks (run once,
at the group's first failure; torch 2.14+), sequence numbers (one per
collective) and op durations once collectives timing is on."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from _harness import on_cpu_paths, run_ranks
from torch._C import _distributed_c10d as c10d


def _allreduce(backend, t, **fields):
    opts = c10d.AllreduceOptions()
    for key, value in fields.items():
        setattr(opts, key, value)
    return backend.allreduce([t], opts)


def _allgather(backend, t, world, **fields):
    opts = c10d.AllgatherOptions()
    for key, value in fields.items():
        setattr(opts, key, value)
    outs = [[torch.empty_like(t) for _ in range(world)]]
    return backend.allgather(outs, [t], opts), outs[0]


def check_failure_state(rank: int, world: int) -> str:
    from torch_groupcomm import CommTimeoutError, GroupCommError

    cpu = torch.device("cpu")
    group = dist.new_group(backend="groupcomm")
    backend = group._get_backend(cpu)
    has_hooks = hasattr(backend, "register_abort_hook")  # torch 2.14+
    has_error = hasattr(backend, "get_error")

    # sequence numbers count collectives, whichever path runs them
    start = backend._get_sequence_number_for_group()
    _allreduce(backend, torch.ones(4)).wait()  # native where the engine is shared memory
    _allgather(backend, torch.ones(2), world)[0].wait()  # Python
    dist.barrier(group=group)
    assert backend._get_sequence_number_for_group() == start + 3

    # durations, once timing is on (sync and async, native and Python)
    group._enable_collectives_timing()
    for work in (
        _allreduce(backend, torch.ones(1 << 16), asyncOp=False),
        _allreduce(backend, torch.ones(8)),
        _allgather(backend, torch.ones(2), world)[0],
    ):
        work.wait()
        assert 0 <= work._get_duration() < 60_000, work._get_duration()

    if has_error:
        assert backend.get_error() == c10d.ErrorType.SUCCESS
    calls = []
    if has_hooks:
        backend.register_abort_hook(7, lambda: calls.append("first"))
        backend.register_abort_hook(8, lambda: calls.append("removed"))
        backend.unregister_abort_hook(8)
    if rank == 0:  # alone: the op times out, the group has failed
        for failure in (CommTimeoutError, GroupCommError):  # the second one runs no hook again
            try:
                _allreduce(backend, torch.ones(8), timeout=timedelta(seconds=1)).wait()
            except failure:
                pass
            else:
                raise AssertionError("all_reduce returned with every peer away")
        if has_error:
            assert backend.get_error() == c10d.ErrorType.TIMEOUT, backend.get_error()
        if has_hooks:
            assert calls == ["first"], calls
    else:
        if has_error:
            assert backend.get_error() == c10d.ErrorType.SUCCESS
        assert calls == []

    # a failure on the Python path (a list all-gather) is seen the same way
    python_path = dist.new_group(backend="groupcomm")
    other = python_path._get_backend(cpu)
    if has_hooks:
        other.register_abort_hook(1, lambda: calls.append("python"))
    if rank == 0:
        try:
            _allgather(other, torch.ones(2), world, timeout=timedelta(seconds=1))[0].wait()
        except CommTimeoutError:
            pass
        else:
            raise AssertionError("all_gather returned with every peer away")
        if has_error:
            assert other.get_error() == c10d.ErrorType.TIMEOUT
        if has_hooks:
            assert calls == ["first", "python"], calls
    dist.barrier()
    return "ok"


@on_cpu_paths("shm-2", "gloo-3", "hosts-aab")
def test_failure_state(backend: str, world: int, env: dict, communicator: str) -> None:
    assert run_ranks(check_failure_state, world, backend, env=env) == ["ok"] * world
