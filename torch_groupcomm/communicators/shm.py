"""Collectives among the ranks of one host through shared memory.

The data path is the C++ ``ShmGroup`` (GIL released): every rank copies into
its own slots of one segment, peers read and reduce from there, chunk by chunk,
so any message size goes through a bounded workspace. Where the kernel lets
the ranks read each other's memory, messages of 1 MiB and more of all_to_all,
scatter and send/recv go straight from the sender's tensor to the
receiver's instead (``ShmGroup::setDirect``). Send/recv use a byte
ring per ordered pair of ranks in the same segment, moved by a progress thread.
The kernels move bytes (``nbytes`` from ``data_ptr``), so any dtype goes as it
is; only the reductions look at the dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Callable

import torch
from torch._C import _distributed_c10d as c10d

from ..config import WaitPolicy
from ..reduction import Kind, Reduction, wire_plan
from ..shm_names import remove_segments, segment_name
from ..stores import get_within
from .base import DeviceCommunicatorBase, Transfer

# (dtype, kind) -> ShmCommunicator._plan's answer, the same for every group
_PLANS: dict = {}
_UNPLANNED = object()


def _ms(timeout: timedelta) -> int:
    return int(timeout.total_seconds() * 1000)


class _ShmTransfer:
    """A shared-memory send or recv in flight."""

    __slots__ = ("_request", "_timeout_ms")

    def __init__(self, request, timeout_ms: int) -> None:
        self._request, self._timeout_ms = request, timeout_ms

    def wait(self) -> None:
        self._request.wait(self._timeout_ms)

    def is_completed(self) -> bool:
        return self._request.is_completed()

    def future(self, outputs: list[torch.Tensor], context: str) -> torch.futures.Future:
        """A future completed with ``outputs`` by the transfer itself: waiting
        on it costs no thread of ours. Failures read ``context ...: why``."""
        return self._request.future(outputs, context, self._timeout_ms)


class ShmCommunicator(DeviceCommunicatorBase):
    """CPU collectives for ranks sharing a host."""

    name = "shm"

    def __init__(self, cpu_group, workspace, timeout: timedelta | None = None, unique_name: str = "") -> None:
        super().__init__(cpu_group, torch.device("cpu"), None, unique_name, timeout)
        self.workspace = workspace
        self._timeout_ms = _ms(timeout) if timeout is not None else 30 * 60 * 1000

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout_ms = _ms(timeout)
        self.workspace.set_timeout(self._timeout_ms)

    def _use_op_timeout(self, timeout: timedelta | None) -> None:
        super()._use_op_timeout(timeout)
        self.workspace.set_op_timeout(-1 if timeout is None else _ms(timeout))

    # -- primitives ----------------------------------------------------------------

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        self.workspace.broadcast(tensor, src)

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        self.workspace.all_gather(output, input_, [input_.nbytes] * self.world_size)

    def all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: list[int]) -> None:
        size = input_.element_size()
        self.workspace.all_gather(output, input_, [n * size for n in sizes])

    def all_to_all_into(self, output, input_, output_sizes: list[int], input_sizes: list[int]) -> None:
        size = input_.element_size()
        self.workspace.all_to_all(output, input_, [n * size for n in output_sizes], [n * size for n in input_sizes])

    def gather_into(self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, dst: int) -> None:
        self.gatherv_into(outputs, input_, [input_.numel()] * self.world_size, dst)

    def gatherv_into(
        self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, sizes: list[int], dst: int
    ) -> None:
        size = input_.element_size()
        self.workspace.gather(outputs or [], input_, [n * size for n in sizes], dst)

    def scatter_from(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, src: int) -> None:
        self.workspace.scatter(output, inputs or [], src)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Transfer:
        return _ShmTransfer(self.workspace.send(tensor, dst, tag), self._timeout_ms)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Transfer:
        return _ShmTransfer(self.workspace.recv(tensor, src, tag), self._timeout_ms)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        request = self.workspace.recv(tensor, -1, tag)
        request.wait(self._timeout_ms)
        return request.source

    def barrier(self) -> None:
        self.workspace.barrier()

    # -- native reductions --------------------------------------------------------

    def _native(self, tensor: torch.Tensor, reduction: Reduction) -> tuple[torch.Tensor, int, float] | None:
        """The tensor view, op code and factor the C++ kernels take, or None."""
        plan = _PLANS.get((tensor.dtype, reduction.kind), _UNPLANNED)
        if plan is _UNPLANNED:
            plan = _PLANS[(tensor.dtype, reduction.kind)] = self._plan(tensor.dtype, reduction.kind)
        if plan is None:
            return None
        view, kind = plan
        factor = reduction.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return (tensor if view is None else view(tensor)), kind, float(factor) if factor is not None else 1.0

    def _plan(self, dtype: torch.dtype, kind: Kind) -> tuple[Callable | None, int] | None:
        """The wire plan's view (or None) and op code where the C++ kernels
        take it; None where they do not."""
        plan = wire_plan(dtype, kind)
        if plan is None or not self.workspace.supports(plan.dtype, int(plan.kind)):
            return None
        return plan.view, int(plan.kind)

    def all_reduce_(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        native = self._native(tensor, reduction)
        if native is None:
            return super().all_reduce_(tensor, reduction)
        view, kind, factor = native
        self.workspace.all_reduce(view, kind, factor)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        native = self._native(tensor, reduction)
        if native is None:
            return super().reduce_(tensor, dst, reduction)
        view, kind, factor = native
        self.workspace.reduce(view, dst, kind, factor)

    def reduce_scatterv_into(self, output, input_, sizes: list[int], reduction: Reduction) -> None:
        native_in = self._native(input_, reduction)
        if native_in is None:
            return super().reduce_scatterv_into(output, input_, sizes, reduction)
        view_in, kind, factor = native_in
        view_out = self._native(output, reduction)[0]
        scale = view_in.numel() // max(input_.numel(), 1) if input_.numel() else 1
        self.workspace.reduce_scatter(view_out, view_in, [n * scale for n in sizes], kind, factor)

    def native_engine(self) -> object | None:
        return self.workspace

    def share_storage(self, tensor: torch.Tensor) -> bool:
        return self.workspace is not None and self.workspace.adopt(tensor)

    def abort(self) -> None:
        if self.workspace is not None:
            self.workspace.abort()

    def destroy(self) -> None:
        self.workspace = None


def create(
    cpu_group,
    store: c10d.Store,
    chunk_bytes: int,
    policy: WaitPolicy,
    timeout: timedelta,
    unique_name: str = "",
    key: str = "groupcomm/shm",
    rank_names: Sequence[int] = (),
    direct: bool = True,
) -> ShmCommunicator | None:
    """Build the host's shared-memory communicator, or None (with a warning)
    when any rank could not make or attach the segment. Collective over
    ``cpu_group``; the segment's name is gone from /dev/shm when this returns.
    With ``direct``, large messages go from one rank's memory to another's
    where every rank may read every other's (``process_vm_readv``), and the
    buffers the backend allocates (``allocate_tensor``, FSDP2's opt-in) are
    blocks the peers map and read in place where every rank may map every
    other's."""
    from .._native import _C

    rank, world = cpu_group.rank(), cpu_group.size()
    timeout_ms = _ms(timeout)
    args = dict(
        rank=rank,
        world_size=world,
        slot_bytes=chunk_bytes,
        spin_us=policy.spin_us,
        yield_us=policy.yield_us,
        crowded=policy.crowded,
        timeout_ms=timeout_ms,
        ring_bytes=max(chunk_bytes // 4, 4096),
        rank_names=list(rank_names),
    )
    workspace, problem, name = None, "", None
    try:
        # The name is published before the segment exists, so that if rank 0
        # dies while creating it, the others remove what it left.
        if rank == 0:
            name = segment_name("")
            store.set(key, name)
            try:
                workspace = _C.ShmGroup(name, True, **args)
            except RuntimeError as exc:
                store.set(key + "/created", "!" + str(exc))
                raise
            store.set(key + "/created", "")
        else:
            name = get_within(store, [key], timeout)[0].decode()
            failure = get_within(store, [key + "/created"], timeout)[0].decode()
            if failure:
                raise RuntimeError(failure[1:])
            workspace = _C.ShmGroup(name, False, **args)
    except RuntimeError as exc:
        problem = str(exc)
        if rank != 0:
            remove_segments([name])
    try:
        agreed = torch.tensor([0 if workspace is None else 1], dtype=torch.int32)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = c10d.ReduceOp.MIN
        cpu_group.allreduce([agreed], opts).wait()
    finally:
        if workspace is not None:
            workspace.unlink()
    if agreed.item() == 0:
        warnings.warn(
            f"groupcomm: shared memory unavailable, using gloo on the CPU ({problem or 'a peer failed'})", stacklevel=1
        )
        return None
    able = torch.zeros(2, dtype=torch.int32)
    if direct and world > 1:
        able = torch.tensor([workspace.probe_direct(), workspace.probe_shared()], dtype=torch.int32)
        cpu_group.allreduce([able], opts).wait()
    workspace.direct, workspace.shared = bool(able[0]), bool(able[1])
    return ShmCommunicator(cpu_group, workspace, timeout=timeout, unique_name=unique_name)
