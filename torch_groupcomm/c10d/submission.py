"""How a checked c10d op runs: one submission per op, which picks the
group's ordered executor (a synchronous call runs on the caller's thread
once the queue is drained; an asynchronous one completes a torch Future) or
the device's stream (CUDA: the future lives on the device). Failures are
raised as GroupCommError or CommTimeoutError naming op, group and rank."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from datetime import timedelta
from typing import Callable, NoReturn

import torch

from .._native import _C
from ..communicators.base import DeviceCommunicatorBase
from ..coordinator import GroupCoordinator
from ..errors import CommTimeoutError, GroupCommError
from .arguments import device_of
from .batching import DeviceBatch

Tensors = list[torch.Tensor]


def as_timeout(timeout_ms: int, default: timedelta | None = None) -> timedelta | None:
    """A timeout c10d passes in milliseconds as a timedelta; negative means
    "none given", which is ``default``."""
    return timedelta(milliseconds=timeout_ms) if timeout_ms >= 0 else default


class Route:
    """Where an op's tensors live, and how to reach that device's communicator."""

    __slots__ = ("coordinator", "device", "tensors")

    def __init__(self, coordinator: GroupCoordinator, device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
        self.coordinator, self.device, self.tensors = coordinator, device, tensors

    def communicator(self) -> DeviceCommunicatorBase:
        return self.coordinator.communicator_for(self.device)


class Submission:
    """The frontend's state and the three ways an op runs."""

    @staticmethod
    def report_failure(timed_out: bool) -> None:
        """Tells the bridge the group failed (its getError and abort hooks);
        the bridge replaces this with its own when it is built."""

    def __init__(self, coordinator: GroupCoordinator) -> None:
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.world_size = coordinator.world_size
        self._ops = coordinator.ops
        self._completions = _C.OpQueue(f"{coordinator.unique_name}-p2p")
        self._in_flight: collections.deque[torch.futures.Future] = collections.deque()  # transfers finishing natively
        self._batch: DeviceBatch | None = None  # between start_coalescing and end_coalescing

    def _route(self, op: str, tensors: Sequence[torch.Tensor]) -> Route:
        """Check the tensors' device; return how to get its communicator.

        The communicator is looked up when the op runs, in op order, because
        creating one is itself a collective.
        """
        self.coordinator.check_formed()
        return Route(self.coordinator, device_of(op, tensors, self.coordinator.check_device), tensors)

    def _run_now(self, op: str, primitive: Callable[..., None], *args) -> None:
        """``primitive(*args)`` on this thread after the queued ops; failures
        read as they do on the queued path."""
        try:
            self._ops.run(primitive, *args)
        except RuntimeError as exc:
            self._reraise(op, exc)

    def _submit(self, op: str, task: Callable[[], Tensors], async_op: bool, route: Route, timeout_ms: int):
        """Run ``task`` in op order; ``timeout_ms`` (c10d's per-op timeout, -1:
        none) replaces the group's timeout while it runs."""
        if route.device.type != "cpu":
            return self._on_stream(op, task, route, timeout_ms)
        if timeout_ms >= 0:
            untimed = task

            def task() -> Tensors:
                with route.communicator().op_timeout(as_timeout(timeout_ms)):
                    return untimed()

        return self._ops.submit(self._guarded(op, task), async_op)

    def _on_stream(
        self, op: str, task: Callable[[], Tensors], route: Route, timeout_ms: int = -1, transfer: bool = False
    ):
        """Enqueue ``task`` on the device communicator's stream, in op order;
        the future lives on the device, so waiting on it orders the waiter's
        current stream after the op (the host does not wait). In a coalescing
        batch a ``transfer`` (send/recv) joins the batch's group, any other op
        launches that group first."""

        def enqueue() -> torch._C.Future:
            comm = route.communicator()
            batch = self._batch
            if batch is not None:
                if transfer:
                    batch.join(comm, self._batch_guard)
                else:
                    batch.launch(self._batch_guard)
            with comm.op_timeout(as_timeout(timeout_ms)), comm.stream_scope(route.tensors):
                result = task()
                if batch is not None and transfer:
                    return batch.add(result, route.device)
                return _C.device_future(result, route.device)

        return self._ops.run(self._guarded(op, enqueue))

    def _after_transfer(self, step: Callable[[], object]) -> None:
        """Run ``step`` on the stream after the send/recv just enqueued: now,
        or once a coalescing batch's group is launched."""
        if self._batch is not None and self._batch.comm is not None:
            self._batch.after_launch(step)
        else:
            step()

    def _batch_guard(self, task: Callable[[], Tensors]) -> Callable[[], Tensors]:
        return self._guarded("batch_isend_irecv", task)

    def start_coalescing(self) -> None:
        """A coalescing batch (``batch_isend_irecv``) began and one of its
        ops reached Python: its CUDA sends and receives wait for
        :meth:`end_coalescing` to launch them together."""
        self._batch = DeviceBatch()

    def end_coalescing(self) -> None:
        """The batch ended: launch its CUDA transfers and complete their futures."""
        batch, self._batch = self._batch, None
        if batch is not None and batch.comm is not None:
            self._ops.run(batch.launch, self._batch_guard)

    def _where(self, op: str) -> str:
        """How a failure of ``op`` on this group begins."""
        return f"groupcomm: {op} on group {self.coordinator.unique_name!r} (rank {self.rank} of {self.world_size})"

    def _reraise(self, op: str, exc: RuntimeError) -> NoReturn:
        """Raise ``exc`` as a failure of ``op``: as it is when it already names
        its op (or the op is not implemented), else as the same kind of failure
        (timeout or not, as the communicator typed it) naming op, group and rank."""
        if isinstance(exc, NotImplementedError) or (isinstance(exc, GroupCommError) and exc.op is not None):
            raise exc
        where = self._where(op)
        self.report_failure(isinstance(exc, CommTimeoutError))
        if isinstance(exc, CommTimeoutError):
            # " timeout " is the word torch's own backends use (gloo, NCCL's watchdog) and
            # what torch's test suite looks for in a timed-out collective's error
            raise CommTimeoutError(f"{where} hit its timeout before completing ({exc})", op=op) from exc
        raise GroupCommError(f"{where} failed: {exc}", op=op) from exc

    def _guarded(self, op: str, task: Callable[[], Tensors]) -> Callable[[], Tensors]:
        def run() -> Tensors:
            try:
                return task()
            except RuntimeError as exc:
                self._reraise(op, exc)

        return run
