"""The Bagua API's reduce ops and argument checks: every precondition of
``torch_groupcomm.communication`` is checked here, on the calling rank, before
any communication, with an error naming the function and the argument."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.distributed as dist

from ..checks import check_peer, check_rank
from ..reduction import Kind, Reduction
from .groups import Communicator


class ReduceOp(enum.IntEnum):
    """Bagua's reduction operations, with Bagua's values.

    The values are not c10d's (Bagua's AVG is 10, c10d's is 1), so members are
    matched by name wherever this package takes a reduce op: here, in
    :class:`torch_groupcomm.reduction.Reduction`, and through
    :func:`to_torch_op` for torch.distributed calls.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


#: What the functions take as ``op``: a ReduceOp, an int in Bagua's numbering, or a torch ReduceOp.
OpLike = Union[ReduceOp, int, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]


def to_torch_op(op: OpLike) -> dist.ReduceOp.RedOpType:
    """The ``torch.distributed.ReduceOp`` equal to ``op``.

    ``op`` is a :class:`ReduceOp`, a plain int read with Bagua's numbering
    (as Bagua's IntEnum would), or a torch ``ReduceOp`` (returned as is).
    """
    return parse_op("to_torch_op", op)[1]


def parse_op(fn: str, op: OpLike) -> tuple[Kind, Any]:
    """(kind, torch op) of a Bagua, int or torch reduce op."""
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        kind = Reduction.parse(op).kind
        return kind, op
    if type(op) is int:
        try:
            op = ReduceOp(op)
        except ValueError:
            raise ValueError(f"communication.{fn}: {op} is not a ReduceOp value") from None
    if not isinstance(op, ReduceOp):
        raise TypeError(f"communication.{fn}: op must be a communication.ReduceOp, got {op!r}")
    kind = Reduction.parse(op).kind
    return kind, getattr(dist.ReduceOp, kind.name)


def op_for(fn: str, op: OpLike, dtype: torch.dtype) -> tuple[Kind, Any]:
    """(kind, torch op), refusing pairs such as a bitwise op on floats up front."""
    kind, torch_op = parse_op(fn, op)
    if kind == Kind.PREMUL_SUM:
        raise ValueError(f"communication.{fn}: PREMUL_SUM is not supported here")
    Reduction(kind).check(dtype, f"communication.{fn}")
    return kind, torch_op


def check_tensor(fn: str, name: str, t: Any) -> None:
    """``t`` is a tensor, else TypeError naming the function and argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"communication.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_pair(fn: str, send: Any, recv: Any, send_name: str = "send_tensor", recv_name: str = "recv_tensor") -> None:
    """Send and receive buffers are tensors of one dtype on one device."""
    check_tensor(fn, send_name, send)
    check_tensor(fn, recv_name, recv)
    if send.dtype != recv.dtype:
        raise TypeError(f"communication.{fn}: {send_name} is {send.dtype} but {recv_name} is {recv.dtype}")
    if send.device != recv.device:
        raise ValueError(f"communication.{fn}: {send_name} is on {send.device} but {recv_name} on {recv.device}")


def check_numel(fn: str, name: str, t: torch.Tensor, expected: int, rule: str) -> None:
    """``t`` holds ``expected`` elements (``rule`` says why), else ValueError."""
    if t.numel() != expected:
        raise ValueError(f"communication.{fn}: {name} has {t.numel()} elements, expected {rule} = {expected}")


def check_divisible(fn: str, name: str, t: torch.Tensor, n: int) -> None:
    """``t`` splits into ``n`` equal parts, else ValueError."""
    if t.numel() % n:
        raise ValueError(f"communication.{fn}: {name} has {t.numel()} elements, not divisible by nranks = {n}")


def check_comm_rank(fn: str, name: str, value: Any, comm: Communicator) -> int:
    """``value`` is a rank of the communicator; returns it as an int."""
    return check_rank(f"communication.{fn}: {name}", value, comm.nranks(), "the communicator")


def check_comm_peer(fn: str, name: str, value: Any, comm: Communicator) -> int:
    """``value`` is another rank of the communicator; returns it as an int."""
    return check_peer(f"communication.{fn}: {name}", value, comm.rank(), comm.nranks(), "the communicator")


def check_counts(
    fn: str, what: str, counts: Sequence[int], displs: Sequence[int], t: torch.Tensor, n: int
) -> tuple[list[int], list[int]]:
    """Per-peer counts and displacements fit ``t``; returns them as int lists."""
    counts, displs = [int(c) for c in counts], [int(d) for d in displs]
    if len(counts) != n or len(displs) != n:
        raise ValueError(
            f"communication.{fn}: {what}_counts and {what}_displs need one entry per rank "
            f"(nranks {n}), got {len(counts)} and {len(displs)}"
        )
    for peer, (c, d) in enumerate(zip(counts, displs)):
        if c < 0 or d < 0 or d + c > t.numel():
            raise ValueError(
                f"communication.{fn}: {what}_tensor has {t.numel()} elements, but peer {peer} "
                f"needs [{d}, {d + c}) ({what}_displs[{peer}]={d}, {what}_counts[{peer}]={c})"
            )
    return counts, displs


def packed(counts: list[int], displs: list[int]) -> bool:
    """Whether the displacements lay the counts end to end from 0 (one plain all-to-all)."""
    offset = 0
    for c, d in zip(counts, displs):
        if d != offset:
            return False
        offset += c
    return True
