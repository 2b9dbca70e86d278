"""Every data-moving collective, point-to-point op, object collective,
coalesced and functional path, checked against plain torch math and gloo."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _harness import CPU_PATHS, assert_cpu_communicator, frontend_calls, run_ranks, shm_segments
from _reference import assert_close, make_input

MOVE_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64]


def _inputs(world, dtype, n, seed=0):
    return [make_input(r, dtype, n, seed) for r in range(world)]


def check_data_movement(rank: int, world: int) -> None:
    for dtype in MOVE_DTYPES:
        tag = str(dtype)
        for n in (0, 1, 1000):
            xs = _inputs(world, dtype, n)
            for root in range(world):
                t = xs[rank].clone()
                dist.broadcast(t, src=root)
                assert_close(t, xs[root], f"broadcast root={root} n={n} {tag}")
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, xs[rank])
            for r in range(world):
                assert_close(outs[r], xs[r], f"all_gather n={n} {tag}")
            out = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, xs[rank])
            assert_close(out, torch.cat(xs), f"all_gather_into_tensor n={n} {tag}")
            root = world - 1
            gathered = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(xs[rank], gathered, dst=root)
            if rank == root:
                for r in range(world):
                    assert_close(gathered[r], xs[r], f"gather n={n} {tag}")
            if hasattr(dist, "gather_single"):  # torch 2.14+
                flat = torch.empty(world, n, dtype=dtype) if rank == root else None
                dist.gather_single(xs[rank], flat, dst=root)
                if rank == root:
                    assert_close(flat, torch.stack(xs), f"gather_single n={n} {tag}")
            pieces = [make_input(99, dtype, n, seed=r) for r in range(world)]
            out = torch.empty(n, dtype=dtype)
            dist.scatter(out, pieces if rank == 0 else None, src=0)
            assert_close(out, pieces[rank], f"scatter n={n} {tag}")
        # uneven all_gather (sizes differ per rank), which gloo does not offer
        sizes = [r + 2 for r in range(world)]
        xs = [make_input(r, dtype, sizes[r]) for r in range(world)]
        outs = [torch.empty(s, dtype=dtype) for s in sizes]
        dist.all_gather(outs, xs[rank])
        for r in range(world):
            assert_close(outs[r], xs[r], f"all_gather uneven {tag}")
        # all_to_all_single, even then uneven splits (rows of 3 columns)
        rows = 2 * world
        mats = [make_input(r, dtype, rows * 3, seed=3).view(rows, 3) for r in range(world)]
        out = torch.empty(rows, 3, dtype=dtype)
        dist.all_to_all_single(out, mats[rank])
        want = torch.cat([mats[r][2 * rank : 2 * rank + 2] for r in range(world)])
        assert_close(out, want, f"all_to_all_single even {tag}")
        split = lambda src, dst: (src + 2 * dst) % 3  # rows rank src sends to rank dst
        in_splits = [split(rank, d) for d in range(world)]
        out_splits = [split(s, rank) for s in range(world)]
        mats = [
            make_input(r, dtype, sum(split(r, d) for d in range(world)) * 3, seed=4).view(-1, 3) for r in range(world)
        ]
        out = torch.empty(sum(out_splits), 3, dtype=dtype)
        dist.all_to_all_single(out, mats[rank], out_splits, in_splits)
        want = torch.cat([mats[s].split([split(s, d) for d in range(world)])[rank] for s in range(world)])
        assert_close(out, want, f"all_to_all_single uneven {tag}")
        # all_to_all with lists of different sizes
        ins = [make_input(rank, dtype, rank + d + 1, seed=d) for d in range(world)]
        outs = [torch.empty(s + rank + 1, dtype=dtype) for s in range(world)]
        dist.all_to_all(outs, ins)
        for s in range(world):
            assert_close(outs[s], make_input(s, dtype, s + rank + 1, seed=rank), f"all_to_all list {tag}")


def check_non_contiguous_and_async(rank: int, world: int) -> None:
    base = torch.arange(12.0).view(3, 4) + rank
    t = base.t()  # non-contiguous
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert_close(t, (torch.arange(12.0).view(3, 4) * world + sum(range(world))).t(), "all_reduce non-contiguous")
    t = (torch.arange(12.0).view(3, 4) + rank).t()
    dist.broadcast(t, src=0)
    assert_close(t, torch.arange(12.0).view(3, 4).t(), "broadcast non-contiguous")
    outs = [torch.empty(4, 3).t() for _ in range(world)]
    dist.all_gather(outs, (torch.arange(12.0).view(4, 3) + rank).t())
    for r in range(world):
        assert_close(outs[r], (torch.arange(12.0).view(4, 3) + r).t(), "all_gather non-contiguous output")
    # async ops: several in flight, completed in order, futures carry the outputs
    tensors = [torch.full((1000,), float(i + rank)) for i in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        assert w.is_completed() and w.is_success()
        assert_close(t, torch.full((1000,), float(i * world + sum(range(world)))), f"async all_reduce {i}")
        value = w.get_future().wait()
        assert isinstance(value, list) and value[0] is not None
        assert_close(value[0], t, "future value")
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert_close(fut.wait(), torch.full((3,), 2.0 * world), "future then")
    # a Work whose Python side was garbage-collected still completes
    import gc

    t = torch.ones(10)
    w = dist.all_reduce(t, async_op=True)
    gc.collect()
    w.wait()
    assert_close(t, torch.full((10,), float(world)), "all_reduce after gc")
    # an async op nobody waits for is still done before the next sync op
    t = torch.ones(4)
    dist.all_reduce(t, async_op=True)
    dist.barrier()
    assert_close(t, torch.full((4,), float(world)), "unwaited async all_reduce")
    w = dist.barrier(async_op=True)
    w.wait()
    check_sync_behind_async(rank, world)
    check_async_order_across_paths(rank, world)


def check_async_order_across_paths(rank: int, world: int) -> None:
    """Async ops the bridge runs in C++ (dense all_reduce, all_gather_into_tensor)
    and ones Python runs (a strided tensor, PREMUL_SUM, list all_gather) share
    the group's one queue: issued interleaved, waited for in reverse, each gets
    its own turn's values; a Work nobody waits for still runs."""
    total = float(sum(range(world)))
    rounds = []
    for i in range(4):
        dense = torch.full((1 << 15,), float(rank + i))
        strided = torch.full((64, 2), float(rank + i))[:, 0]
        scaled = torch.full((8,), float(rank + 1))
        gathered = [torch.empty(4) for _ in range(world)]
        into = torch.empty(4 * world)
        works = [
            dist.all_reduce(dense, async_op=True),
            dist.all_reduce(strided, async_op=True),
            dist.all_reduce(scaled, op=dist._make_nccl_premul_sum(0.5), async_op=True),
            dist.all_gather(gathered, torch.full((4,), float(10 * rank + i)), async_op=True),
            dist.all_gather_into_tensor(into, torch.full((4,), float(rank - i)), async_op=True),
        ]
        rounds.append((i, dense, strided, scaled, gathered, into, works))
    for i, dense, strided, scaled, gathered, into, works in reversed(rounds):
        for w in reversed(works):
            w.wait()
            assert w.is_completed() and w.is_success()
        assert_close(dense, torch.full((1 << 15,), world * i + total), f"round {i}: native all_reduce")
        assert_close(strided, torch.full((64,), world * i + total), f"round {i}: strided all_reduce")
        assert_close(scaled, torch.full((8,), 0.5 * (total + world)), f"round {i}: PREMUL_SUM all_reduce")
        for r in range(world):
            assert_close(gathered[r], torch.full((4,), float(10 * r + i)), f"round {i}: all_gather from {r}")
        assert_close(into, (torch.arange(float(world)) - i).repeat_interleave(4), f"round {i}: all_gather_into_tensor")


