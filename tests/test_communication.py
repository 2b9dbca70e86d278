"""The Bagua-style functional API (torch_groupcomm.communication) on real
ranks: Bagua's documented examples, every function and in-place variant
against plain torch math on all ranks' inputs, every ReduceOp, communicator
membership on one and two (simulated) hosts, hierarchical all-reduce, the
size checks, a wrapped gloo group, and init_process_group itself."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_ranks
from _reference import assert_close, expected, make_input

from torch_groupcomm import communication as C
from torch_groupcomm.reduction import Kind, Reduction

BITWISE = {C.ReduceOp.BAND, C.ReduceOp.BOR, C.ReduceOp.BXOR}
DTYPES = (torch.int64, torch.float32)


def _float_ok(op: C.ReduceOp, dtype: torch.dtype) -> bool:
    return not (op in BITWISE and dtype.is_floating_point)


def _expect(exc_type, fn, *needles) -> str:
    """``fn()`` raises ``exc_type`` whose message contains every needle."""
    try:
        fn()
    except exc_type as exc:
        message = str(exc)
        for needle in needles:
            assert str(needle) in message, f"{needle!r} not in {message!r}"
        return message
    raise AssertionError(f"no {exc_type.__name__} raised (wanted {needles})")


def _inputs(n: int, dtype: torch.dtype, numel: int, seed: int = 0):
    return [make_input(i, dtype, numel, seed) for i in range(n)]


# -- the checks, run inside ranks -----------------------------------------------


def check_seed_examples(rank: int) -> None:
    """Bagua's allreduce docstring examples, literally (2 ranks)."""
    send_tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    recv_tensor = torch.zeros(2, dtype=torch.int64)
    assert send_tensor.tolist() == ([1, 2] if rank == 0 else [3, 4])
    C.allreduce(send_tensor, recv_tensor)
    assert recv_tensor.tolist() == [4, 6], recv_tensor
    send_tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * rank * (1 + 1j)
    recv_tensor = torch.zeros(2, dtype=torch.cfloat)
    C.allreduce(send_tensor, recv_tensor)
    assert torch.equal(recv_tensor, torch.tensor([4 + 4j, 6 + 6j], dtype=torch.cfloat)), recv_tensor


def check_reductions(comm: C.Communicator, tag: str, hierarchical: bool = False) -> None:
    """allreduce(_inplace), reduce(_inplace), reduce_scatter(_inplace): every
    ReduceOp on int64 and float32 against torch math on every rank's input."""
    n, r = comm.nranks(), comm.rank()
    count = 3
    for dtype in DTYPES:
        for op in C.ReduceOp:
            what = f"{tag} {op.name}/{dtype}"
            if not _float_ok(op, dtype):
                x = torch.ones(4, dtype=dtype)
                for call in (
                    lambda: C.allreduce(x, x.clone(), op=op, comm=comm, hierarchical=hierarchical),
                    lambda: C.allreduce_inplace(x, op=op, comm=comm, hierarchical=hierarchical),
                    lambda: C.reduce(x, x.clone(), dst=0, op=op, comm=comm),
                    lambda: C.reduce_inplace(x, dst=0, op=op, comm=comm),
                    lambda: C.reduce_scatter(torch.ones(n, dtype=dtype), torch.ones(1, dtype=dtype), op=op, comm=comm),
                    lambda: C.reduce_scatter_inplace(torch.ones(n, dtype=dtype), op=op, comm=comm),
                ):
                    _expect(TypeError, call, op.name, dtype, "communication.")
                continue
            xs = [x.view(2, 3) for x in _inputs(n, dtype, 6, seed=op.value)]
            want = expected(op.name, xs)
            # out of place into a non-contiguous (3, 2)-transposed receive buffer
            recv = torch.full((3, 2), 7, dtype=dtype).t()
            C.allreduce(xs[r], recv, op=op, comm=comm, hierarchical=hierarchical)
            assert_close(recv, want, f"allreduce {what}")
            t = xs[r].clone()
            C.allreduce_inplace(t, op=op, comm=comm, hierarchical=hierarchical)
            assert_close(t, want, f"allreduce_inplace {what}")
            t = torch.empty(3, 2, dtype=dtype).t()
            t.copy_(xs[r])
            C.allreduce_inplace(t, op=op, comm=comm, hierarchical=hierarchical)
            assert_close(t, want, f"allreduce_inplace non-contiguous {what}")
            if hierarchical:
                continue
            dst = n - 1
            recv = torch.full((2, 3), 5, dtype=dtype)
            C.reduce(xs[r], recv, dst=dst, op=op, comm=comm)
            assert_close(recv, want if r == dst else torch.full((2, 3), 5, dtype=dtype), f"reduce {what}")
            C.reduce(xs[r], recv if r == dst else None, dst=dst, op=op, comm=comm)
            assert_close(recv, want if r == dst else torch.full((2, 3), 5, dtype=dtype), f"reduce recv=None {what}")
            t = xs[r].clone()
            C.reduce_inplace(t, dst=0, op=op, comm=comm)
            assert_close(t, want if r == 0 else xs[r], f"reduce_inplace {what}")
            big = _inputs(n, dtype, n * count, seed=10 + op.value)
            want_rs = expected(op.name, big)
            out = torch.empty(count, dtype=dtype)
            C.reduce_scatter(big[r].view(n, count), out, op=op, comm=comm)
            assert_close(out, want_rs[r * count : (r + 1) * count], f"reduce_scatter {what}")
            t = big[r].clone()
            C.reduce_scatter_inplace(t, op=op, comm=comm)
            mine = big[r].clone()
            mine[r * count : (r + 1) * count] = want_rs[r * count : (r + 1) * count]
            assert_close(t, mine, f"reduce_scatter_inplace {what}")
    # AVG on integers truncates toward zero (negative sums included)
    xs = [torch.tensor([-5, 5, -1, 7, 0], dtype=torch.int64) + i for i in range(n)]
    t = xs[r].clone()
    C.allreduce_inplace(t, op=C.ReduceOp.AVG, comm=comm, hierarchical=hierarchical)
    assert torch.equal(t, torch.div(sum(xs), n, rounding_mode="trunc")), f"{tag} int AVG {t}"


