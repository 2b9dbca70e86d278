"""Coalescing: the backend says it supports it, so ``batch_isend_irecv`` and
``_coalescing_manager`` hand it a batch between startCoalescing and
endCoalescing; the batch's ops progress together and its one Work completes
when all of them have. A ring where every rank sends before it receives, and
a pipeline schedule where every stage sends both ways before receiving, with
messages larger than any buffer between two ranks, must never hang."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import on_cpu_paths, run_ranks

BIG = 1 << 18  # elements: 1 MiB of fp32, more than a send ring or a socket buffer holds


def _value(step: int, sender: int, kind: int) -> float:
    return float(step * 1000 + sender * 10 + kind)


def check_coalescing(rank: int, world: int) -> str:
    cpu = torch.device("cpu")
    assert dist.group.WORLD._get_backend(cpu).supports_coalescing
    nxt, prev = (rank + 1) % world, (rank - 1) % world

    # a ring: send to the next, receive from the previous, in one batch
    for n in (16, BIG):
        out = torch.full((n,), float(rank))
        into = torch.empty(n)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, into, prev)])
        assert len(works) == 1, works  # the batch's one Work
        for work in works:
            work.wait()
        assert torch.equal(into, torch.full((n,), float(prev))), (n, into[:4])

    # a pipeline's steady state: each stage sends its activation forward and its
    # gradient back, then receives both (every stage sends before it receives)
    for step in range(4):
        ops, act, grad = [], torch.empty(BIG), torch.empty(BIG)
        if rank + 1 < world:
            ops.append(dist.P2POp(dist.isend, torch.full((BIG,), _value(step, rank, 1)), rank + 1))
        if rank > 0:
            ops.append(dist.P2POp(dist.isend, torch.full((BIG,), _value(step, rank, 2)), rank - 1))
        if rank > 0:
            ops.append(dist.P2POp(dist.irecv, act, rank - 1))
        if rank + 1 < world:
            ops.append(dist.P2POp(dist.irecv, grad, rank + 1))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if rank > 0:
            assert torch.equal(act, torch.full((BIG,), _value(step, rank - 1, 1))), (step, act[:2])
        if rank + 1 < world:
            assert torch.equal(grad, torch.full((BIG,), _value(step, rank + 1, 2))), (step, grad[:2])

    # collectives in a coalescing manager: issued as one coalesced call, one Work for the batch
    a, b = torch.full((5,), float(rank + 1)), torch.full((7,), float(rank + 2))
    with dist._coalescing_manager(device=cpu, async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    total = float(world * (world + 1) // 2)
    assert torch.equal(a, torch.full((5,), total)) and torch.equal(b, torch.full((7,), total + world)), (a, b)

    # ops outside a batch are not held by it
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    return "ok"


@on_cpu_paths("shm-2", "gloo-3", "hosts-aabb")
def test_coalescing(backend: str, world: int, env: dict, communicator: str) -> None:
    assert run_ranks(check_coalescing, world, backend, env=env) == ["ok"] * world