def check_sync_behind_async(rank: int, world: int) -> None:
    """A synchronous call runs on the caller's thread only after the async ops
    queued before it: issued right behind large async all_reduces still in
    flight, every op gives the result of its own turn."""
    n, total = 3, float(sum(range(world)))
    src = torch.arange(float(world * n)) + 100 * rank
    checks = {
        "all_reduce": (lambda: _sync_all_reduce(rank), torch.full((n,), total)),
        "broadcast": (lambda: _sync_broadcast(rank, world), torch.full((n,), float(world - 1))),
        "reduce": (lambda: _sync_reduce(rank, total), torch.full((n,), total)),
        "all_gather_into_tensor": (
            lambda: _sync_all_gather(rank, world, n),
            torch.arange(float(world)).repeat_interleave(n),
        ),
        "reduce_scatter_tensor": (
            lambda: _sync_reduce_scatter(src, n),
            torch.arange(float(rank * n), float(rank * n + n)) * world + 100 * total,
        ),
        "all_to_all_single": (
            lambda: _sync_all_to_all(src),
            torch.cat([torch.arange(float(rank * n), float(rank * n + n)) + 100 * r for r in range(world)]),
        ),
        "barrier": (lambda: dist.barrier() or torch.zeros(0), torch.zeros(0)),
    }
    for name, (call, want) in checks.items():
        big = [torch.full((1 << 18,), float(rank + i)) for i in range(3)]
        works = [dist.all_reduce(b, async_op=True) for b in big]
        assert_close(call(), want, f"sync {name} behind async ops")
        for i, (w, b) in enumerate(zip(works, big)):
            w.wait()
            assert_close(
                b, torch.full((1 << 18,), float(world * i) + total), f"async all_reduce {i} before sync {name}"
            )


def _sync_all_reduce(rank):
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    return t


def _sync_broadcast(rank, world):
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    return t


def _sync_reduce(rank, total):
    t = torch.full((3,), float(rank))
    dist.reduce(t, dst=0)
    return t if rank == 0 else torch.full((3,), total)  # only the root's result is defined


def _sync_all_gather(rank, world, n):
    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, torch.full((n,), float(rank)))
    return out


def _sync_reduce_scatter(src, n):
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, src)
    return out


def _sync_all_to_all(src):
    out = torch.empty_like(src)
    dist.all_to_all_single(out, src)
    return out