def check_movement(comm: C.Communicator, tag: str) -> None:
    """The data-moving functions against the rank-indexed inputs."""
    n, r = comm.nranks(), comm.rank()
    for dtype in (torch.float32, torch.int64, torch.bool):
        what = f"{tag} {dtype}"
        xs = [x.view(2, 2) for x in _inputs(n, dtype, 4, seed=1)]
        cat = torch.cat([x.reshape(-1) for x in xs])
        # allgather into a non-contiguous (n*2, 2) buffer
        recv = torch.empty(2, 2 * n, dtype=dtype).t()
        C.allgather(xs[r], recv, comm=comm)
        assert_close(recv.reshape(-1), cat, f"allgather {what}")
        t = torch.zeros(n * 4, dtype=dtype)
        t[r * 4 : (r + 1) * 4] = xs[r].reshape(-1)
        C.allgather_inplace(t, comm=comm)
        assert_close(t, cat, f"allgather_inplace {what}")
        # alltoall: chunk j of rank i goes to rank j, lands at chunk i
        sends = _inputs(n, dtype, 2 * n, seed=2)
        want = torch.cat([sends[i][2 * r : 2 * r + 2] for i in range(n)])
        recv = torch.empty(2 * n, dtype=dtype)
        C.alltoall(sends[r].view(n, 2), recv, comm=comm)
        assert_close(recv, want, f"alltoall {what}")
        t = sends[r].clone()
        C.alltoall_inplace(t, comm=comm)
        assert_close(t, want, f"alltoall_inplace {what}")
        # broadcast from every source, into a non-contiguous tensor
        for src in range(n):
            t = torch.empty(2, 2, dtype=dtype).t()
            t.copy_(xs[r])
            C.broadcast(t, src=src, comm=comm)
            assert_close(t, xs[src], f"broadcast src={src} {what}")
        # gather / scatter to the first and last rank
        for root in sorted({0, n - 1}):
            recv = torch.zeros(n, 4, dtype=dtype)
            C.gather(xs[r], recv if r == root else None, dst=root, comm=comm)
            assert_close(
                recv.reshape(-1), cat if r == root else torch.zeros(n * 4, dtype=dtype), f"gather dst={root} {what}"
            )
            if r == root:
                t = torch.zeros(n * 4, dtype=dtype)
                t[r * 4 : (r + 1) * 4] = xs[r].reshape(-1)
            else:
                t = xs[r].reshape(-1).clone()
            C.gather_inplace(t, 4, dst=root, comm=comm)
            assert_close(t, cat if r == root else xs[r].reshape(-1), f"gather_inplace dst={root} {what}")
            pieces = make_input(50 + root, dtype, n * 3)
            recv = torch.empty(3, 1, dtype=dtype)
            C.scatter(pieces.view(n, 3) if r == root else None, recv, src=root, comm=comm)
            assert_close(recv.reshape(-1), pieces[3 * r : 3 * r + 3], f"scatter src={root} {what}")
            t = pieces.clone() if r == root else torch.zeros(3, dtype=dtype)
            C.scatter_inplace(t, 3, src=root, comm=comm)
            assert_close(t, pieces if r == root else pieces[3 * r : 3 * r + 3], f"scatter_inplace src={root} {what}")
    # alltoall_v with gaps between the pieces (-1 marks untouched elements)
    sizes = lambda i, j: (i + 2 * j) % 3 + 1  # elements rank i sends to rank j
    payload = lambda i, j: torch.arange(sizes(i, j), dtype=torch.int64) + 100 * i + 10 * j
    send_counts = [sizes(r, j) for j in range(n)]
    send_displs = [sum(c + 1 for c in send_counts[:j]) + 1 for j in range(n)]
    send_t = torch.full((send_displs[-1] + send_counts[-1] + 2,), -1, dtype=torch.int64)
    for j in range(n):
        send_t[send_displs[j] : send_displs[j] + send_counts[j]] = payload(r, j)
    recv_counts = [sizes(i, r) for i in range(n)]
    recv_displs = [0] * n  # pieces from the last rank first, two-element gaps
    offset = 1
    for i in reversed(range(n)):
        recv_displs[i] = offset
        offset += recv_counts[i] + 2
    recv_t = torch.full((offset,), -1, dtype=torch.int64)
    C.alltoall_v(send_t, send_counts, send_displs, recv_t, recv_counts, recv_displs, comm=comm)
    want = torch.full((offset,), -1, dtype=torch.int64)
    for i in range(n):
        want[recv_displs[i] : recv_displs[i] + recv_counts[i]] = payload(i, r)
    assert torch.equal(recv_t, want), f"{tag} alltoall_v {recv_t.tolist()} != {want.tolist()}"
    # packed counts go straight through, into a 2-D buffer
    packed = torch.cat([payload(r, j) for j in range(n)])
    recv_t = torch.empty(sum(recv_counts), 1, dtype=torch.int64)
    C.alltoall_v(
        packed,
        send_counts,
        [sum(send_counts[:j]) for j in range(n)],
        recv_t,
        recv_counts,
        [sum(recv_counts[:i]) for i in range(n)],
        comm=comm,
    )
    assert torch.equal(recv_t.view(-1), torch.cat([payload(i, r) for i in range(n)])), f"{tag} alltoall_v packed"
    # objects, barrier, point to point (0 <-> every other rank)
    for src in sorted({0, n - 1}):
        got = C.broadcast_object({"from": r, "list": [r] * 3} if r == src else None, src=src, comm=comm)
        assert got == {"from": src, "list": [src] * 3}, f"{tag} broadcast_object {got}"
    C.barrier(comm=comm)
    if n > 1:
        if r == 0:
            for peer in range(1, n):
                C.send(torch.full((2, 3), float(peer)), dst=peer, comm=comm)
            for peer in range(1, n):
                t = torch.empty(3, 2).t()
                C.recv(t, src=peer, comm=comm)
                assert torch.equal(t, (torch.arange(6.0).view(3, 2) + peer).t()), f"{tag} recv from {peer}"
        else:
            t = torch.empty(6)
            C.recv(t, src=0, comm=comm)
            assert torch.equal(t, torch.full((6,), float(r))), f"{tag} recv {t}"
            C.send((torch.arange(6.0).view(3, 2) + r).t(), dst=0, comm=comm)  # non-contiguous send


