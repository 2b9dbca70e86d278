"""Bad arguments raise clear TypeError/ValueError on every rank without hanging
the group; a dead or silent peer makes the others raise within the timeout."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import NO_FR_DUMP, on_cpu_paths, run_ranks
from torch._C import _distributed_c10d as c10d


def _raises(fn, exc_type, *fragments: str) -> None:
    try:
        fn()
    except exc_type as exc:
        for fragment in fragments:
            assert fragment in str(exc), f"{fragment!r} not in error {str(exc)!r}"
        return
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {exc_type.__name__} ({fragments}), nothing raised")


def check_argument_errors(rank: int, world: int) -> None:
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    R = dist.ReduceOp
    # op/dtype pairs with no meaning
    _raises(lambda: dist.all_reduce(torch.ones(3), op=R.BXOR), TypeError, "BXOR", "torch.float32")
    _raises(lambda: dist.all_reduce(torch.ones(3), op=R.BAND), TypeError, "BAND", "torch.float32")
    _raises(
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0)),
        TypeError,
        "PREMUL_SUM",
        "torch.int32",
    )
    _raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=R.AVG), TypeError, "AVG", "torch.bool")
    _raises(
        lambda: dist.reduce_scatter_tensor(
            torch.empty(1, dtype=torch.float64), torch.ones(world, dtype=torch.float64), op=R.BOR
        ),
        TypeError,
        "BOR",
        "torch.float64",
    )
    _raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.complex64), op=R.MAX), ValueError, "MAX")
    # bad ranks
    opts = c10d.BroadcastOptions()
    opts.rootRank = world + 3
    _raises(
        lambda: backend.broadcast([torch.ones(2)], opts), ValueError, "broadcast", f"root {world + 3}", f"size {world}"
    )
    gopts = c10d.GatherOptions()
    gopts.rootRank = -1
    _raises(lambda: backend.gather([], [torch.ones(2)], gopts), ValueError, "gather", "root -1")
    _raises(lambda: backend.send([torch.ones(2)], world + 1, 0), ValueError, "send", f"peer {world + 1}")
    _raises(lambda: backend.recv([torch.ones(2)], rank, 0), ValueError, "recv", "own rank")
    # mismatched sizes and dtypes
    _raises(
        lambda: dist.all_gather_into_tensor(torch.empty(world * 2 + 1), torch.ones(2)),
        ValueError,
        "_allgather_base",
        f"{world * 2 + 1} elements",
        f"expected {world * 2}",
    )
    _raises(
        lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(world * 2 + 1)),
        ValueError,
        "_reduce_scatter_base",
        f"expected {world * 2}",
    )
    _raises(
        lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world), [1] * world, [2] * world),
        ValueError,
        "alltoall_base",
        "split sizes",
    )
    _raises(
        lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world), [1] * (world + 1), [1] * world),
        ValueError,
        "alltoall_base",
        f"need {world} entries",
    )
    if world > 1:
        _raises(
            lambda: dist.all_to_all_single(torch.empty(world * 2 + 1), torch.ones(world * 2 + 1)),
            ValueError,
            "not divisible by world size",
        )
    aopts = c10d.AllgatherOptions()
    _raises(
        lambda: backend.allgather([[torch.empty(2, dtype=torch.int64) for _ in range(world)]], [torch.ones(2)], aopts),
        TypeError,
        "allgather",
        "torch.int64",
        "torch.float32",
    )
    _raises(
        lambda: backend.allgather([[torch.empty(3) for _ in range(world)]], [torch.ones(2)], aopts),
        ValueError,
        "allgather",
        "3 elements",
        "expected 2",
    )
    _raises(
        lambda: backend.allgather([[torch.empty(2)] * (world + 1)], [torch.ones(2)], aopts),
        ValueError,
        f"needs {world} output tensors",
    )
    _raises(
        lambda: dist.all_reduce(torch.ones(3).to_sparse(), op=dist.ReduceOp.MIN),
        ValueError,
        "sparse tensor supports ReduceOp.SUM only",
        "ReduceOp.MIN",
    )
    check_bad_inputs(rank, world, backend)
    # the group is still in step after every refusal above
    _in_step(rank, world)


def _in_step(rank: int, world: int) -> None:
    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(sum(range(world)))))


def check_bad_inputs(rank: int, world: int, backend) -> None:
    """Each bad call, made the same way on every rank, is refused on every rank
    before any communication: the group is in step after each."""
    from torch_groupcomm import get_coordinator
    from torch_groupcomm.c10d.frontend import C10dFrontend
    from torch_groupcomm.c10d.registration import _frontend

    frontend = C10dFrontend(get_coordinator())  # for ops the backend's Python binding lacks
    # the checking frontend only under GROUPCOMM_DEBUG (no check on the hot path otherwise)
    checking = get_coordinator().config.debug and world > 1
    assert type(_frontend(get_coordinator())).__name__ == ("CheckedFrontend" if checking else "C10dFrontend")
    R = dist.ReduceOp
    meta = torch.empty(3, device="meta")
    sparse = torch.ones(3).to_sparse()
    cases = [
        # layouts and devices
        (
            lambda: backend.allgather([[torch.empty(3)] * world], [sparse], c10d.AllgatherOptions()),
            TypeError,
            ("allgather", "dense tensors only", "sparse_coo"),
        ),
        (
            lambda: backend.alltoall_base(torch.empty(world), sparse, [], [], c10d.AllToAllOptions()),
            TypeError,
            ("alltoall_base", "dense tensors only"),
        ),
        (lambda: backend.allreduce([meta], c10d.AllreduceOptions()), NotImplementedError, ("device type 'meta'",)),
        (lambda: backend.broadcast([meta], c10d.BroadcastOptions()), NotImplementedError, ("device type 'meta'",)),
        (
            lambda: backend.allreduce_coalesced([torch.ones(3), meta], c10d.AllreduceCoalescedOptions()),
            ValueError,
            ("allreduce_coalesced", "several devices", "meta"),
        ),
        # dtypes torch cannot reduce
        (lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn)), TypeError, ("allreduce", "float8_e4m3fn")),
        (
            lambda: dist.reduce_scatter_tensor(
                torch.empty(1).to(torch.float8_e5m2), torch.ones(world).to(torch.float8_e5m2), op=R.MAX
            ),
            TypeError,
            ("_reduce_scatter_base", "MAX", "float8_e5m2"),
        ),
        # ranks out of range
        (lambda: dist.reduce(torch.ones(2), dst=world + 2), ValueError, ("reduce", f"root {world + 2}")),
        (
            lambda: backend.scatter([torch.empty(2)], [], _opts(c10d.ScatterOptions, rootRank=world)),
            ValueError,
            ("scatter", f"root {world}"),
        ),
        (lambda: backend.recv([torch.empty(2)], world + 2, 0), ValueError, ("recv", f"peer {world + 2}")),
        (lambda: backend.send([torch.ones(2)], -1, 0), ValueError, ("send", "peer -1")),
        # output buffers of the wrong size
        (
            lambda: backend.reduce_scatter([torch.empty(3)], [[torch.ones(2)] * world], c10d.ReduceScatterOptions()),
            ValueError,
            ("reduce_scatter", "2 elements", "expected 3"),
        ),
        (
            lambda: dist.all_to_all_single(torch.empty(world * 2), torch.ones(world)),
            ValueError,
            ("alltoall_base", f"{world * 2} elements", f"expected {world}"),
        ),
        (
            lambda: backend.gather([[torch.empty(3)] * world], [torch.ones(2)], _opts(c10d.GatherOptions, rootRank=0)),
            ValueError,
            ("gather",),
        ),
        (
            lambda: backend.scatter(
                [torch.empty(2)], [[torch.ones(3)] * world], _opts(c10d.ScatterOptions, rootRank=0)
            ),
            ValueError,
            ("scatter",),
        ),
        # tensor lists of the wrong length or of mixed dtypes
        (
            lambda: backend.gather(
                [[torch.empty(2)] * (world + 1)], [torch.ones(2)], _opts(c10d.GatherOptions, rootRank=0)
            ),
            ValueError,
            ("gather",),
        ),
        (
            lambda: backend.scatter(
                [torch.empty(2)], [[torch.ones(2)] * (world + 1)], _opts(c10d.ScatterOptions, rootRank=0)
            ),
            ValueError,
            ("scatter",),
        ),
        (
            lambda: backend.reduce_scatter(
                [torch.empty(2)], [[torch.ones(2)] * (world + 1)], c10d.ReduceScatterOptions()
            ),
            ValueError,
            ("reduce_scatter", f"needs {world} input tensors"),
        ),
        (
            lambda: backend.alltoall([torch.empty(1)] * world, [torch.ones(1)] * (world + 1), c10d.AllToAllOptions()),
            ValueError,
            ("alltoall", f"needs {world} input and output tensors"),
        ),
        (
            lambda: backend.alltoall(
                [torch.empty(1)] * world, [torch.ones(1, dtype=torch.float64)] * world, c10d.AllToAllOptions()
            ),
            TypeError,
            ("alltoall", "torch.float64", "torch.float32"),
        ),
        (
            lambda: backend.allreduce_coalesced(
                [torch.ones(2), torch.ones(2, dtype=torch.float64)], c10d.AllreduceCoalescedOptions()
            ),
            TypeError,
            ("allreduce_coalesced", "torch.float64", "torch.float32"),
        ),
        (
            lambda: backend.reduce_scatter(
                [torch.empty(2)],
                [[torch.ones(2, dtype=torch.int32)] + [torch.ones(2)] * (world - 1)],
                c10d.ReduceScatterOptions(),
            ),
            TypeError,
            ("reduce_scatter", "torch.int32"),
        ),
        (
            lambda: frontend.allgather_into_tensor_coalesced(
                [torch.empty(2 * world)], [torch.ones(2), torch.ones(2)], False, -1
            ),
            ValueError,
            ("allgather_into_tensor_coalesced", "1 output tensors for 2 inputs"),
        ),
        (
            lambda: frontend.reduce_scatter_tensor_coalesced(
                [torch.empty(2)] * 2, [torch.ones(2 * world)], (0, None), False, -1
            ),
            ValueError,
            ("reduce_scatter_tensor_coalesced", "2 output tensors for 1 inputs"),
        ),
    ]
    for call, exc_type, fragments in cases:
        _raises(call, exc_type, *fragments)
        _in_step(rank, world)
    # a refusal on the root only (every rank passes the root's lists): the root
    # names the problem, the others that lists belong on the root
    if rank == 0:
        _raises(
            lambda: backend.gather([[torch.empty(3)] * world], [torch.ones(2)], _opts(c10d.GatherOptions, rootRank=0)),
            ValueError,
            "gather output has 3 elements, expected 2",
        )
        _raises(
            lambda: backend.scatter(
                [torch.empty(2)], [[torch.ones(2)] * (world + 1)], _opts(c10d.ScatterOptions, rootRank=0)
            ),
            ValueError,
            f"scatter on the root needs a list of {world} input tensors",
        )
        if hasattr(dist, "gather_single"):  # torch 2.14+; the others would wait for the root
            _raises(
                lambda: dist.gather_single(torch.ones(2), torch.empty(2 * world + 1), dst=0),
                ValueError,
                f"gather_single on the root needs an output of {2 * world} elements",
                f"got {2 * world + 1}",
            )
            _raises(
                lambda: dist.gather_single(torch.ones(2), torch.empty(4 * world)[::2], dst=0),
                ValueError,
                "gather_single's output must be contiguous",
            )
    else:
        _raises(
            lambda: backend.gather([[torch.empty(3)] * world], [torch.ones(2)], _opts(c10d.GatherOptions, rootRank=0)),
            ValueError,
            "gather takes output tensors on the root only",
        )
        _raises(
            lambda: backend.scatter(
                [torch.empty(2)], [[torch.ones(2)] * (world + 1)], _opts(c10d.ScatterOptions, rootRank=0)
            ),
            ValueError,
            "scatter takes input tensors on the root only",
        )
    _in_step(rank, world)


def _opts(cls, **fields):
    opts = cls()
    for key, value in fields.items():
        setattr(opts, key, value)
    return opts


@pytest.mark.parametrize("backend,world", [("groupcomm", 1), ("groupcomm", 3), ("cpu:groupcomm", 2)])
def test_argument_errors(backend: str, world: int) -> None:
    run_ranks(check_argument_errors, world, backend)


def test_reduction_parsing_errors() -> None:
    from torch_groupcomm.reduction import Reduction

    _raises(lambda: Reduction.parse((99, None)), ValueError, "unknown reduce op 99")
    _raises(lambda: Reduction.parse((8, None)), ValueError, "PREMUL_SUM needs a factor")
    assert Reduction.parse(dist.ReduceOp.MAX).kind.name == "MAX"


def check_dead_peer(rank: int, world: int) -> str:
    dist.barrier()
    if rank == world - 1:
        os._exit(0)
    time.sleep(1.0)
    start = time.monotonic()
    from torch_groupcomm import GroupCommError

    for async_op in (False, True):
        try:
            work = dist.all_reduce(torch.ones(100), async_op=async_op)
            if async_op:
                work.wait()
        except GroupCommError as exc:
            message = str(exc)
            assert "allreduce" in message and "group '0'" in message and f"rank {rank}" in message, message
        else:
            raise AssertionError("all_reduce with a dead peer did not raise")
    assert time.monotonic() - start < 30
    return "raised"


def test_dead_peer_raises() -> None:
    results = run_ranks(check_dead_peer, 2, may_die=(1,), group_timeout=timedelta(seconds=20))
    assert results[0] == "raised"


def check_silent_peer(rank: int, world: int) -> str:
    from torch_groupcomm import CommTimeoutError

    if rank == 1:
        time.sleep(12)
        os._exit(0)
    for op, call in (
        ("recv", lambda: dist.recv(torch.empty(10), 1)),
        ("allreduce", lambda: dist.all_reduce(torch.ones(10))),
    ):
        start = time.monotonic()
        try:
            call()
        except CommTimeoutError as exc:
            assert op in str(exc) and "timed out" in str(exc), str(exc)
        else:
            raise AssertionError(f"{op} with a silent peer did not time out")
        elapsed = time.monotonic() - start
        assert 2 <= elapsed < 5, (op, elapsed)
    return "timed out"


def test_silent_peer_times_out() -> None:
    results = run_ranks(check_silent_peer, 2, may_die=(1,), group_timeout=timedelta(seconds=3), env=NO_FR_DUMP)
    assert results[0] == "timed out"


def check_work_wait_timeout(rank: int, world: int) -> str:
    # gloo's semantics: Work.wait(timeout) raises when the op is not done in
    # time and the op goes on; a later wait() returns it, and the group works
    from torch_groupcomm import CommTimeoutError

    def all_reduce(t):
        return dist.all_reduce(t, async_op=True), [t]

    def all_gather(t):
        outs = [torch.empty_like(t) for _ in range(world)]
        return dist.all_gather(outs, t, async_op=True), outs

    total = float(sum(range(1, world + 1)))
    for name, issue, want in (
        ("allreduce", all_reduce, [torch.full((8,), total)]),
        ("allgather", all_gather, [torch.full((8,), float(r + 1)) for r in range(world)]),
    ):
        work, outs = issue(torch.full((8,), float(rank + 1)))  # everyone in time
        assert work.wait(timeout=timedelta(seconds=30)) is True
        if rank == 0:
            work, outs = issue(torch.full((8,), float(rank + 1)))
            start = time.monotonic()
            try:
                work.wait(timeout=timedelta(seconds=1))
            except CommTimeoutError as exc:
                message = str(exc)
                assert f"{name} on group '0' (rank 0 of {world})" in message and " 1000 ms" in message, message
                assert exc.op == name, exc.op
            else:
                raise AssertionError(f"{name}: wait(timeout) returned while the peers were away")
            assert 0.9 <= time.monotonic() - start < 5
            assert not work.is_completed()
        else:
            time.sleep(2.5)
            work, outs = issue(torch.full((8,), float(rank + 1)))
        work.wait()
        for out, expected in zip(outs, want):
            assert torch.equal(out, expected), (name, out, expected)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    return "ok"


@on_cpu_paths("shm-2", "gloo-3", "hosts-aab")
def test_work_wait_timeout(backend: str, world: int, env: dict, communicator: str) -> None:
    assert run_ranks(check_work_wait_timeout, world, backend, env=env) == ["ok"] * world


def check_debug_wrapper(rank: int, world: int) -> str:
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps our backend in torch's checker
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world)))
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    assert [o[0].item() for o in outs] == list(range(world))
    try:
        dist.all_reduce(torch.ones(3 + rank))  # shapes differ across ranks
    except RuntimeError as exc:
        assert "mismatch" in str(exc).lower(), str(exc)
        return "caught"
    raise AssertionError("mismatched collective went through")


def test_torch_debug_wrapper_catches_mismatch() -> None:
    results = run_ranks(check_debug_wrapper, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert results == ["caught", "caught"]


def check_monitored_barrier_names_missing_ranks(rank: int, world: int) -> str:
    # gloo's semantics, and gloo's state after it: a timed-out monitored barrier
    # closes rank 0's gloo pairs with the missing ranks (one failure per group)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend.monitored_barrier(timedelta(seconds=20), False)  # everyone arrives
    backend.monitored_barrier(timedelta(seconds=20), True)
    if rank == 0:  # ranks 1 and 2 never enter this one
        start = time.monotonic()
        try:
            backend.monitored_barrier(timedelta(seconds=1), True)
        except RuntimeError as exc:
            assert "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" in str(exc), str(exc)
        else:
            raise AssertionError("monitored_barrier passed with ranks missing")
        assert 1 <= time.monotonic() - start < 5
    dist.barrier()  # shared-memory collectives still work afterwards
    # the same through the coordinator, on any torch
    from torch_groupcomm import get_coordinator

    coordinator = get_coordinator(dist.new_group(backend="groupcomm"))
    coordinator.monitored_barrier(timedelta(seconds=20), wait_all_ranks=True)
    if rank == 0:
        try:
            coordinator.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        except RuntimeError as exc:
            assert "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" in str(exc), str(exc)
        else:
            raise AssertionError("coordinator.monitored_barrier passed with ranks missing")
    dist.barrier()
    return "ok"


def test_monitored_barrier_names_missing_ranks() -> None:
    assert run_ranks(check_monitored_barrier_names_missing_ranks, 3) == ["ok"] * 3