def check_p2p(rank: int, world: int) -> None:
    if world == 1:
        return
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in (torch.float32, torch.int64, torch.bool):
        payload = make_input(rank, dtype, 257)
        got = torch.empty(257, dtype=dtype)
        if rank % 2 == 0:
            dist.send(payload, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(payload, nxt)
        assert_close(got, make_input(prv, dtype, 257), f"send/recv ring {dtype}")
    got = torch.empty(100)
    reqs = [dist.isend(torch.full((100,), float(rank)), nxt), dist.irecv(got, prv)]
    for r in reqs:
        r.wait()
    assert_close(got, torch.full((100,), float(prv)), "isend/irecv")
    # batch_isend_irecv both ways around the ring, with a non-contiguous receive
    left, right = torch.empty(4, 5).t(), torch.empty(20)
    ops = [
        dist.P2POp(dist.isend, torch.full((20,), float(rank)), nxt),
        dist.P2POp(dist.isend, torch.full((20,), float(-rank)), prv),
        dist.P2POp(dist.irecv, left, prv),
        dist.P2POp(dist.irecv, right, nxt),
    ]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    assert_close(left, torch.full((5, 4), float(prv)), "batch_isend_irecv left")
    assert_close(right, torch.full((20,), float(-nxt)), "batch_isend_irecv right")
    # zero-element messages
    dist.send(torch.empty(0), nxt) if rank % 2 == 0 else dist.recv(torch.empty(0), prv)
    dist.recv(torch.empty(0), prv) if rank % 2 == 0 else dist.send(torch.empty(0), nxt)
    # messages larger than any ring, both ways at once
    big_out = make_input(rank, torch.float32, 300_000)
    big_in = torch.empty(300_000)
    reqs = [dist.isend(big_out, nxt), dist.irecv(big_in, prv)]
    for r in reqs:
        r.wait()
    assert_close(big_in, make_input(prv, torch.float32, 300_000), "large isend/irecv")
    # tags: received in the opposite order to the sends
    if rank == 0:
        reqs = [dist.isend(torch.full((3,), 1.0), 1, tag=11), dist.isend(torch.full((5,), 2.0), 1, tag=22)]
        for r in reqs:
            r.wait()
    elif rank == 1:
        second, first = torch.empty(5), torch.empty(3)
        dist.recv(second, 0, tag=22)
        dist.recv(first, 0, tag=11)
        assert_close(first, torch.full((3,), 1.0), "tag 11")
        assert_close(second, torch.full((5,), 2.0), "tag 22")
    # receive from any source: rank 0 hears from everyone, in any order
    if rank == 0:
        senders = set()
        for _ in range(world - 1):
            buf = torch.empty(2)
            src = dist.recv(buf)
            assert_close(buf, torch.full((2,), float(src)), "recv any source payload")
            senders.add(src)
        assert senders == set(range(1, world)), senders
    else:
        dist.send(torch.full((2,), float(rank)), 0)
    _check_p2p_routing(rank, world, nxt, prv)
    dist.barrier()


def _check_p2p_routing(rank: int, world: int, nxt: int, prv: int) -> None:
    """Where send/recv go through the group's CPU communicator (the
    shared-memory engine, or its gloo group across hosts), a transfer of one
    contiguous tensor is posted from C++ without entering the frontend's
    send/recv (Python); a non-contiguous receive still goes through it and
    meets the peer's send from C++."""
    from torch_groupcomm import get_coordinator

    coordinator = get_coordinator()
    comm = coordinator.communicator_for(torch.device("cpu"))
    with frontend_calls(["send", "recv"]) as entered:
        got = torch.empty(6)
        # a tag of its own: rank 0 may still be receiving from any source (tag 0)
        for r in [dist.isend(torch.full((6,), float(rank)), nxt, tag=5), dist.irecv(got, prv, tag=5)]:
            r.wait()
        contiguous = list(entered)
        strided = torch.empty(3, 2).t()
        for r in [dist.isend(torch.full((2, 3), float(rank)), nxt, tag=5), dist.irecv(strided, prv, tag=5)]:
            r.wait()
    assert_close(got, torch.full((6,), float(prv)), "contiguous isend/irecv")
    assert_close(strided, torch.full((2, 3), float(prv)), "non-contiguous irecv")
    bridged = coordinator.sends_through(comm)
    assert contiguous == ([] if bridged else ["send", "recv"]), (comm.name, contiguous)
    assert entered[len(contiguous) :] == (["recv"] if bridged else ["send", "recv"]), (comm.name, entered)


def check_objects_coalesced_funcol(rank: int, world: int) -> None:
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "data": list(range(rank))})
    assert objs == [{"rank": r, "data": list(range(r))} for r in range(world)]
    lst = [f"hello {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["hello 0", 0]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("g", r) for r in range(world)]
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(world)] if rank == 0 else None, src=0)
    assert out == [("s", rank)]
    # _coalescing_manager: all_reduce, all_gather_into_tensor and reduce_scatter_tensor batches
    with frontend_calls(_COALESCED) as entered:
        _check_coalesced(rank, world)
    from torch_groupcomm import get_coordinator

    native = get_coordinator().communicator_for(torch.device("cpu")).native_engine() is not None
    # on the shared-memory engine the bridge runs the coalesced forms itself, except what it leaves to Python
    python = (
        ["allreduce_coalesced"] if native else _COALESCED + _COALESCED[1:] + _COALESCED[:0:-1] * 2 + _COALESCED[:1] * 2
    )
    assert entered == python, (native, entered)
    # functional collectives (what torch.compile and DTensor emit)
    group = dist.group.WORLD
    x = torch.arange(4.0) + rank
    assert_close(funcol.all_reduce(x, "sum", group), torch.arange(4.0) * world + sum(range(world)), "funcol all_reduce")
    assert_close(
        funcol.all_gather_tensor(x, 0, group),
        torch.cat([torch.arange(4.0) + r for r in range(world)]),
        "funcol all_gather",
    )
    y = torch.arange(2.0 * world)
    assert_close(
        funcol.reduce_scatter_tensor(y, "sum", 0, group),
        torch.arange(2.0 * rank, 2.0 * rank + 2) * world,
        "funcol reduce_scatter",
    )
    z = funcol.all_to_all_single(torch.arange(float(world)) + 10 * rank, None, None, group)
    assert_close(z, torch.tensor([10.0 * r + rank for r in range(world)]), "funcol all_to_all_single")


_COALESCED = ["allreduce_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"]