def check_preconditions(comm: C.Communicator) -> None:
    """Every size/dtype/rank check raises on the calling rank before any
    communication (root-side checks: every rank names itself the root)."""
    n, r = comm.nranks(), comm.rank()
    f, i = torch.zeros(4), torch.zeros(4, dtype=torch.int64)
    _expect(TypeError, lambda: C.allreduce(f, i, comm=comm), "communication.allreduce", "float32", "int64")
    _expect(
        ValueError,
        lambda: C.allreduce(f, torch.zeros(5), comm=comm),
        "communication.allreduce",
        "recv_tensor",
        "5",
        "4",
    )
    _expect(
        ValueError,
        lambda: C.allgather(f, torch.zeros(4 * n + 1), comm=comm),
        "communication.allgather",
        "recv_tensor",
        4 * n + 1,
        4 * n,
    )
    _expect(
        TypeError, lambda: C.allgather(f, torch.zeros(4 * n, dtype=torch.int64), comm=comm), "communication.allgather"
    )
    _expect(
        ValueError,
        lambda: C.reduce_scatter(torch.zeros(3 * n + 1), torch.zeros(3), comm=comm),
        "communication.reduce_scatter",
        "send_tensor",
        3 * n + 1,
        3 * n,
    )
    if n > 1:
        _expect(
            ValueError,
            lambda: C.alltoall(torch.zeros(n + 1), torch.zeros(n + 1), comm=comm),
            "communication.alltoall",
            "send_tensor",
            n + 1,
            "divisible",
        )
        _expect(
            ValueError,
            lambda: C.allgather_inplace(torch.zeros(n + 1), comm=comm),
            "communication.allgather_inplace",
            n + 1,
            "divisible",
        )
        _expect(
            ValueError,
            lambda: C.reduce_scatter_inplace(torch.zeros(n + 1), comm=comm),
            "communication.reduce_scatter_inplace",
            n + 1,
        )
        _expect(ValueError, lambda: C.alltoall_inplace(torch.zeros(n + 1), comm=comm), "communication.alltoall_inplace")
    _expect(
        ValueError,
        lambda: C.alltoall(torch.zeros(2 * n), torch.zeros(3 * n), comm=comm),
        "communication.alltoall",
        "recv_tensor",
        3 * n,
        2 * n,
    )
    _expect(
        ValueError,
        lambda: C.alltoall_v(f, [1] * (n + 1), [0] * (n + 1), f, [1] * n, [0] * n, comm=comm),
        "communication.alltoall_v",
        "send_counts",
    )
    _expect(
        ValueError,
        lambda: C.alltoall_v(f, [1] * n, [0] * n, f, [3] * n, [2] * n, comm=comm),
        "communication.alltoall_v",
        "recv_tensor",
        "[2, 5)",
    )
    for bad in (n, -1, 1.0, None):
        _expect(ValueError, lambda: C.broadcast(f, src=bad, comm=comm), "communication.broadcast", "src", f"size {n}")
    _expect(ValueError, lambda: C.reduce(f, f.clone(), dst=n, comm=comm), "communication.reduce", "dst")
    _expect(
        ValueError,
        lambda: C.gather(f, torch.zeros(4 * n + 2), dst=r, comm=comm),
        "communication.gather",
        "recv_tensor",
        4 * n + 2,
        4 * n,
    )
    _expect(
        ValueError,
        lambda: C.gather_inplace(torch.zeros(7), 2, dst=r, comm=comm),
        "communication.gather_inplace",
        7,
        2 * n,
    )
    _expect(
        ValueError,
        lambda: C.scatter(torch.zeros(2 * n + 1), torch.zeros(2), src=r, comm=comm),
        "communication.scatter",
        "send_tensor",
        2 * n + 1,
        2 * n,
    )
    _expect(
        ValueError,
        lambda: C.scatter_inplace(torch.zeros(2 * n + 1), 2, src=r, comm=comm),
        "communication.scatter_inplace",
    )
    _expect(ValueError, lambda: C.broadcast_object(1, src=n, comm=comm), "communication.broadcast_object")
    _expect(ValueError, lambda: C.send(f, dst=r, comm=comm), "communication.send", "own rank")
    _expect(ValueError, lambda: C.recv(f, src=n, comm=comm), "communication.recv", "src")
    _expect(TypeError, lambda: C.allreduce_inplace(f, op="sum", comm=comm), "communication.allreduce_inplace")
    _expect(ValueError, lambda: C.allreduce_inplace(i, op=4, comm=comm), "4 is not a ReduceOp")
    _expect(TypeError, lambda: C.allreduce_inplace([1, 2], comm=comm), "communication.allreduce_inplace", "tensor")
    _expect(TypeError, lambda: C.barrier(comm="world"), "Communicator")
    C.barrier(comm=comm)  # the group is still in step after all that
    # Bagua ints and torch ops are accepted too
    t = torch.full((3,), r + 1, dtype=torch.int64)
    C.allreduce_inplace(t, op=int(C.ReduceOp.MAX), comm=comm)
    assert t.tolist() == [n] * 3
    t = torch.full((3,), r + 1, dtype=torch.int64)
    C.allreduce_inplace(t, op=dist.ReduceOp.MIN, comm=comm)
    assert t.tolist() == [1] * 3


