"""Reduce operations: which (op, dtype) pairs mean something, how each
transport's kernels carry them (:func:`wire_plan`), and the math.

Every communicator reduces through :func:`reduce_stacked` so that all paths
agree on semantics:

* float16/bfloat16 are accumulated in float32 and rounded once at the end.
* Integer AVG is the wrapped integer sum divided by the world size, truncated
  toward zero (what NCCL's ``ncclAvg`` does for integers).
* On bool, SUM is logical or and PRODUCT logical and (as torch's NCCL backend
  maps them); AVG and PREMUL_SUM are rejected.
* PREMUL_SUM multiplies each rank's input by the factor, then sums; it is
  defined for floating and complex dtypes only.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable

import torch


class Kind(enum.IntEnum):
    """c10d's ``ReduceOp.RedOpType`` values."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


_FLOATING = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}
_INTEGER = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
_BITWISE = {Kind.BAND, Kind.BOR, Kind.BXOR}
# Floating dtypes torch has no CPU reduction kernels for: reducing them would
# fail half-way through a collective, so they are refused up front.
UNREDUCIBLE = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
)

_ALLOWED = {
    "floating": {Kind.SUM, Kind.AVG, Kind.PRODUCT, Kind.MIN, Kind.MAX, Kind.PREMUL_SUM},
    "complex": {Kind.SUM, Kind.AVG, Kind.PRODUCT, Kind.PREMUL_SUM},
    "integer": {Kind.SUM, Kind.AVG, Kind.PRODUCT, Kind.MIN, Kind.MAX} | _BITWISE,
    "bool": {Kind.SUM, Kind.PRODUCT, Kind.MIN, Kind.MAX} | _BITWISE,
}


def _family(dtype: torch.dtype) -> str:
    if dtype in _FLOATING or dtype.is_floating_point:
        return "floating"
    if dtype in _COMPLEX or dtype.is_complex:
        return "complex"
    if dtype == torch.bool:
        return "bool"
    if dtype in _INTEGER:
        return "integer"
    return "unknown"


@dataclass(frozen=True)
class Reduction:
    """A reduce op as the C++ bridge hands it over: kind plus premul factor."""

    kind: Kind
    factor: float | torch.Tensor | None = None

    @classmethod
    def parse(cls, op: object) -> Reduction:
        """Accept ``(kind, factor)`` from the bridge, a ``ReduceOp`` or a kind.

        A Python enum member (e.g. Bagua's ``communication.ReduceOp``) maps by
        name, since its values are not c10d's (Bagua's AVG is 10)."""
        if type(op) is tuple and op[1] is None and type(op[0]) is int:
            cached = _PLAIN.get(op[0])
            if cached is not None:
                return cached
        factor = None
        if isinstance(op, tuple):
            op, factor = op
        if isinstance(op, enum.Enum):
            if op.name not in Kind.__members__:
                raise ValueError(f"groupcomm: unknown reduce op {op!r}")
            op = Kind[op.name]
        if isinstance(op, torch.distributed.ReduceOp):
            op = op.op if hasattr(op, "op") else int(op)
        if isinstance(op, torch.distributed.ReduceOp.RedOpType):
            op = int(op)
        try:
            kind = Kind(int(op))
        except (TypeError, ValueError):
            raise ValueError(f"groupcomm: unknown reduce op {op!r}") from None
        if kind == Kind.PREMUL_SUM and factor is None:
            raise ValueError("groupcomm: PREMUL_SUM needs a factor (use dist._make_nccl_premul_sum)")
        return cls(kind, factor)

    def check(self, dtype: torch.dtype, op_name: str = "reduction") -> None:
        """Raise TypeError if this op has no meaning on ``dtype`` or torch cannot compute it."""
        if (self.kind, dtype) in _MEANINGFUL:
            return
        family = _family(dtype)
        if self.kind not in _ALLOWED.get(family, set()) or dtype in UNREDUCIBLE:
            raise TypeError(f"groupcomm: {op_name} with ReduceOp.{self.kind.name} is not defined for dtype {dtype}")


# The common cases, looked up instead of recomputed on every call.
_PLAIN = {int(kind): Reduction(kind) for kind in Kind if kind != Kind.PREMUL_SUM}
_MEANINGFUL = {
    (kind, dtype)
    for dtype in sorted(_FLOATING | _COMPLEX | _INTEGER | {torch.bool}, key=str)
    for kind in _ALLOWED[_family(dtype)]
}