def _check_coalesced(rank: int, world: int) -> None:
    """The coalesced forms, sync and async, with values; the last block
    holds a strided tensor, which the engine's path leaves to Python."""
    a, b = torch.full((3,), float(rank)), torch.full((5,), float(rank + 1))
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert_close(a, torch.full((3,), float(sum(range(world)))), "coalesced all_reduce a")
    assert_close(b, torch.full((5,), float(sum(range(1, world + 1)))), "coalesced all_reduce b")
    ins = [torch.full((2,), float(rank)), torch.full((3,), float(10 + rank))]
    outs = [torch.empty(2 * world), torch.empty(3 * world)]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    assert_close(outs[0], torch.arange(world).float().repeat_interleave(2), "coalesced all_gather_into_tensor")
    assert_close(outs[1], (10 + torch.arange(world)).float().repeat_interleave(3), "coalesced all_gather 2")
    rs_in = [torch.arange(2.0 * world) + rank, torch.ones(world)]
    rs_out = [torch.empty(2), torch.empty(1)]
    with dist._coalescing_manager():
        for o, i in zip(rs_out, rs_in):
            dist.reduce_scatter_tensor(o, i)
    assert_close(
        rs_out[0], torch.arange(2.0 * rank, 2.0 * rank + 2) * world + sum(range(world)), "coalesced reduce_scatter"
    )
    assert_close(rs_out[1], torch.full((1,), float(world)), "coalesced reduce_scatter 2")
    # async blocks of other dtypes and reduce ops: int64 MAX gathers and reduce-scatters, bf16
    gathered = [torch.empty(4 * world, dtype=torch.int64), torch.empty(world, dtype=torch.bfloat16)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered[0], torch.arange(4) + 100 * rank)
        dist.all_gather_into_tensor(gathered[1], torch.full((1,), rank + 0.5, dtype=torch.bfloat16))
    cm.wait()
    assert torch.equal(gathered[0], torch.cat([torch.arange(4) + 100 * r for r in range(world)])), gathered[0]
    assert_close(gathered[1], torch.arange(world).to(torch.bfloat16) + 0.5, "async coalesced all_gather bf16")
    scattered = [torch.empty(3, dtype=torch.int64), torch.empty(2, dtype=torch.int64)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(scattered[0], torch.arange(3 * world) * (rank + 1), op=dist.ReduceOp.MAX)
        dist.reduce_scatter_tensor(scattered[1], torch.full((2 * world,), rank), op=dist.ReduceOp.MAX)
    cm.wait()
    assert torch.equal(scattered[0], torch.arange(3 * rank, 3 * rank + 3) * world), scattered[0]
    assert torch.equal(scattered[1], torch.full((2,), world - 1)), scattered[1]
    # blocks of mixed dtypes, small and large, inputs that are views of their output's own part
    for n in (3, 9000):
        mixed_in = [torch.arange(n * world, dtype=torch.float32) + rank, torch.full((2 * world,), rank + 1)]
        mixed_out = [torch.empty(n), torch.empty(2, dtype=torch.int64)]
        gathered = [torch.zeros(n * world), torch.zeros(2 * world, dtype=torch.int64)]
        for g, value in zip(gathered, (rank + 0.25, rank)):
            g[rank * (g.numel() // world) : (rank + 1) * (g.numel() // world)] = value
        with dist._coalescing_manager():
            for o, i in zip(mixed_out, mixed_in):
                dist.reduce_scatter_tensor(o, i)
        with dist._coalescing_manager():
            for g in gathered:
                dist.all_gather_into_tensor(g, g.chunk(world)[rank])
        assert_close(
            mixed_out[0],
            (torch.arange(n * rank, n * rank + n) * world + sum(range(world))).float(),
            f"mixed reduce_scatter fp32 ({n})",
        )
        assert torch.equal(mixed_out[1], torch.full((2,), sum(range(1, world + 1)))), mixed_out[1]
        assert_close(gathered[0], (torch.arange(world) + 0.25).repeat_interleave(n), f"in-place all_gather ({n})")
        assert torch.equal(gathered[1], torch.arange(world).repeat_interleave(2)), gathered[1]
    ints = [torch.arange(n) * (rank + 1) for n in (1, 5, 2)]  # small tensors: one engine op for the block
    with dist._coalescing_manager():
        for t in ints:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for t in ints:
        assert torch.equal(t, torch.arange(t.numel()) * world), t
    strided = [torch.full((3, 2), float(rank)).t(), torch.full((4,), float(rank))]
    with dist._coalescing_manager():
        for t in strided:
            dist.all_reduce(t)
    for t in strided:
        assert_close(t, torch.full(t.shape, float(sum(range(world)))), "coalesced all_reduce of a strided tensor")


def check_gloo_parity(rank: int, world: int) -> None:
    """Same inputs through groupcomm and a gloo group in the same processes."""
    gloo = dist.new_group(backend="gloo")
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        for dtype in (torch.float32, torch.float64, torch.int32):
            x = make_input(rank, dtype, 3000, seed=5)
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=op, group=gloo)
            assert torch.equal(ours, theirs), f"gloo parity all_reduce {op} {dtype}"
    x = torch.randn(999, generator=torch.Generator().manual_seed(rank))
    ours, theirs = [torch.empty(999) for _ in range(world)], [torch.empty(999) for _ in range(world)]
    dist.all_gather(ours, x)
    dist.all_gather(theirs, x, group=gloo)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), "gloo parity all_gather"
    dist.destroy_process_group(gloo)


def check_torch_suite_findings(rank: int, world: int) -> None:
    """Ops torch's own backend suite found wrong or missing, against gloo in the same processes."""
    gloo = dist.new_group(backend="gloo")
    # all_gather_coalesced: one output list per rank, each as long as the inputs
    inputs = [
        torch.full((2, 2), float(rank)),
        torch.arange(3.0) + 10 * rank,
        torch.zeros(0),
        torch.full((1,), rank + 0.5),
    ]
    ours, later, theirs = ([[torch.empty_like(t) for t in inputs] for _ in range(world)] for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates all_gather_coalesced
        dist.all_gather_coalesced(ours, inputs)
        dist.all_gather_coalesced(theirs, inputs, group=gloo)
        future = dist.all_gather_coalesced(later, inputs, async_op=True)
    future.wait()
    for r in range(world):
        expected = [torch.full((2, 2), float(r)), torch.arange(3.0) + 10 * r, torch.zeros(0), torch.full((1,), r + 0.5)]
        for got, got_async, want, gloo_got in zip(ours[r], later[r], expected, theirs[r]):
            assert torch.equal(got, want) and torch.equal(got, gloo_got), f"all_gather_coalesced from rank {r}"
            assert torch.equal(got_async, want), f"async all_gather_coalesced from rank {r}"
    try:
        dist.all_gather_coalesced([[torch.empty(1)]] * (world + 1), [torch.ones(1)])
    except ValueError as exc:
        assert f"needs {world} output lists (one per rank), got {world + 1}" in str(exc), str(exc)
    else:
        raise AssertionError("all_gather_coalesced accepted a list per rank too many")
    # sparse all_reduce (SUM), entries overlapping between ranks
    indices = torch.tensor([[0, rank + 1, 7], [1, 2, rank]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, rank + 3.0]), (8, 4))
    ours, theirs = sparse.clone(), sparse.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    assert ours.is_sparse and torch.equal(ours.to_dense(), theirs.to_dense()), "sparse all_reduce"
    try:
        dist.all_reduce(sparse.clone(), op=dist.ReduceOp.MAX)
    except ValueError as exc:
        assert "sparse tensor supports ReduceOp.SUM only, got ReduceOp.MAX" in str(exc), str(exc)
    else:
        raise AssertionError("sparse all_reduce accepted MAX")
    # monitored barrier (dist.monitored_barrier reaches it on torch 2.14+; the backend object everywhere)
    dist.group.WORLD._get_backend(torch.device("cpu")).monitored_barrier(timedelta(seconds=30), True)
    if torch.__version__ >= (2, 14):
        dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    dist.destroy_process_group(gloo)


def check_list_forms_routing(rank: int, world: int) -> None:
    """On the shared-memory engine the list forms (all_gather, reduce_scatter,
    all_to_all), gather, scatter and all_to_all_single with split sizes run
    in C++ and never reach the frontend; an op with a strided tensor still
    does (check_data_movement checks the values of every form and dtype)."""
    from torch_groupcomm import get_coordinator
    from torch_groupcomm.communicators.gloo import GlooCommunicator

    names = ["allgather", "reduce_scatter", "alltoall", "gather", "scatter", "alltoall_base"]
    x = torch.arange(4.0) + rank
    with frontend_calls(names) as entered:
        outs = [torch.empty(4) for _ in range(world)]
        dist.all_gather(outs, x)
        assert torch.equal(torch.stack(outs), torch.arange(4.0) + torch.arange(world).view(-1, 1)), outs
        out = torch.empty(4)
        dist.reduce_scatter(out, [torch.full((4,), float(rank + d)) for d in range(world)])
        assert torch.equal(out, torch.full((4,), float(sum(range(world)) + world * rank))), out
        got = [torch.empty(2) for _ in range(world)]
        dist.all_to_all(got, [torch.full((2,), float(10 * rank + d)) for d in range(world)])
        assert torch.equal(torch.stack(got), (10 * torch.arange(world) + rank).float().view(-1, 1).expand(world, 2)), (
            got
        )
        gathered = [torch.empty(4) for _ in range(world)] if rank == 0 else None
        dist.gather(x, gathered, dst=0)
        if rank == 0:
            assert torch.equal(torch.stack(gathered), torch.arange(4.0) + torch.arange(world).view(-1, 1)), gathered
        piece = torch.empty(3)
        dist.scatter(
            piece, [torch.full((3,), float(d)) for d in range(world)] if rank == world - 1 else None, src=world - 1
        )
        assert torch.equal(piece, torch.full((3,), float(rank))), piece
        rows = torch.empty(world, 2)
        dist.all_to_all_single(rows, torch.full((world, 2), float(rank)), [1] * world, [1] * world)
        assert torch.equal(rows, torch.arange(world).float().view(-1, 1).expand(world, 2)), rows
        native_calls = len(entered)
        strided = [torch.empty(4, 2)[:, 0] for _ in range(world)]
        dist.all_gather(strided, x)
        assert torch.equal(torch.stack(strided), torch.arange(4.0) + torch.arange(world).view(-1, 1)), strided
    comm = get_coordinator().communicator_for(torch.device("cpu"))
    native = comm.native_engine() is not None
    # on gloo, the bridge runs gather, scatter and both all_to_all forms itself (_C.GlooPath)
    on_gloo = {"gather", "scatter", "alltoall_base", "alltoall"} if isinstance(comm, GlooCommunicator) else set()
    expected = [] if native else [n for n in names if n not in on_gloo]
    assert entered[:native_calls] == expected, (native, entered)
    assert entered[native_calls:] == ["allgather"], entered


def check_large_list_forms(rank: int, world: int) -> None:
    """all_gather, all_to_all and reduce_scatter of lists above the engine's
    direct-read size (1 MiB), each piece a tensor of its own, sizes differing
    per rank; and lists whose outputs overlap the inputs (in place, or an
    input that is another rank's output): the values are those of separate
    buffers."""
    piece = lambda src, dst: 300_000 + 1000 * src + 10 * dst  # elements rank src sends rank dst
    data = lambda src, dst: torch.arange(piece(src, dst), dtype=torch.float32) * (world + 1) + src * world + dst
    outs = [torch.empty(piece(s, rank)) for s in range(world)]
    dist.all_to_all(outs, [data(rank, d) for d in range(world)])
    for s in range(world):
        assert torch.equal(outs[s], data(s, rank)), f"all_to_all list from rank {s}"
    same = [data(rank, d)[: piece(0, 0)].clone() for d in range(world)]
    dist.all_to_all(same, same)
    for s in range(world):
        assert torch.equal(same[s], data(s, rank)[: piece(0, 0)]), f"all_to_all list in place, from rank {s}"
    gathered = [torch.empty(piece(r, 0)) for r in range(world)]
    dist.all_gather(gathered, data(rank, 0))
    for r in range(world):
        assert torch.equal(gathered[r], data(r, 0)), f"all_gather list from rank {r}"
    whole = torch.empty(world * piece(0, 0))
    chunks = list(whole.chunk(world))
    chunks[rank].copy_(data(rank, 0)[: piece(0, 0)])
    dist.all_gather(chunks, chunks[rank])
    assert torch.equal(whole, torch.cat([data(r, 0)[: piece(0, 0)] for r in range(world)])), "all_gather into own chunk"
    if world > 1:
        chunks[(rank + 1) % world].copy_(data(rank, 1)[: piece(0, 0)])
        dist.all_gather(chunks, chunks[(rank + 1) % world])
        want = torch.cat([data(r, 1)[: piece(0, 0)] for r in range(world)])
        assert torch.equal(whole, want), "all_gather of an input that is another rank's output"
    # reduce_scatter of lists: slice j has piece(0, j) elements on every rank (sums exact in fp32)
    want = sum(data(s, rank)[: piece(0, rank)] for s in range(world))
    out = torch.empty(piece(0, rank))
    dist.reduce_scatter(out, [data(rank, d)[: piece(0, d)] for d in range(world)])
    assert torch.equal(out, want), "reduce_scatter list"
    slices = list(
        torch.cat([data(rank, d)[: piece(0, d)] for d in range(world)]).split([piece(0, d) for d in range(world)])
    )
    dist.reduce_scatter(slices[rank], slices)
    assert torch.equal(slices[rank], want), "reduce_scatter list into the own slice"
    if world > 1:
        slices = [data(rank, d)[: piece(0, 0)].clone() for d in range(world)]
        dist.reduce_scatter(slices[(rank + 1) % world], slices)
        want = sum(data(s, rank)[: piece(0, 0)] for s in range(world))
        assert torch.equal(slices[(rank + 1) % world], want), "reduce_scatter list into another rank's slice"


def check_gloo_routes(rank: int, world: int) -> None:
    """On a group carried by gloo, the bridge runs barrier, broadcast (below
    32 KiB one transfer between two ranks and gloo's own among more; from it
    gloo's own between two, down the chain among more), gather, scatter,
    all_to_all_single, all-gathers below 1 MiB and all-reduces of gloo's
    dtypes and ops on gloo from C++ (_C.GlooPath), synchronous or not;
    across hosts barrier, broadcast, all-gather and all-reduce stay two-level
    (Python). The values are checked on every path."""
    from torch_groupcomm import get_coordinator
    from torch_groupcomm.communicators.gloo import GlooCommunicator
    from torch_groupcomm.communicators.hierarchical import HierarchicalCommunicator

    names = ["barrier", "broadcast", "alltoall_base", "gather", "scatter", "_allgather_base", "allreduce"]
    last = world - 1
    gloo = dist.new_group(backend="gloo")
    with frontend_calls(names) as entered:
        # all-reduce: up to 256 KiB on a rank's link gathered and reduced
        # here, larger ones gloo's own (the same bits as a gloo group's)
        for numel, dtype, op in (
            (1000, torch.float32, dist.ReduceOp.SUM),
            (1000, torch.bfloat16, dist.ReduceOp.SUM),
            (1000, torch.int32, dist.ReduceOp.BXOR),
            (1000, torch.float64, dist.ReduceOp.PRODUCT),
            (300_000, torch.float32, dist.ReduceOp.SUM),
            (300_000, torch.int64, dist.ReduceOp.MAX),
            (300_000, torch.uint8, dist.ReduceOp.BAND),
        ):
            x = make_input(rank, dtype, numel, seed=11)
            ours, theirs = x.clone(), x.clone()
            work = dist.all_reduce(ours, op=op, async_op=numel > 1000)
            if work is not None:
                work.wait()
            dist.all_reduce(theirs, op=op, group=gloo)
            if numel > 1000:
                assert torch.equal(ours, theirs), ("all_reduce", numel, dtype, op)
            else:
                assert torch.allclose(ours.double(), theirs.double(), rtol=1e-2), ("all_reduce", numel, dtype, op)
        # between two ranks an exchange below 64 KiB a block, one gloo all-to-all to 1 MiB in all
        for numel in (3, 40 << 10):
            gathered = torch.empty(world * numel, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(gathered, torch.full((numel,), rank, dtype=torch.bfloat16))
            assert torch.equal(
                gathered.view(world, numel), torch.arange(world).view(-1, 1).expand(world, numel).bfloat16()
            )
        # a barrier returns only once every rank has entered it (store.add
        # waits for the store's answer, where store.set does not)
        store = dist.distributed_c10d._get_default_store()
        for round_, barrier in enumerate((dist.barrier, lambda: dist.barrier(async_op=True).wait())):
            store.add(f"gloo routes/barrier {round_}/{rank}", 1)
            barrier()
            assert store.check([f"gloo routes/barrier {round_}/{r}" for r in range(world)]), ("barrier", round_)
        for numel, dtype in ((2, torch.float32), (12 << 10, torch.float32), (5, torch.bool), (3, torch.complex64)):
            t = (torch.arange(numel) % 2).to(dtype) if rank == last else torch.zeros(numel, dtype=dtype)
            work = dist.broadcast(t, src=last, async_op=numel > 100)
            if work is not None:
                work.wait()
            assert torch.equal(t, (torch.arange(numel) % 2).to(dtype)), ("broadcast", numel, dtype)
        for dtype in (torch.float32, torch.int16, torch.bfloat16):
            inp = (torch.arange(2 * world) + 100 * rank).to(dtype)
            out = torch.empty_like(inp)
            dist.all_to_all_single(out, inp, async_op=True).wait()
            want = torch.stack([torch.arange(2 * rank, 2 * rank + 2) + 100 * s for s in range(world)]).view(-1)
            assert torch.equal(out, want.to(dtype)), ("all_to_all_single", dtype, out)
        x = torch.full((3,), rank, dtype=torch.bfloat16)
        gathered = [torch.empty(3, dtype=torch.bfloat16) for _ in range(world)] if rank == last else None
        dist.gather(x, gathered, dst=last)
        if rank == last:
            assert torch.equal(torch.stack(gathered), torch.arange(world).view(-1, 1).expand(world, 3).bfloat16())
        piece = torch.empty(2, dtype=torch.int64)
        dist.scatter(piece, [torch.full((2,), 7 * d) for d in range(world)] if rank == 0 else None, src=0)
        assert torch.equal(piece, torch.full((2,), 7 * rank)), piece
    # a large reduce (on gloo among 3+ ranks: a reduce-scatter, then a gather to dst)
    numel = world * (1 << 18)
    base = torch.arange(numel, dtype=torch.float32) % 7
    for op, want in (
        (dist.ReduceOp.SUM, base * sum(r + 1 for r in range(world))),
        (dist.ReduceOp.AVG, base * sum(r + 1 for r in range(world)) / world),
        (dist.ReduceOp.MAX, base * world),
        (dist._make_nccl_premul_sum(0.5), base * sum(r + 1 for r in range(world)) * 0.5),
    ):
        t = base * (rank + 1)
        dist.reduce(t, dst=last, op=op)
        if rank == last:
            assert torch.allclose(t, want), ("reduce", op)
        else:
            assert torch.equal(t, base * (rank + 1)), ("reduce changed a non-root tensor", op)
    comm = get_coordinator().communicator_for(torch.device("cpu"))
    if isinstance(comm, HierarchicalCommunicator):
        assert set(entered) == {"barrier", "broadcast", "_allgather_base", "allreduce"}, entered
    elif isinstance(comm, GlooCommunicator) or comm.native_engine() is not None:
        assert entered == [], entered
    # all-reduce where one rank's tensor is strided (its call goes through
    # Python) and the others' not, both sides of 256 KiB
    for numel in (1000, 300_000):
        for strided in range(world):
            t = (torch.arange(numel) % 13).float() * (rank + 1)
            if rank == strided:
                t = torch.stack([t, t]).t()[:, 0]
            dist.all_reduce(t)
            assert torch.equal(t, (torch.arange(numel) % 13).float() * sum(range(1, world + 1))), ("all_reduce", numel)
    dist.destroy_process_group(gloo)
    # all_to_all_single with uneven splits where one rank's output is strided
    # (its call goes through Python) and the others' not: both paths pick the
    # same algorithm (between two ranks an exchange below 64 KiB a direction,
    # gloo's own from there to 1 MiB, the exchange again past it: one row of
    # 10000 columns is 40 KB, of 300000 1.2 MB)
    for cols in (5, 10000, 100000, 300000):
        for strided in range(world):
            splits = [[(r + p) % 3 + (r == p) for p in range(world)] for r in range(world)]
            ins = [(torch.arange(sum(splits[r]) * cols) + 1000 * r).view(-1, cols).float() for r in range(world)]
            want = torch.cat([ins[s].split(splits[s])[rank] for s in range(world)])
            out = torch.empty(cols, want.shape[0]).t() if rank == strided else torch.empty_like(want)
            dist.all_to_all_single(out, ins[rank], [splits[s][rank] for s in range(world)], splits[rank])
            assert torch.equal(out, want), ("all_to_all_single, one rank strided", cols, strided)
    # the same for broadcast (strided tensor) and all_gather_into_tensor
    # (strided input), below and above each size where the algorithm changes
    for strided in range(world):
        for numel in (5, 100000):
            want = torch.arange(numel, dtype=torch.float32) * 3
            t = want.clone() if rank == 0 else torch.zeros(numel)
            if rank == strided:
                t = torch.stack([t, t]).t()[:, 0]
            dist.broadcast(t, src=0)
            assert torch.equal(t, want), ("broadcast, one rank strided", numel, strided)
        for numel in (3, 20 << 10, 40 << 10, 300 << 10):
            mine = torch.full((numel,), rank + 1, dtype=torch.bfloat16)
            if rank == strided:
                mine = torch.stack([mine, mine]).t()[:, 0]
            gathered = torch.empty(world * numel, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(gathered, mine)
            want = (torch.arange(world) + 1).view(-1, 1).expand(world, numel).bfloat16().reshape(-1)
            assert torch.equal(gathered, want), ("all_gather_into_tensor, one rank strided", numel, strided)
    check_chain_piece_choice(rank, world)
    check_all_reduce_way_choice(rank, world)


def check_all_reduce_way_choice(rank: int, world: int) -> None:
    """Among 3+ ranks an all-reduce from 1 MiB times gloo's ring against two
    exchanges (a reduce-scatter and an all-gather) on its first calls of
    each size class, and every rank keeps the faster: through the trials and
    past them, every dtype and op gloo's ring has and some it lacks, with one
    rank's tensor strided (its call run by Python) in turn, every rank gets
    the reduction and all keep the same way."""
    from torch_groupcomm import get_coordinator
    from torch_groupcomm._native import _C
    from torch_groupcomm.communicators.gloo import GlooCommunicator
    from torch_groupcomm.communicators.hierarchical import HierarchicalCommunicator

    if world < 3:
        return
    numels = ((1 << 18) + 3, 1 << 19)
    cases = (
        (torch.float32, dist.ReduceOp.SUM),
        (torch.int64, dist.ReduceOp.BXOR),
        (torch.float64, dist.ReduceOp.MAX),
        (torch.bfloat16, dist.ReduceOp.SUM),
        (torch.float32, dist.ReduceOp.AVG),
    )
    for numel in numels:
        for i in range(_C.Tuner.trials + 2):
            for dtype, op in cases:
                rows = torch.stack([torch.arange(numel) * (r + 1 + i) % 97 for r in range(world)])
                mine = rows[rank].to(dtype)
                if i % world == rank:
                    mine = torch.stack([mine, mine]).t()[:, 0]
                if op == dist.ReduceOp.BXOR:
                    want = rows[0].clone()
                    for row in rows[1:]:
                        want ^= row
                elif op == dist.ReduceOp.MAX:
                    want = rows.amax(0)
                else:
                    want = rows.sum(0) / (world if op == dist.ReduceOp.AVG else 1)
                work = dist.all_reduce(mine, op=op, async_op=i % 2 == 1)
                if work is not None:
                    work.wait()
                exact = dtype in (torch.int64, torch.float64)
                assert torch.allclose(mine.double(), want.double(), rtol=0 if exact else 1e-2), (
                    "all_reduce",
                    numel,
                    i,
                    dtype,
                    op,
                )
    comm = get_coordinator().communicator_for(torch.device("cpu"))
    if isinstance(comm, GlooCommunicator) and not isinstance(comm, HierarchicalCommunicator):
        chosen = [comm._reduce_ways.choose(numel * size) for numel in numels for size in (2, 4, 8)]
        assert all(trial == -1 for _, trial in chosen), chosen
        everyone = [None] * world
        dist.all_gather_object(everyone, chosen)
        assert all(c == chosen for c in everyone), everyone


def check_chain_piece_choice(rank: int, world: int) -> None:
    """Among 3+ ranks a broadcast from 32 KiB goes down a chain, whose first
    calls of each size class from 1 MiB time the planned pieces against the
    whole tensor (_C.Tuner) before every rank keeps the faster: through the
    trials and past them, with one rank's call run by Python (a strided
    tensor) on some calls and the C++ path on others, and roots that change,
    every rank gets the root's bytes and all keep the same choice."""
    from torch_groupcomm import get_coordinator
    from torch_groupcomm._native import _C
    from torch_groupcomm.communicators.gloo import GlooCommunicator
    from torch_groupcomm.communicators.hierarchical import HierarchicalCommunicator

    if world < 3:
        return
    sizes = (40 << 10, 1 << 20, 3 << 20)
    for numel in sizes:
        for i in range(_C.Tuner.trials + 3):
            src = (i * 2) % world
            want = (torch.arange(numel) * (src + i + 3) % 251).to(torch.uint8)
            t = want.clone() if rank == src else torch.zeros(numel, dtype=torch.uint8)
            if i % world == rank:
                t = torch.stack([t, t]).t()[:, 0]
            work = dist.broadcast(t, src=src, async_op=i % 2 == 1)
            if work is not None:
                work.wait()
            assert torch.equal(t, want), ("chain broadcast", numel, i)
    comm = get_coordinator().communicator_for(torch.device("cpu"))
    # a group across hosts broadcasts among its hosts' leaders (their own
    # communicator's chain, with 3+ hosts)
    if isinstance(comm, GlooCommunicator) and not isinstance(comm, HierarchicalCommunicator):
        chosen = [comm._pieces.choose(n) for n in sizes]
        assert all(trial == -1 for _, trial in chosen), chosen
        everyone = [None] * world
        dist.all_gather_object(everyone, chosen)
        assert all(c == chosen for c in everyone), everyone


ALL_CHECKS = [
    check_data_movement,
    check_non_contiguous_and_async,
    check_p2p,
    check_objects_coalesced_funcol,
    check_gloo_parity,
    check_torch_suite_findings,
    check_list_forms_routing,
    check_large_list_forms,
    check_gloo_routes,
]


def run_all(rank: int, world: int, communicator: str) -> None:
    for check in ALL_CHECKS:
        check(rank, world)
    assert_cpu_communicator(communicator)


@pytest.mark.parametrize("backend,world,env,communicator", [p[1:] for p in CPU_PATHS], ids=[p[0] for p in CPU_PATHS])
def test_collectives(backend: str, world: int, env: dict, communicator: str) -> None:
    run_ranks(run_all, world, backend, args=(communicator,), env=env)
    assert shm_segments() == []