def check_one_host_membership(rank: int, world: int) -> None:
    g = C.new_group()
    assert g.ranks == list(range(world)) and g.hosts == [list(range(world))]
    glob, intra, inter = g.get_global_communicator(), g.get_intra_node_communicator(), g.get_inter_node_communicator()
    assert (glob.rank(), glob.nranks()) == (rank, world)
    assert (intra.rank(), intra.nranks(), intra.ranks) == (rank, world, list(range(world)))
    if rank == 0:
        assert (inter.rank(), inter.nranks(), inter.ranks) == (0, 1, [0])
    else:
        assert inter is None
    # a subgroup that leaves rank 0 out; given out of order
    if world >= 2:
        members = list(range(1, world))
        sub = C.new_group(members[::-1])
        assert sub.ranks == members
        if rank == 0:
            assert sub.get_global_communicator() is None and sub.get_intra_node_communicator() is None
            assert sub.get_inter_node_communicator() is None
        else:
            comm = sub.get_global_communicator()
            assert (comm.rank(), comm.nranks()) == (rank - 1, world - 1)
            check_reductions(comm, "subgroup")
            t = torch.full((2,), float(rank))
            C.broadcast(t, src=comm.nranks() - 1, comm=comm)  # group rank, i.e. global rank world-1
            assert t.tolist() == [float(world - 1)] * 2
        C.barrier()
    # one host: hierarchical is the flat all-reduce
    calls = _count_hierarchical()
    check_reductions(g.get_global_communicator(), "one-host hierarchical", hierarchical=True)
    assert calls == []


