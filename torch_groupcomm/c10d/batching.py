"""The CUDA sends and receives of one coalescing batch, launched together.

torch's ``batch_isend_irecv`` brackets its ops with the backend's
``startCoalescing``/``endCoalescing`` so that a rank may post a send and a
receive to the same peer in either order: NCCL runs each call as a kernel on
the stream, and a send kernel ahead of its receive on both ranks waits
forever unless both sit in one ``ncclGroupStart``/``ncclGroupEnd``. The
batch opens that group at its first CUDA send/recv, holds back what must
follow the transfers (copies into non-contiguous outputs, the futures), and
launches it when the batch ends, or before any other CUDA op of the batch
(a collective runs after the transfers issued before it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..communicators.cuda import CudaCommunicator

Tensors = list[torch.Tensor]


class DeviceBatch:
    """One coalescing batch's held-back CUDA transfers (at most one device's
    communicator at a time: a send/recv on another device launches the
    first device's group before opening its own)."""

    __slots__ = ("comm", "_done", "_after")

    def __init__(self) -> None:
        self.comm: CudaCommunicator | None = None
        self._done: list[tuple[torch.futures.Future, Tensors]] = []
        self._after: list[Callable[[], object]] = []

    def join(self, comm: CudaCommunicator, guard: Callable) -> None:
        """Make ``comm``'s next sends and receives part of this batch's group."""
        if self.comm is not comm:
            self.launch(guard)
            comm.begin_batch()
            self.comm = comm

    def add(self, result: Tensors, device: torch.device) -> torch.futures.Future:
        """The future of a transfer just enqueued: completed, on the device,
        once the group is launched."""
        future = torch.futures.Future(devices=[device])
        self._done.append((future, result))
        return future

    def after_launch(self, step: Callable[[], object]) -> None:
        """Run ``step`` on the transfers' stream once they are launched (it also
        keeps what it refers to alive until then)."""
        self._after.append(step)

    def launch(self, guard: Callable) -> None:
        """Launch the open group, if any; ``guard`` names a failure as the
        batch's (the failure also completes every held future)."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        done, after = self._done, self._after
        self._done, self._after = [], []
        try:
            stream = guard(comm.end_batch)()
        except Exception as exc:
            for future, _ in done:
                future.set_exception(exc)
            raise
        with torch.cuda.stream(stream):
            for step in after:
                step()
            for future, result in done:
                future.set_result(result)
