"""GROUPCOMM_DEBUG=1: ranks that pass different things to one collective all
raise a GroupCommError naming the mismatching ranks and each rank's call,
instead of hanging or exchanging garbage; matching calls run as usual."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import run_ranks
from test_errors import _raises, check_argument_errors

DEBUG = {"GROUPCOMM_DEBUG": "1"}
PATHS = [("shm-3", DEBUG), ("gloo-3", {**DEBUG, "GROUPCOMM_CPU_COMMUNICATOR": "gloo"})]


def test_debug_is_off_by_default(monkeypatch) -> None:
    from torch_groupcomm import config

    monkeypatch.delenv("GROUPCOMM_DEBUG", raising=False)
    assert config.load().debug is False
    assert config.Config().debug is False
    for raw, expected in (("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("GROUPCOMM_DEBUG", raw)
        assert config.load().debug is expected, raw


def test_debug_rejects_invalid_value(monkeypatch) -> None:
    from torch_groupcomm import config

    monkeypatch.setenv("GROUPCOMM_DEBUG", "banana")
    _raises(config.load, ValueError, "GROUPCOMM_DEBUG", "banana")


def _usable(rank: int, world: int, group=None) -> None:
    size = dist.get_world_size(group)
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=group)
    expected = float(sum(range(world))) if group is None else float(sum(dist.get_process_group_ranks(group)))
    assert torch.equal(t, torch.full((5,), expected)), (size, t)


def _mismatch(rank: int, world: int, fn, *fragments: str) -> str:
    """``fn`` must raise GroupCommError containing ``fragments`` on this rank;
    the group must work afterwards."""
    from torch_groupcomm import GroupCommError

    def call() -> None:
        work = fn()
        if work is not None:
            work.wait()

    _raises(call, GroupCommError, "GROUPCOMM_DEBUG", f"rank {rank} of ", *fragments)
    _usable(rank, world)
    return "ok"


def check_mismatches(rank: int, world: int) -> None:
    assert world == 3
    R = dist.ReduceOp
    # shapes
    _mismatch(
        rank,
        world,
        lambda: dist.all_reduce(torch.ones(5 if rank == 2 else 4)),
        "allreduce",
        "group '0'",
        "mismatching: rank 2",
        "ranks 0, 1: allreduce SUM float32 [4]; rank 2: allreduce SUM float32 [5]",
    )
    # dtypes, asynchronously
    _mismatch(
        rank,
        world,
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32), async_op=True),
        "mismatching: rank 0",
        "rank 0: allreduce SUM float64 [4]",
        "ranks 1, 2: allreduce SUM float32 [4]",
    )
    # reduce ops
    _mismatch(
        rank,
        world,
        lambda: dist.all_reduce(torch.ones(3), op=R.MAX if rank == 1 else R.SUM),
        "mismatching: rank 1",
        "rank 1: allreduce MAX float32 [3]",
    )
    _mismatch(
        rank,
        world,
        lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(6), op=R.MIN if rank == 2 else R.SUM),
        "mismatching: rank 2",
        "_reduce_scatter_base MIN float32 [6] -> float32 [2]",
    )
    # roots
    _mismatch(
        rank,
        world,
        lambda: dist.broadcast(torch.ones(2), src=1 if rank == 2 else 0),
        "mismatching: rank 2",
        "ranks 0, 1: broadcast root 0 float32 [2]",
        "rank 2: broadcast root 1 float32 [2]",
    )
    _mismatch(
        rank,
        world,
        lambda: dist.reduce(torch.ones(2), dst=2 if rank == 0 else 1, async_op=True),
        "mismatching: rank 0",
        "rank 0: reduce SUM root 2",
    )
    # different ops
    _mismatch(
        rank,
        world,
        lambda: dist.all_reduce(torch.ones(4)) if rank == 0 else dist.broadcast(torch.ones(4), src=0),
        "mismatching: rank 0",
        "rank 0: allreduce SUM float32 [4]",
        "ranks 1, 2: broadcast root 0 float32 [4]",
    )
    _mismatch(
        rank,
        world,
        lambda: dist.barrier() if rank == 1 else dist.all_gather_into_tensor(torch.empty(6), torch.ones(2)),
        "mismatching: rank 1",
        "rank 1: barrier",
        "_allgather_base float32 [2] -> float32 [6]",
    )
    # output sizes
    _mismatch(
        rank,
        world,
        lambda: dist.all_gather([torch.empty(3 if rank == 1 and i == 0 else 2) for i in range(world)], torch.ones(2)),
        "mismatching: rank 1",
        "allgather into [float32 [3], float32 [2], float32 [2]]",
    )
    # all_to_all sizes that do not pair up: rank 0 sends 2 elements to rank 1, which expects 1
    _mismatch(
        rank,
        world,
        lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3), [1, 1, 1], [1, 2, 0] if rank == 0 else [1, 1, 1]),
        "all-to-all sizes do not match",
        "rank 0 sends 2 elements to rank 1, which expects 1",
        "rank 0 sends 0 elements to rank 2, which expects 1",
        "mismatching: ranks 0, 1, 2",
        "alltoall_base float32 input [3] splits [1, 2, 0]",
    )
    _mismatch(
        rank,
        world,
        lambda: dist.all_to_all(
            [torch.empty(1) for _ in range(world)],
            [torch.ones(2 if rank == 2 and i == 0 else 1) for i in range(world)],
            async_op=True,
        ),
        "rank 2 sends 2 elements to rank 0, which expects 1",
        "mismatching: ranks 0, 2",
    )
    # a call one rank refuses (its gather list is too short): the others are told
    outputs = [torch.empty(2) for _ in range(world - 1)] if rank == 0 else None
    if rank == 0:
        _raises(lambda: dist.gather(torch.ones(2), outputs, dst=0), ValueError, "gather", "list of 3")
        _usable(rank, world)
    else:
        _mismatch(
            rank,
            world,
            lambda: dist.gather(torch.ones(2), outputs, dst=0),
            "mismatching: rank 0",
            "rank 0: gather root 0 float32 [2]",
            "refused there: ValueError",
        )
    # a subgroup names its global ranks
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        from torch_groupcomm import GroupCommError

        _raises(
            lambda: dist.all_reduce(torch.ones(2 + rank), group=sub),
            GroupCommError,
            "global ranks [0, 2]",
            "ranks 0, 1",
            "float32 [2]",
            "float32 [4]",
        )
        _usable(rank, world, sub)
    _usable(rank, world)


@pytest.mark.parametrize("path,env", PATHS, ids=[p for p, _ in PATHS])
def test_mismatches_raise_everywhere(path: str, env: dict) -> None:
    run_ranks(check_mismatches, 3, env=env, group_timeout=timedelta(seconds=30))


def check_matching_calls(rank: int, world: int) -> None:
    def ar(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    total = float(sum(range(world)))
    assert torch.equal(ar(torch.full((4,), float(rank))), torch.full((4,), total))
    tensors = [torch.full((3,), float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        assert torch.equal(t, torch.full((3,), total + world * i))
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=1)
    assert torch.equal(t, torch.full((2,), 1.0))
    t = torch.full((2,), float(rank + 1))
    dist.reduce(t, dst=2, op=dist.ReduceOp.PRODUCT, async_op=True).wait()
    if rank == 2:
        assert torch.equal(t, torch.full((2,), 6.0))
    # uneven all_gather: rank r contributes r + 1 elements
    outs = [torch.empty(r + 1) for r in range(world)]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)))
    assert all(torch.equal(o, torch.full((r + 1,), float(r))) for r, o in enumerate(outs))
    out = torch.empty(world * 2)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), async_op=True).wait()
    assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(world * 2, dtype=torch.float32))
    assert out.tolist() == [world * 2.0 * rank, world * (2.0 * rank + 1)]
    # uneven reduce_scatter: rank r receives r + 1 elements
    out = torch.empty(rank + 1)
    dist.reduce_scatter(out, [torch.ones(r + 1) for r in range(world)])
    assert torch.equal(out, torch.full((rank + 1,), float(world)))
    gathered = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0)
    if rank == 0:
        assert [g[0].item() for g in gathered] == list(range(world))
    out = torch.empty(2)
    dist.scatter(out, [torch.full((2,), float(r)) for r in range(world)] if rank == 1 else None, src=1)
    assert torch.equal(out, torch.full((2,), float(rank)))
    # uneven all_to_all_single: rank r sends r + 1 elements to each peer
    out = torch.empty(sum(r + 1 for r in range(world)))
    dist.all_to_all_single(
        out, torch.full((world * (rank + 1),), float(rank)), [r + 1 for r in range(world)], [rank + 1] * world
    )
    assert out.tolist() == [float(r) for r in range(world) for _ in range(r + 1)]
    outs = [torch.empty(1) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((1,), float(rank * 10 + r)) for r in range(world)], async_op=True).wait()
    assert [o.item() for o in outs] == [float(r * 10 + rank) for r in range(world)]
    dist.barrier()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * rank})
    assert [o["rank"] for o in objs] == list(range(world))
    # send/recv are not checked and still pair up
    t = torch.full((3,), float(rank))
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
        assert torch.equal(t, torch.zeros(3))


@pytest.mark.parametrize("path,env", PATHS, ids=[p for p, _ in PATHS])
def test_matching_calls_pass(path: str, env: dict) -> None:
    run_ranks(check_matching_calls, 3, env=env)


def test_argument_errors_in_debug_mode() -> None:
    # every rank refuses the same bad call: the checks agree, each rank raises its own error
    run_ranks(check_argument_errors, 3, env=DEBUG)
