"""A communicator that carries CPU tensors over the group's gloo ``cpu_group``.

Every dtype travels as raw bytes, so gloo's own dtype and op limits do not
apply: reductions happen locally (see ``reduction.py``). This is the portable
path: any group, any host layout.
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional

import torch
from torch._C import _distributed_c10d as c10d

from .base import DeviceCommunicatorBase, DoneHandle, Handle


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class _Posted:
    """A gloo send/recv whose wait() also ends when the communicator is aborted."""

    __slots__ = ("_work", "_comm")

    def __init__(self, work, comm: "GlooCommunicator") -> None:
        self._work, self._comm = work, comm

    def wait(self) -> None:
        self._comm._wait(self._work)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class GlooCommunicator(DeviceCommunicatorBase):
    """CPU collectives over gloo (TCP), on byte views of any dtype."""

    name = "gloo"
    _aborted = False

    def abort(self) -> None:
        self._aborted = True

    def _wait(self, work) -> None:
        """``work.wait()``, except that ``abort()`` from another thread ends it
        (gloo's own abort does not wake a waiter)."""
        if not work.is_completed():
            try:
                done = threading.Event()
                work.get_future().add_done_callback(lambda _: done.set())
                pause = None
            except RuntimeError:  # gloo's send/recv work has no future: poll
                done, pause = None, 2e-5
            while not (done.wait(0.05) if done is not None else work.is_completed()):
                if self._aborted:
                    raise RuntimeError("groupcomm: gloo group aborted")
                if pause is not None:
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
        work.wait()

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
        self._wait(self.cpu_group.broadcast([_bytes(tensor)], opts))

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(input_)
            return
        opts = self._opts(c10d.AllgatherOptions)
        self._wait(self.cpu_group._allgather_base(_bytes(output), _bytes(input_), opts))

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
        if output.numel() == 0 and input_.numel() == 0:
            return
        size = input_.element_size()
        opts = self._opts(c10d.AllToAllOptions)
        self._wait(self.cpu_group.alltoall_base(
            _bytes(output),
            _bytes(input_),
            [n * size for n in output_sizes],
            [n * size for n in input_sizes],
            opts,
        ))

    def gather_into(self, outputs: Optional[List[torch.Tensor]], input_: torch.Tensor, dst: int) -> None:
        if input_.numel() == 0:
            return
        if self.world_size == 1:
            outputs[0].copy_(input_)
            return
        opts = self._opts(c10d.GatherOptions, rootRank=dst)
        self._wait(self.cpu_group.gather([[_bytes(o) for o in outputs]] if outputs else [], [_bytes(input_)], opts))

    def scatter_from(self, output: torch.Tensor, inputs: Optional[List[torch.Tensor]], src: int) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(inputs[0])
            return
        opts = self._opts(c10d.ScatterOptions, rootRank=src)
        self._wait(self.cpu_group.scatter([_bytes(output)], [[_bytes(i) for i in inputs]] if inputs else [], opts))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        if tensor.numel() == 0:
            return DoneHandle()
        return _Posted(self.cpu_group.send([_bytes(tensor)], dst, tag), self)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        if tensor.numel() == 0:
            return DoneHandle()
        return _Posted(self.cpu_group.recv([_bytes(tensor)], src, tag), self)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        work = self.cpu_group.recv_anysource([_bytes(tensor)], tag)
        self._wait(work)
        return work._source_rank()

    def barrier(self) -> None:
        self._wait(self.cpu_group.barrier(self._opts(c10d.BarrierOptions)))
