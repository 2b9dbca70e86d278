"""A communicator that carries CPU tensors over the group's gloo ``cpu_group``.

Every dtype travels as raw bytes, so gloo's own dtype and op limits do not
apply: reductions happen locally (see ``reduction.py``). This is the portable
path: any group, any host layout.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch._C import _distributed_c10d as c10d

from .base import DeviceCommunicatorBase, DoneHandle, Handle


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class GlooCommunicator(DeviceCommunicatorBase):
    """CPU collectives over gloo (TCP), on byte views of any dtype."""

    name = "gloo"

    def _opts(self, cls, **fields):
        opts = cls()
        if self.timeout is not None:
            opts.timeout = self.timeout
        for key, value in fields.items():
            setattr(opts, key, value)
        return opts

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() == 0:
            return
        opts = self._opts(c10d.BroadcastOptions, rootRank=src, rootTensor=0)
        self.cpu_group.broadcast([_bytes(tensor)], opts).wait()

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(input_)
            return
        opts = self._opts(c10d.AllgatherOptions)
        self.cpu_group._allgather_base(_bytes(output), _bytes(input_), opts).wait()

    def all_to_all_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_sizes: List[int],
        input_sizes: List[int],
    ) -> None:
        if self.world_size == 1:
            output.copy_(input_)
            return
        size = input_.element_size()
        opts = self._opts(c10d.AllToAllOptions)
        self.cpu_group.alltoall_base(
            _bytes(output),
            _bytes(input_),
            [n * size for n in output_sizes],
            [n * size for n in input_sizes],
            opts,
        ).wait()

    def gather_into(self, outputs: Optional[List[torch.Tensor]], input_: torch.Tensor, dst: int) -> None:
        if input_.numel() == 0:
            return
        if self.world_size == 1:
            outputs[0].copy_(input_)
            return
        opts = self._opts(c10d.GatherOptions, rootRank=dst)
        self.cpu_group.gather([[_bytes(o) for o in outputs]] if outputs else [], [_bytes(input_)], opts).wait()

    def scatter_from(self, output: torch.Tensor, inputs: Optional[List[torch.Tensor]], src: int) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(inputs[0])
            return
        opts = self._opts(c10d.ScatterOptions, rootRank=src)
        self.cpu_group.scatter([_bytes(output)], [[_bytes(i) for i in inputs]] if inputs else [], opts).wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        if tensor.numel() == 0:
            return DoneHandle()
        return self.cpu_group.send([_bytes(tensor)], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        if tensor.numel() == 0:
            return DoneHandle()
        return self.cpu_group.recv([_bytes(tensor)], src, tag)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        work = self.cpu_group.recv_anysource([_bytes(tensor)], tag)
        work.wait()
        return work._source_rank()

    def barrier(self) -> None:
        self.cpu_group.barrier(self._opts(c10d.BarrierOptions)).wait()