def run_world(rank: int, world: int) -> None:
    """Everything on the default (groupcomm) group and on a wrapped gloo group."""
    assert C.is_initialized()
    if world == 2:
        check_seed_examples(rank)
    default = C.get_default_group().get_global_communicator()
    assert (default.rank(), default.nranks()) == (rank, world)
    check_reductions(default, "default")
    check_movement(default, "default")
    check_preconditions(default)
    # comm=None is the default group's global communicator
    t = torch.full((2,), float(rank))
    C.allreduce_inplace(t)
    assert t.tolist() == [float(sum(range(world)))] * 2
    check_one_host_membership(rank, world)
    # a gloo group made with torch, wrapped
    _expect(TypeError, lambda: C.from_torch_group("world"), "communication.from_torch_group", "ProcessGroup")
    gloo = C.from_torch_group(dist.new_group(backend="gloo"))
    comm = gloo.get_global_communicator()
    assert dist.get_backend(comm.group) == "gloo" and comm.nranks() == world
    assert dist.get_backend(gloo.get_intra_node_communicator().group) == "gloo"
    check_reductions(comm, "gloo")
    check_movement(comm, "gloo")
    check_preconditions(comm)


def _count_hierarchical() -> list:
    """Count the all-reduces that take the three-stage path."""
    calls = []
    real = C._hierarchical_allreduce
    C._hierarchical_allreduce = lambda *a: (calls.append(1), real(*a))[1]
    return calls