# bool travels as uint8 0/1, where these ops give logical or / and
_BOOL_AS_UINT8 = {
    Kind.SUM: Kind.MAX,
    Kind.PRODUCT: Kind.MIN,
    Kind.MIN: Kind.MIN,
    Kind.MAX: Kind.MAX,
    Kind.BAND: Kind.BAND,
    Kind.BOR: Kind.BOR,
    Kind.BXOR: Kind.BXOR,
}
# and without bitwise kernels, or is MAX and and is MIN
_BOOL_WITHOUT_BITWISE = {Kind.BAND: Kind.MIN, Kind.BOR: Kind.MAX}
# complex reduces as independent (re, im) pairs for these ops
_COMPLEX_AS_REAL = {Kind.SUM, Kind.AVG, Kind.PREMUL_SUM}


def _as_uint8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _as_real(tensor: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(tensor).view(-1)


@dataclass(frozen=True)
class WirePlan:
    """How a transport's kernels carry one (dtype, op): the tensor seen
    through ``view`` (``None``: as it is) is reduced as ``dtype`` with ``kind``."""

    view: Callable[[torch.Tensor], torch.Tensor] | None
    dtype: torch.dtype
    kind: Kind

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the kernel sees it."""
        return tensor if self.view is None else self.view(tensor)


def wire_plan(dtype: torch.dtype, kind: Kind, bitwise: bool = True) -> WirePlan | None:
    """How kernels that know real and integer dtypes carry ``kind`` on
    ``dtype`` (``bitwise``: whether they have BAND/BOR/BXOR): bool as uint8,
    complex as (re, im) pairs of its real dtype where the op acts on each
    part alone. ``None`` where they cannot; the caller then reduces with
    :func:`reduce_stacked`. The transport still asks its kernels whether they
    take the planned (dtype, kind)."""
    if dtype in UNREDUCIBLE:
        return None
    if dtype == torch.bool:
        carried = _BOOL_AS_UINT8.get(kind)
        if carried in _BITWISE and not bitwise:
            carried = _BOOL_WITHOUT_BITWISE.get(carried)
        return None if carried is None else WirePlan(_as_uint8, torch.uint8, carried)
    if dtype.is_complex:
        if kind not in _COMPLEX_AS_REAL or dtype == torch.complex32:
            return None
        return WirePlan(_as_real, dtype.to_real(), kind)
    return WirePlan(None, dtype, kind)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.complex32:
        return torch.complex64
    return dtype


def reduce_stacked(stacked: torch.Tensor, reduction: Reduction, out: torch.Tensor) -> None:
    """Reduce ``stacked`` (``[world, ...]``, one row per rank) over dim 0 into ``out``."""
    kind = reduction.kind
    dtype = stacked.dtype
    world = stacked.shape[0]
    if kind in _BITWISE:
        fn = {Kind.BAND: torch.bitwise_and, Kind.BOR: torch.bitwise_or, Kind.BXOR: torch.bitwise_xor}[kind]
        out.copy_(functools.reduce(fn, stacked.unbind(0)))
        return
    if dtype == torch.bool:
        if kind in (Kind.SUM, Kind.MAX):
            out.copy_(stacked.any(0))
        else:  # PRODUCT, MIN
            out.copy_(stacked.all(0))
        return
    if kind == Kind.MIN:
        out.copy_(stacked.amin(0))
        return
    if kind == Kind.MAX:
        out.copy_(stacked.amax(0))
        return
    acc = stacked.to(_accumulation_dtype(dtype))
    if kind == Kind.PRODUCT:
        out.copy_(acc.prod(0))
        return
    if kind == Kind.PREMUL_SUM:
        factor = reduction.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.to(device=acc.device, dtype=acc.dtype)
        out.copy_((acc * factor).sum(0))
        return
    total = acc.sum(0)
    if kind == Kind.AVG:
        if _family(dtype) == "integer":
            total = torch.div(total.to(dtype), world, rounding_mode="trunc")
        else:
            total = total / world
    out.copy_(total)


def fold_pair(mine: torch.Tensor, theirs: torch.Tensor, reduction: Reduction, mine_first: bool) -> None:
    """Reduce two ranks' contributions into ``mine``, in place (``theirs``
    is the other rank's; ``mine_first``: this rank's comes first in rank
    order). A sum of 32- or 64-bit numbers adds in place; every other case
    reduces the two stacked in rank order (``reduce_stacked``)."""
    if reduction.kind == Kind.SUM and mine.dtype != torch.bool and mine.element_size() >= 4:
        mine.add_(theirs)
        return
    pair = (mine, theirs) if mine_first else (theirs, mine)
    reduce_stacked(torch.stack(pair), reduction, mine)


def divide_(tensor: torch.Tensor, n: int) -> None:
    """AVG after a SUM, in place: ``tensor / n``; integers truncate toward zero
    (NCCL's ncclAvg on integers)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))
