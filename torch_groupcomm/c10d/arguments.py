"""Checks of the arguments c10d hands the frontend: each raises TypeError or
ValueError naming the op and what was wrong, before anything is queued (so a
call refused on every rank leaves the group in step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch

from ..reduction import Reduction

Tensors = list[torch.Tensor]


def device_of(op: str, tensors: Sequence[torch.Tensor], check_device: Callable[[torch.device], None]) -> torch.device:
    """The one device of dense ``tensors`` (the CPU for none), served by a communicator."""
    if len(tensors) == 1 and tensors[0].layout == torch.strided:
        device = tensors[0].device
        check_device(device)
        return device
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"groupcomm: {op} got tensors on several devices: {sorted(map(str, devices))}")
    for t in tensors:
        if t.layout != torch.strided:
            raise TypeError(f"groupcomm: {op} supports dense tensors only, got layout {t.layout}")
    device = devices.pop() if devices else torch.device("cpu")
    check_device(device)
    return device


def check_dtypes(op: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """Every tensor has ``dtype``."""
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"groupcomm: {op} needs one dtype, got {t.dtype} and {dtype}")


def check_numel(op: str, what: str, got: int, expected: int) -> None:
    """``what`` has the ``expected`` number of elements."""
    if got != expected:
        raise ValueError(f"groupcomm: {op} {what} has {got} elements, expected {expected}")


def check_pairs(op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """One output per input."""
    if len(outputs) != len(inputs):
        raise ValueError(f"groupcomm: {op} got {len(outputs)} output tensors for {len(inputs)} inputs")


def reduction_of(op: str, reduce_op, tensors: Sequence[torch.Tensor]) -> Reduction:
    """The bridge's ``reduce_op``, checked against every tensor's dtype."""
    reduction = Reduction.parse(reduce_op)
    for t in tensors:
        reduction.check(t.dtype, op)
    return reduction


def allgather_sizes(op: str, outputs: Tensors, input_: torch.Tensor, rank: int, world_size: int) -> list[int]:
    """Elements each rank contributes to an all-gather into ``outputs`` (one per rank)."""
    if len(outputs) != world_size:
        raise ValueError(f"groupcomm: {op} needs {world_size} output tensors, got {len(outputs)}")
    check_dtypes(op, outputs, input_.dtype)
    sizes = [o.numel() for o in outputs]
    check_numel(op, f"output for rank {rank}", sizes[rank], input_.numel())
    return sizes


def split_elements(op: str, what: str, tensor: torch.Tensor, splits: list[int], world_size: int) -> list[int]:
    """Elements of ``tensor`` per peer of an all-to-all: its rows split by
    ``splits`` (evenly when empty), times the elements of a row."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_numel = tensor.numel() // rows if rows else 0
    if not splits:
        if rows % world_size:
            raise ValueError(
                f"groupcomm: {op} {what} has {rows} rows, not divisible by world size {world_size}; pass split sizes"
            )
        return [rows // world_size * row_numel] * world_size
    if len(splits) != world_size:
        raise ValueError(f"groupcomm: {op} {what} split sizes {list(splits)} need {world_size} entries")
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"groupcomm: {op} {what} split sizes {list(splits)} do not add up to its {rows} rows")
    return [s * row_numel for s in splits]
