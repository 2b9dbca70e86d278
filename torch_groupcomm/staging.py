"""Flat contiguous buffers for the communicators, which move 1-D contiguous
tensors only: a view of the caller's tensor where it is laid out so already,
otherwise a scratch copy whose result is written back afterwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a 1-D tensor of stride 1 (a view when it is contiguous)."""
    if tensor.dim() == 1 and tensor.stride(0) == 1:
        return tensor  # a view would cost as much as a small collective's copy
    flat_ = tensor.contiguous().view(-1)
    if flat_.stride(0) != 1:  # one element or none: torch calls any stride contiguous
        flat_ = flat_.as_strided((flat_.numel(),), (1,))
    return flat_


class Staged:
    """A flat stand-in for ``tensor``: ``flat`` is what the communicator reads
    and writes, ``commit()`` copies a result back into a non-contiguous
    ``tensor``. ``load=False`` leaves the scratch copy uninitialised (for a
    tensor that is only written)."""

    __slots__ = ("tensor", "flat", "copies")

    def __init__(self, tensor: torch.Tensor, load: bool = True) -> None:
        self.tensor = tensor
        self.copies = not tensor.is_contiguous()  # commit() has something to do
        if not self.copies:
            self.flat = flat(tensor)
        elif load:
            self.flat = flat(tensor.contiguous())
        else:
            self.flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)

    def commit(self) -> None:
        """Write the result back into ``tensor`` (nothing to do for a view)."""
        if self.copies:
            self.tensor.copy_(self.flat.view(self.tensor.shape))


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements one after another, in one new flat tensor."""
    return torch.cat([flat(t) for t in tensors]) if tensors else torch.empty(0)


def scatter_back(flat_: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive runs of ``flat_`` into ``tensors`` (the inverse of ``cat``)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat_[offset : offset + n].view(t.shape))
        offset += n


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as uint8 (transports that carry bytes, not dtypes)."""
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
