"""Reference inputs and results, computed with plain torch math on every rank."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

R = dist.ReduceOp
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
COMPLEX = [torch.complex64, torch.complex128]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + COMPLEX + INTS + [torch.bool]
OPS = {
    "SUM": R.SUM,
    "AVG": R.AVG,
    "PRODUCT": R.PRODUCT,
    "MIN": R.MIN,
    "MAX": R.MAX,
    "BAND": R.BAND,
    "BOR": R.BOR,
    "BXOR": R.BXOR,
    "PREMUL_SUM": "premul",
}
PREMUL_FACTOR = 2.5


def meaningful(op: str, dtype: torch.dtype) -> bool:
    """The contract from the issue: which op/dtype pairs must work."""
    if dtype in FLOATS:
        return op in {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"}
    if dtype in COMPLEX:
        return op in {"SUM", "AVG", "PRODUCT", "PREMUL_SUM"}
    if dtype in INTS:
        return op != "PREMUL_SUM"
    return op not in {"AVG", "PREMUL_SUM"}  # bool


def torch_op(op: str):
    """The ReduceOp object to pass to torch.distributed."""
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return OPS[op]


def make_input(rank: int, dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Deterministic per-rank data; small integers keep float products exact."""
    g = torch.Generator().manual_seed(7919 * seed + 31 * rank + n)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype in COMPLEX:
        re = torch.randint(-3, 4, (n,), generator=g).double()
        im = torch.randint(-3, 4, (n,), generator=g).double()
        return torch.complex(re, im).to(dtype)
    if dtype in FLOATS:
        return torch.randint(-4, 5, (n,), generator=g).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**20)), min(info.max, 2**20)
    return torch.randint(low, high + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def fold(fn: Callable, xs: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(fn, xs)


def expected(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """Reduce the ranks' inputs with plain torch math."""
    dtype = xs[0].dtype
    world = len(xs)
    wide = (
        [x.to(torch.complex128 if dtype in COMPLEX else torch.float64) for x in xs]
        if dtype in FLOATS + COMPLEX
        else None
    )
    if dtype == torch.bool:
        table = {
            "SUM": torch.logical_or,
            "MAX": torch.logical_or,
            "PRODUCT": torch.logical_and,
            "MIN": torch.logical_and,
            "BAND": torch.bitwise_and,
            "BOR": torch.bitwise_or,
            "BXOR": torch.bitwise_xor,
        }
        return fold(table[op], xs)
    if op == "SUM":
        return fold(torch.add, wide).to(dtype) if wide else fold(torch.add, xs)
    if op == "AVG":
        if wide:
            return (fold(torch.add, wide) / world).to(dtype)
        return torch.div(fold(torch.add, xs), world, rounding_mode="trunc")
    if op == "PRODUCT":
        return fold(torch.mul, wide).to(dtype) if wide else fold(torch.mul, xs)
    if op == "MIN":
        return fold(torch.minimum, xs)
    if op == "MAX":
        return fold(torch.maximum, xs)
    if op == "PREMUL_SUM":
        return fold(torch.add, [PREMUL_FACTOR * w for w in wide]).to(dtype)
    return fold({"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op], xs)


def assert_close(actual: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Exact for integers and bool; a dtype-appropriate tolerance for floats."""
    assert actual.dtype == want.dtype, f"{what}: dtype {actual.dtype} != {want.dtype}"
    assert actual.shape == want.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(want.shape)}"
    if actual.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(actual, want, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")
    elif actual.is_floating_point() or actual.is_complex():
        torch.testing.assert_close(actual, want, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, want), f"{what}: {actual.tolist()} != {want.tolist()}"
