"""One rank of a group spread over simulated hosts (tests/test_hosts.py starts
it inside torch_groupcomm.bench.netns.SimulatedHosts with torch's env://
rendezvous). ``HOSTS_LAYOUT`` is the ranks per host, e.g. "2,2".

    python tests/hosts_rank.py collectives   every collective against closed-form values
    python tests/hosts_rank.py dies          the last rank sleeps until killed; the others wait in all_reduce

Prints one result line ("rank R ok ..."); exits non-zero on a wrong value.
"""

from __future__ import annotations

import functools
import operator
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_groupcomm
from torch_groupcomm import GroupCommError

SIZES = (7, 16387, 1 << 20)  # 16387 float32: just past the rails' 64 KiB, split unevenly
# What the dying rank's peers must see: an error, within the group's timeout and a margin.
DIES_TIMEOUT_S = 10.0
DIES_MARGIN_S = 5.0


def layout() -> list[list[int]]:
    """The global ranks of each host, numbered host by host."""
    counts = [int(n) for n in os.environ["HOSTS_LAYOUT"].split(",")]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(range(s, s + n)) for s, n in zip(starts, counts)]


def check(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
        bad = (got != expected).nonzero()[:3].flatten().tolist() if got.shape == expected.shape else "shape"
        raise AssertionError(
            f"{what}: wrong result (dtype {got.dtype}, shape {tuple(got.shape)}; first bad {bad}); "
            f"got {got.flatten()[:5].tolist()}, expected {expected.flatten()[:5].tolist()}"
        )


def pattern(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0..n-1 kept small, so that every value and partial sum here is exact in float32."""
    return (torch.arange(n) % 1024).to(dtype)


def all_reduces(rank: int, world: int, n: int) -> None:
    a = pattern(n)
    ranks = range(world)
    cases = [
        ("sum float32", dist.ReduceOp.SUM, a * (rank + 1), a * sum(r + 1 for r in ranks)),
        ("sum float64", dist.ReduceOp.SUM, a.double() - rank, a.double() * world - sum(ranks)),
        (
            "sum bfloat16",
            dist.ReduceOp.SUM,
            (pattern(n) % 8).bfloat16() * (rank + 1),
            (pattern(n) % 8).bfloat16() * sum(r + 1 for r in ranks),
        ),
        ("sum int32", dist.ReduceOp.SUM, a.int() + rank, a.int() * world + sum(ranks)),
        (
            "product float64",
            dist.ReduceOp.PRODUCT,
            (a.double() % 3 + 1) * (rank + 1),
            (a.double() % 3 + 1) ** world * float(functools.reduce(operator.mul, (r + 1 for r in ranks))),
        ),
        ("min int32", dist.ReduceOp.MIN, a.int() + rank, a.int()),
        ("max float32", dist.ReduceOp.MAX, a - rank, a.clone()),
        ("avg float32", dist.ReduceOp.AVG, a + 2 * rank, a + (world - 1)),
        (
            "bxor int64",
            dist.ReduceOp.BXOR,
            a.long() * (rank + 1),
            functools.reduce(operator.xor, (a.long() * (r + 1) for r in ranks)),
        ),
        ("bor int64", dist.ReduceOp.BOR, torch.full((n,), 1 << rank, dtype=torch.int64), torch.full((n,), (1 << world) - 1, dtype=torch.int64)),
        ("band uint8", dist.ReduceOp.BAND, torch.full((n,), 0xFF ^ (1 << rank), dtype=torch.uint8), torch.full((n,), 0xFF ^ ((1 << world) - 1), dtype=torch.uint8)),
    ]  # fmt: skip
    for what, op, mine, expected in cases:
        dist.all_reduce(mine, op=op)
        check(f"all_reduce {what} n={n}", mine, expected)


def collectives(rank: int, world: int, n: int, hosts: list[list[int]]) -> None:
    a = pattern(n)
    all_reduces(rank, world, n)

    root = hosts[-1][-1]
    t = a + rank
    dist.reduce(t, dst=root)
    if rank == root:
        check(f"reduce to {root} n={n}", t, a * world + sum(range(world)))

    for src in [ranks[-1] for ranks in hosts]:  # a root on each host
        t = a + 10 * src if rank == src else torch.zeros(n)
        dist.broadcast(t, src=src)
        check(f"broadcast from {src} n={n}", t, a + 10 * src)

    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, a + 10 * rank)
    check(f"all_gather_into_tensor n={n}", out, torch.cat([a + 10 * r for r in range(world)]))

    # Uneven: rank r contributes n + r elements.
    outs = [torch.empty(n + r) for r in range(world)]
    dist.all_gather(outs, pattern(n + rank) + 10 * rank)
    for r in range(world):
        check(f"uneven all_gather from {r} n={n}", outs[r], pattern(n + r) + 10 * r)

    out = torch.empty(n)
    full = pattern(world * n)
    dist.reduce_scatter_tensor(out, full * (rank + 1))
    check(f"reduce_scatter_tensor n={n}", out, full[rank * n : (rank + 1) * n] * sum(r + 1 for r in range(world)))

    dst = hosts[0][-1]
    gathered = [torch.empty(n) for _ in range(world)] if rank == dst else None
    dist.gather(a + 10 * rank, gathered, dst=dst)
    if rank == dst:
        for r in range(world):
            check(f"gather to {dst} from {r} n={n}", gathered[r], a + 10 * r)

    src = hosts[-1][0]
    out = torch.empty(n)
    dist.scatter(out, [a + 10 * r for r in range(world)] if rank == src else None, src=src)
    check(f"scatter from {src} n={n}", out, a + 10 * rank)

    # Even all_to_all: rank r's chunk j is 100 * r + j.
    out = torch.empty(world * n)
    dist.all_to_all_single(out, torch.cat([a + (100 * rank + j) for j in range(world)]))
    check(f"all_to_all_single n={n}", out, torch.cat([a + (100 * i + rank) for i in range(world)]))

    # Uneven: rank r sends (r + j + 1) * m elements to rank j.
    m = max(1, n // (4 * world))
    sends = [(rank + j + 1) * m for j in range(world)]
    recvs = [(i + rank + 1) * m for i in range(world)]
    out = torch.empty(sum(recvs))
    dist.all_to_all_single(out, torch.cat([pattern(c) + 100 * rank + j for j, c in enumerate(sends)]), recvs, sends)
    expected = torch.cat([pattern(c) + 100 * i + rank for i, c in enumerate(recvs)])
    check(f"uneven all_to_all_single n={n}", out, expected)

    # send/recv between the first and the last host, local rank i with local rank i.
    for lo, hi in zip(hosts[0], hosts[-1]):
        if rank == lo:
            dist.send(a + lo, dst=hi)
            t = torch.empty(n)
            dist.recv(t, src=hi)
            check(f"recv from {hi} n={n}", t, a + hi)
        elif rank == hi:
            t = torch.empty(n)
            dist.recv(t, src=lo)
            check(f"recv from {lo} n={n}", t, a + lo)
            dist.send(a + hi, dst=lo)

    dist.barrier()


def main(mode: str) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = layout()
    host = next(i for i, ranks in enumerate(hosts) if rank in ranks)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=DIES_TIMEOUT_S if mode == "dies" else 120)
    dist.init_process_group("groupcomm", timeout=timeout)
    assert socket.gethostname() == f"gchost{host}", socket.gethostname()
    coordinator = torch_groupcomm.get_coordinator(dist.group.WORLD)
    comm = coordinator.communicator_for(torch.device("cpu"))
    expected = "gloo" if all(len(ranks) == 1 for ranks in hosts) else "hierarchical"
    assert comm.name == expected, f"CPU tensors go through {comm.name}, not {expected}"
    assert coordinator.topology.hosts == hosts, f"discovered {coordinator.topology.hosts}, expected {hosts}"
    if len(hosts) > 1 and {len(ranks) for ranks in hosts} == {3}:
        # even all_to_all_singles of 256 KiB and more go per pair of hosts
        assert comm.rail_all_to_all_min_bytes == 256 << 10, "all_to_all_single is not taken per pair of hosts"

    if mode == "collectives":
        start = time.monotonic()
        for n in SIZES:
            collectives(rank, world, n, hosts)
        print(f"rank {rank} ok collectives host {host} in {time.monotonic() - start:.1f}s", flush=True)
        dist.destroy_process_group()
        return 0

    # mode == "dies": the last rank waits to be killed (the test SIGKILLs it once everyone has warmed up).
    dist.all_reduce(torch.ones(SIZES[0]))
    print(f"rank {rank} warm", flush=True)
    if rank == world - 1:
        time.sleep(600)
        return 1
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(SIZES[0]))
    except (GroupCommError, RuntimeError) as exc:
        elapsed = time.monotonic() - start
        message = str(exc).replace("\n", " ")
        assert "all_reduce" in message or "allreduce" in message, message
        assert elapsed < DIES_TIMEOUT_S + DIES_MARGIN_S, f"raised after {elapsed:.1f}s: {message}"
        print(f"rank {rank} ok raised after {elapsed:.1f}s: {type(exc).__name__}: {message[:300]}", flush=True)
        return 0
    print(f"rank {rank} FAILED: all_reduce returned with a killed peer", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "collectives"))
