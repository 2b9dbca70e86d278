"""Tensor dictionaries on the wire: a picklable description first, then the
tensors' bytes, so a receiver can allocate before data arrives."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorMetadata:
    """What a receiver needs to allocate a tensor: device type, dtype, shape."""

    device: str
    dtype: torch.dtype
    size: torch.Size


Entry = tuple[str, Any]  # (key, TensorMetadata or a plain picklable value)


def split_tensor_dict(tensor_dict: dict[str, Any]) -> tuple[list[Entry], list[tuple[str, torch.Tensor]]]:
    """The dict's description (tensors replaced by their metadata, in key
    order) and its tensors, in the same order."""
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"groupcomm: expected a dict of tensors, got {type(tensor_dict).__name__}")
    entries: list[Entry] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            entries.append((key, TensorMetadata(value.device.type, value.dtype, value.size())))
            tensors.append((key, value))
        else:
            entries.append((key, value))
    return entries, tensors


def allocate(meta: TensorMetadata, device: torch.device) -> torch.Tensor:
    """An empty tensor for ``meta``: on the CPU for CPU tensors, else on ``device``."""
    where = torch.device("cpu") if meta.device == "cpu" else device
    return torch.empty(meta.size, dtype=meta.dtype, device=where)


def to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` pickled into a uint8 CPU tensor."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def from_bytes(tensor: torch.Tensor) -> Any:
    """The object :func:`to_bytes` packed."""
    return pickle.loads(tensor.numpy().tobytes())