def run_two_hosts(rank: int, world: int) -> None:
    """GROUPCOMM_HOST_ID = a a b b: membership, and hierarchical == flat."""
    calls = _count_hierarchical()
    g = C.new_group(hierarchical=True)
    assert g.hosts == [[0, 1], [2, 3]]
    intra, inter = g.get_intra_node_communicator(), g.get_inter_node_communicator()
    assert (intra.rank(), intra.nranks(), intra.ranks) == (rank % 2, 2, [0, 1] if rank < 2 else [2, 3])
    if rank in (0, 2):
        assert (inter.rank(), inter.nranks(), inter.ranks) == (rank // 2, 2, [0, 2])
    else:
        assert inter is None
    # the group's flag, the keyword, and the lazily made default group
    check_reductions(g.get_global_communicator(), "hosts group", hierarchical=False)
    check_reductions(C.get_default_group().get_global_communicator(), "hosts default", hierarchical=True)
    check_movement(g.get_global_communicator(), "hosts")
    # hierarchical == flat on random floats (allclose) and wrapping ints (exact)
    comm = g.get_global_communicator()
    gen = torch.Generator().manual_seed(rank)
    for dtype, data in (
        (torch.float32, torch.randn(1000, generator=gen)),
        (torch.int64, torch.randint(-(2**62), 2**62, (1000,), generator=gen)),
        (torch.int32, torch.randint(-(2**31), 2**31, (1000,), generator=gen).to(torch.int32)),
    ):
        for op in C.ReduceOp:
            if not _float_ok(op, dtype):
                continue
            flat, hier = torch.empty_like(data), torch.empty_like(data)
            C.allreduce(data, flat, op=op, comm=comm, hierarchical=False)
            C.allreduce(data, hier, op=op, comm=comm, hierarchical=True)
            if dtype.is_floating_point:
                torch.testing.assert_close(hier, flat, msg=lambda m: f"hier {op.name}: {m}")
            else:
                assert torch.equal(hier, flat), f"hier {op.name}/{dtype} differs"
    # a subgroup whose hosts are uneven: [1] on a, [2, 3] on b; rank 0 outside
    sub = C.new_group([1, 2, 3], hierarchical=True)
    assert sub.hosts == [[1], [2, 3]]
    if rank == 0:
        assert sub.get_global_communicator() is None and sub.get_inter_node_communicator() is None
    else:
        intra, inter = sub.get_intra_node_communicator(), sub.get_inter_node_communicator()
        assert intra.ranks == ([1] if rank == 1 else [2, 3])
        assert (inter.ranks if inter else None) == ([1, 2] if rank in (1, 2) else None)
        check_reductions(sub.get_global_communicator(), "uneven hosts", hierarchical=True)
    C.barrier()
    assert len(calls) > 50, len(calls)


def run_init(rank: int, world: int, store_path: str) -> None:
    """communication.init_process_group from torchrun's variables, then over a store."""
    assert not C.is_initialized()
    _expect(RuntimeError, C.get_default_group, "init_process_group")
    port = os.environ.pop("MASTER_PORT")
    _expect(RuntimeError, C.init_process_group, "MASTER_PORT")
    os.environ["MASTER_PORT"] = port
    C.init_process_group()
    assert C.is_initialized() and dist.get_backend() == "groupcomm"
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    _expect(RuntimeError, C.init_process_group, "already initialised")
    g = C.get_default_group()
    assert g.ranks == list(range(world))
    t = torch.full((3,), rank + 1, dtype=torch.int64)
    C.allreduce_inplace(t, op=C.ReduceOp.PRODUCT)
    assert t.tolist() == [torch.arange(1, world + 1).prod().item()] * 3
    C.allreduce_inplace(t, op=C.ReduceOp.SUM, comm=g.get_intra_node_communicator(), hierarchical=True)
    assert t.tolist() == [world * torch.arange(1, world + 1).prod().item()] * 3  # one host: intra is everyone
    dist.destroy_process_group()
    assert not C.is_initialized()
    C.init_process_group(store=dist.FileStore(store_path, world))
    assert C.get_default_group() is not g and dist.get_backend() == "groupcomm"
    t = torch.full((2,), float(rank))
    C.allreduce_inplace(t, op=C.ReduceOp.AVG)
    assert t.tolist() == [sum(range(world)) / world] * 2
    dist.destroy_process_group()


# -- the tests ------------------------------------------------------------------


def test_reduce_op_values_and_parse() -> None:
    values = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "BOR": 7, "BAND": 8, "BXOR": 9, "AVG": 10}
    assert {op.name: op.value for op in C.ReduceOp} == values
    for op in C.ReduceOp:
        assert Reduction.parse(op).kind == Kind[op.name]
        assert Reduction.parse((op, None)).kind == Kind[op.name]
        assert C.to_torch_op(op) == getattr(dist.ReduceOp, op.name)
        assert C.to_torch_op(int(op)) == getattr(dist.ReduceOp, op.name)
    # plain ints and torch ops keep c10d's meaning in Reduction.parse
    assert Reduction.parse(1).kind == Kind.AVG and Reduction.parse((1, None)).kind == Kind.AVG
    assert Reduction.parse(dist.ReduceOp.AVG).kind == Kind.AVG
    Reduction.parse(C.ReduceOp.BAND).check(torch.int64)
    _expect(TypeError, lambda: Reduction.parse(C.ReduceOp.BXOR).check(torch.float32, "x"), "BXOR", "float32")
    _expect(ValueError, lambda: C.to_torch_op(5), "5 is not a ReduceOp")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_functional_api(world: int) -> None:
    run_ranks(run_world, world)


def test_two_hosts_hierarchical() -> None:
    run_ranks(run_two_hosts, 4, env={"GROUPCOMM_HOST_ID": ["a", "a", "b", "b"]})


def test_init_process_group(tmp_path) -> None:
    run_ranks(run_init, 2, backend=None, args=(str(tmp_path / "store"),))
