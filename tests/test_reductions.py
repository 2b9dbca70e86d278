"""Every ReduceOp on every dtype, through every reducing collective, against
plain torch math; meaningless pairs must raise on every rank without a hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness import CPU_PATHS, assert_cpu_communicator, run_ranks, shm_segments
from _reference import COMPLEX, DTYPES, OPS, assert_close, expected, make_input, meaningful, torch_op


def _expect_error(fn, what: str, op: str, dtype: torch.dtype) -> None:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        message = str(exc)
        assert op in message and (str(dtype) in message or dtype in COMPLEX), f"{what}: unclear error {message!r}"
        return
    raise AssertionError(f"{what}: {op} on {dtype} did not raise")


def _check_pair(rank: int, world: int, op: str, dtype: torch.dtype, failures: list) -> None:
    tag = f"{op}/{dtype}"
    dst = world - 1
    chunk = 5
    sizes = [r + 1 for r in range(world)]
    offsets = [sum(sizes[:r]) for r in range(world)]

    def all_reduce(n: int):
        xs = [make_input(r, dtype, n) for r in range(world)]
        t = xs[rank].clone()
        dist.all_reduce(t, op=torch_op(op))
        return t, expected(op, xs)

    def reduce():
        xs = [make_input(r, dtype, 37) for r in range(world)]
        t = xs[rank].clone()
        dist.reduce(t, dst=dst, op=torch_op(op))
        return t, expected(op, xs) if rank == dst else xs[rank]

    def reduce_scatter_tensor():
        xs = [make_input(r, dtype, chunk * world, seed=1) for r in range(world)]
        out = torch.empty(chunk, dtype=dtype)
        dist.reduce_scatter_tensor(out, xs[rank].clone(), op=torch_op(op))
        return out, expected(op, xs)[rank * chunk:(rank + 1) * chunk]

    def reduce_scatter_uneven():
        xs = [make_input(r, dtype, sum(sizes), seed=2) for r in range(world)]
        out = torch.empty(sizes[rank], dtype=dtype)
        dist.reduce_scatter(out, list(xs[rank].clone().split(sizes)), op=torch_op(op))
        return out, expected(op, xs)[offsets[rank]:offsets[rank] + sizes[rank]]

    cases = {
        "all_reduce n=1": lambda: all_reduce(1),
        "all_reduce n=37": lambda: all_reduce(37),
        "all_reduce n=5003": lambda: all_reduce(5003),
        "reduce": reduce,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "reduce_scatter uneven": reduce_scatter_uneven,
    }
    for name, case in cases.items():
        # torch reduces complex all_reduce inputs as real pairs, so it refuses
        # PRODUCT there itself; the other collectives hand complex to us.
        refused = not meaningful(op, dtype) or (dtype in COMPLEX and op == "PRODUCT" and name.startswith("all_reduce"))
        try:
            if refused:
                _expect_error(case, f"{name} {tag}", op, dtype)
            else:
                actual, want = case()
                assert_close(actual, want, f"{name} {tag}")
        except AssertionError as exc:
            failures.append(str(exc))


def check_reduction_matrix(rank: int, world: int, communicator: str) -> list:
    failures: list = []
    for dtype in DTYPES:
        for op in OPS:
            _check_pair(rank, world, op, dtype, failures)
    # complex PRODUCT reaches our reduction when called on the communicator directly
    from torch_groupcomm import get_coordinator

    comm = get_coordinator().communicator_for(torch.device("cpu"))
    xs = [make_input(r, torch.complex128, 11) for r in range(world)]
    try:
        assert_close(comm.all_reduce(xs[rank], dist.ReduceOp.PRODUCT), expected("PRODUCT", xs), "complex PRODUCT")
    except AssertionError as exc:
        failures.append(str(exc))
    # a PREMUL_SUM whose factor is a tensor
    t = make_input(rank, torch.float32, 9)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(0.5)))
    try:
        want = sum(0.5 * make_input(r, torch.float32, 9).double() for r in range(world)).float()
        assert_close(t, want, "PREMUL_SUM tensor factor")
    except AssertionError as exc:
        failures.append(str(exc))
    # the group still works after all the refused calls
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world))), "group broken after errors"
    assert_cpu_communicator(communicator)
    return failures


@pytest.mark.parametrize("backend,world,env,communicator", [p[1:] for p in CPU_PATHS], ids=[p[0] for p in CPU_PATHS])
def test_reduction_matrix(backend: str, world: int, env: dict, communicator: str) -> None:
    results = run_ranks(check_reduction_matrix, world, backend, args=(communicator,), env=env)
    failures = sorted({f for rank_failures in results for f in rank_failures})
    assert not failures, "\n".join(failures)
    assert shm_segments() == []
