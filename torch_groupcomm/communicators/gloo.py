"""A communicator that carries CPU tensors over the group's gloo ``cpu_group``.

Every dtype travels as raw bytes, so gloo's own dtype and op limits do not
apply: reductions happen locally (see ``reduction.py``). This is the portable
path: any group, any host layout.
"""

from __future__ import annotations

import threading

import torch
from torch._C import _distributed_c10d as c10d

from ..errors import CommTimeoutError, GroupCommError
from ..staging import as_bytes
from .base import DeviceCommunicatorBase, DoneTransfer, Transfer

ABORTED = "groupcomm: gloo group aborted"


def _finish(work) -> bool:
    """``work.wait()``, with gloo's failures typed as this package's: gloo
    raises a plain RuntimeError and says "timed out" when its timeout passed
    (the one place that reads another library's words)."""
    try:
        return work.wait()
    except GroupCommError:
        raise
    except RuntimeError as exc:
        text = str(exc).lower()
        timed_out = "timed out" in text or "timeout" in text
        raise (CommTimeoutError if timed_out else GroupCommError)(str(exc)) from exc


class _GlooTransfer:
    """A gloo send or recv; ``abort()`` of its communicator wakes its waiter."""

    __slots__ = ("work", "_comm")

    def __init__(self, work, comm: GlooCommunicator) -> None:
        self.work, self._comm = work, comm

    def wait(self) -> None:
        try:
            finished = _finish(self.work)
        finally:
            self._comm._forget(self)
        if not finished:  # gloo's answer to Work::abort()
            raise GroupCommError(ABORTED)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class GlooCommunicator(DeviceCommunicatorBase):
    """CPU collectives over gloo (TCP), on byte views of any dtype.

    Gloo wakes no waiter when its group is aborted, so collectives are waited
    for here through their future (``abort()`` ends that wait), and posted
    send/recv are aborted one by one (gloo does implement that). Every work
    is waited for and dropped through ``_C.AbortableWait``, so that gloo's
    threads never need the GIL (which would abort a process exiting while
    they still held one).
    """

    name = "gloo"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from .._native import _C

        self._lock = threading.Lock()
        self._aborted = False
        self._posted: set[_GlooTransfer] = set()
        self._waiter = _C.AbortableWait()

    def abort(self) -> None:
        from .._native import _C

        with self._lock:
            self._aborted = True
            posted, self._posted = list(self._posted), set()
        self._waiter.abort()
        for p in posted:
            _C.abort_work(p.work)

    def disconnect(self) -> None:
        # Dropping the last reference to the gloo group closes its
        # connections: a peer's gloo op waiting on this rank fails at once
        # ("Connection closed by peer"). Its threads are idle unless an
        # abort ended a wait before gloo's op did: then gloo's op runs on
        # until its timeout, and freeing the group would wait for it.
        # The kept works hold the group's connections open too.
        with self._lock:
            op_may_run = self._aborted
        self.abort()
        if not op_may_run:
            self._waiter.forget()
            self.cpu_group = None

    def _wait(self, work) -> None:
        if not self._waiter.wait(work):
            raise GroupCommError(ABORTED)
        _finish(work)

    def _post(self, work) -> Transfer:
        self._waiter.keep(work)
        posted = _GlooTransfer(work, self)
        with self._lock:
            if self._aborted:
                raise GroupCommError(ABORTED)
            self._posted.add(posted)
        return posted

    def _forget(self, posted: _GlooTransfer) -> None:
        with self._lock:
            self._posted.discard(posted)

    def _opts(self, cls, **fields):
        opts = cls()
        timeout = self.current_timeout()
        if timeout is not None:
            opts.timeout = timeout
        for key, value in fields.items():
            setattr(opts, key, value)
        return opts

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() == 0:
            return
        opts = self._opts(c10d.BroadcastOptions, rootRank=src, rootTensor=0)
        self._wait(self.cpu_group.broadcast([as_bytes(tensor)], opts))

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(input_)
            return
        opts = self._opts(c10d.AllgatherOptions)
        self._wait(self.cpu_group._allgather_base(as_bytes(output), as_bytes(input_), opts))

    def all_to_all_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_sizes: list[int],
        input_sizes: list[int],
    ) -> None:
        if self.world_size == 1:
            output.copy_(input_)
            return
        size = input_.element_size()
        opts = self._opts(c10d.AllToAllOptions)
        work = self.cpu_group.alltoall_base(
            as_bytes(output),
            as_bytes(input_),
            [n * size for n in output_sizes],
            [n * size for n in input_sizes],
            opts,
        )
        self._wait(work)

    def gather_into(self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, dst: int) -> None:
        if input_.numel() == 0:
            return
        if self.world_size == 1:
            outputs[0].copy_(input_)
            return
        opts = self._opts(c10d.GatherOptions, rootRank=dst)
        self._wait(self.cpu_group.gather([[as_bytes(o) for o in outputs]] if outputs else [], [as_bytes(input_)], opts))

    def scatter_from(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, src: int) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(inputs[0])
            return
        opts = self._opts(c10d.ScatterOptions, rootRank=src)
        self._wait(self.cpu_group.scatter([as_bytes(output)], [[as_bytes(i) for i in inputs]] if inputs else [], opts))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Transfer:
        if tensor.numel() == 0:
            return DoneTransfer()
        return self._post(self.cpu_group.send([as_bytes(tensor)], dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Transfer:
        if tensor.numel() == 0:
            return DoneTransfer()
        return self._post(self.cpu_group.recv([as_bytes(tensor)], src, tag))

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        posted = self._post(self.cpu_group.recv_anysource([as_bytes(tensor)], tag))
        posted.wait()
        return posted.work._source_rank()

    def barrier(self) -> None:
        self._wait(self.cpu_group.barrier(self._opts(c10d.BarrierOptions)))
