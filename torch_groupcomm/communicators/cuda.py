"""A communicator that carries CUDA tensors over NCCL.

Every call is enqueued on the *current* CUDA stream and returns at once (the
c10d frontend makes a side stream current first, see :meth:`CudaCommunicator.stream_scope`).
NCCL moves the data; reductions NCCL has natively (SUM, PROD, MIN, MAX, AVG,
PREMUL_SUM on its dtypes, and complex SUM/AVG/PREMUL_SUM as pairs of reals)
run inside NCCL, every other pair (bitwise ops, int16, ...) is an all-gather
plus the shared local reduction of ``reduction.py``, so results agree with
the CPU paths.

Communicators are made lazily: the group's on its first collective (the
unique id travels over the cpu_group), one per pair of ranks on their first
send/recv (the id travels through the group's store, since only the pair
takes part). A watchdog aborts them when an op outlives the group's timeout.

Once the group's communicator and side stream exist,
:meth:`CudaCommunicator.native_path` hands them to the C++ bridge, which then
enqueues the plain collectives itself, the same way, without Python
(``csrc/bridge/nccl_path.*``: all-reduce, broadcast, reduce, all-gather into
and reduce-scatter of tensors, coalesced ones too, on NCCL's own reduce ops
and dtypes, all-to-all of one tensor); everything else still comes here.
A coalescing batch's sends and receives (``batch_isend_irecv``) are held in
one NCCL group on the group's communicator until the batch ends
(:meth:`CudaCommunicator.begin_batch`, driven by ``c10d/batching.py``).
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch._C import _distributed_c10d as c10d

from .._native import _C
from ..errors import CommTimeoutError, GroupCommError
from ..reduction import Kind, Reduction, wire_plan
from ..staging import as_bytes
from ..stores import get_within
from . import nccl
from .base import DeviceCommunicatorBase, DoneTransfer, Transfer

_NATIVE_OPS = {
    Kind.SUM: nccl.RedOp.SUM,
    Kind.PRODUCT: nccl.RedOp.PROD,
    Kind.MIN: nccl.RedOp.MIN,
    Kind.MAX: nccl.RedOp.MAX,
    Kind.AVG: nccl.RedOp.AVG,
}
_BYTE = nccl.DataType.UINT8


class NcclComm:
    """One NCCL communicator (``ncclComm_t``) and its lifetime."""

    def __init__(self, lib: nccl.NcclLibrary, nranks: int, unique_id: bytes, rank: int, device: torch.device) -> None:
        with torch.cuda.device(device):
            self.handle = lib.comm_init_rank(nranks, unique_id, rank)
        self.lib, self.rank, self.nranks = lib, rank, nranks
        self.is_open = True

    def abort(self) -> None:
        """Stop the communicator's kernels and free it (ops in flight fail)."""
        if self.is_open:
            self.is_open = False
            self.lib.comm_abort(self.handle)

    def destroy(self) -> None:
        """Free the communicator once its ops are done."""
        if self.is_open:
            self.is_open = False
            self.lib.comm_destroy(self.handle)


class _Native:
    """How NCCL runs one reduction: a buffer view, its datatype and the op."""

    __slots__ = ("view", "datatype", "op", "premul", "keep")

    def __init__(self, view, datatype, op, premul=None, keep=None) -> None:
        self.view, self.datatype, self.op, self.premul, self.keep = view, datatype, op, premul, keep


class CudaCommunicator(DeviceCommunicatorBase):
    """Collectives and send/recv on CUDA tensors of one device, through NCCL."""

    name = "nccl"

    def __init__(
        self,
        cpu_group,
        device: torch.device,
        store: c10d.Store,
        unique_name: str = "",
        timeout: timedelta | None = None,
        lib: nccl.NcclLibrary | None = None,
    ) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(cpu_group, device=device, unique_name=unique_name, timeout=timeout)
        self.lib = lib if lib is not None else nccl.library()
        self.store = store
        self.comm: NcclComm | None = None
        self._pairs: dict[int, NcclComm] = {}
        self._stream: torch.cuda.Stream | None = None
        self._caller_done: torch.cuda.Event | None = None
        self._lock = threading.Lock()
        self._failure: GroupCommError | None = None
        self._path = None  # the bridge's C++ path once made (False: none)
        self._batching = False  # between begin_batch and end_batch
        self._watchdog = _Watchdog(self)

    # -- communicators -----------------------------------------------------------

    def _group_comm(self) -> NcclComm:
        self._check_usable()
        if self.comm is None:
            uid = torch.zeros(nccl.UNIQUE_ID_BYTES, dtype=torch.uint8, device="cpu")
            if self.rank_in_group == 0:
                uid.copy_(torch.frombuffer(bytearray(self.lib.get_unique_id()), dtype=torch.uint8))
            opts = c10d.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            self.cpu_group.broadcast([uid], opts).wait()
            self.comm = NcclComm(self.lib, self.world_size, bytes(uid.tolist()), self.rank_in_group, self.device)
        return self.comm

    def _pair_comm(self, peer: int) -> tuple[NcclComm, int]:
        """The two-rank communicator shared with ``peer``, and ``peer``'s rank in it."""
        self._check_usable()
        comm = self._pairs.get(peer)
        if comm is None:
            low, high = sorted((self.rank_in_group, peer))
            key = f"groupcomm/nccl/pair/{low}-{high}"
            if self.rank_in_group == low:
                uid = self.lib.get_unique_id()
                self.store.set(key, uid)
            else:
                uid = get_within(self.store, [key], self.current_timeout() or self.store.timeout)[0]
            comm = NcclComm(self.lib, 2, uid, 0 if self.rank_in_group == low else 1, self.device)
            with self._lock:
                self._pairs[peer] = comm
        return comm, 0 if peer < self.rank_in_group else 1

    def native_path(self, queue: object | None = None) -> None | bool | object:
        """The C++ path (``_C.NcclPath``) that enqueues the plain collectives
        on this group's communicator and side stream, in ``queue``'s order
        (the group's op queue; without it, only the path made before); None
        until both exist, False when this process's CUDA runtime cannot say
        whether a stream is being captured (the path leaves captures to Python)."""
        ready = self.comm is not None and self._stream is not None and self._failure is None
        if self._path is None and queue is not None and ready:
            capturing = _cuda_runtime_function("cudaStreamIsCapturing")
            if capturing is None:
                self._path = False
            else:
                lib, stream = self.lib, self._stream
                self._path = _C.NcclPath(
                    all_reduce=lib.address("ncclAllReduce"),
                    broadcast=lib.address("ncclBroadcast"),
                    reduce=lib.address("ncclReduce"),
                    all_gather=lib.address("ncclAllGather"),
                    reduce_scatter=lib.address("ncclReduceScatter"),
                    send=lib.address("ncclSend"),
                    recv=lib.address("ncclRecv"),
                    group_start=lib.address("ncclGroupStart"),
                    group_end=lib.address("ncclGroupEnd"),
                    error_string=lib.address("ncclGetErrorString"),
                    stream_is_capturing=capturing,
                    comm=self.comm.handle.value,
                    world_size=self.world_size,
                    stream_id=stream.stream_id,
                    device_index=stream.device_index,
                    device_type=stream.device_type,
                    stream_handle=stream.cuda_stream,
                    queue=queue,
                )
                self._watchdog.follow(self._path)
        return self._path

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))

    # -- streams --------------------------------------------------------------------

    @contextmanager
    def stream_scope(self, tensors: Sequence[torch.Tensor]) -> Iterator[torch.cuda.Stream]:
        """Run the body on the communicator's stream, ordered after the caller's
        current stream; ``tensors`` (the caller's) stay alive until the stream
        is done with them. Inside a CUDA graph capture the body runs on the
        capturing stream itself."""
        self._check_usable()
        for t in tensors:
            if t.device != self.device:
                raise ValueError(
                    f"groupcomm: group {self.unique_name!r} runs CUDA ops on {self.device}, got a tensor on {t.device}"
                )
        current = torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            yield current
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._caller_done = torch.cuda.Event()
        stream = self._stream
        # one event, recorded again for every op: a stream waits on the record
        # made before its wait, so later records do not disturb queued waits
        self._caller_done.record(current)
        stream.wait_event(self._caller_done)
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.stream(stream):  # also makes the stream's device current, then restores it
                yield stream
        else:
            torch.cuda.set_stream(stream)  # a few us cheaper per op than torch.cuda.stream(...)
            try:
                yield stream
            finally:
                torch.cuda.set_stream(current)
        self._watchdog.watch(stream)
        for t in tensors:
            t.record_stream(stream)

    def _cuda_stream(self) -> int:
        # the raw handle, without building a Stream object (docs/benchmarks.md)
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    # -- data movement (bytes, any dtype) -----------------------------------------

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() == 0:
            return
        buf = as_bytes(tensor)
        self.lib.broadcast(
            buf.data_ptr(), buf.data_ptr(), buf.numel(), _BYTE, src, self._group_comm().handle, self._cuda_stream()
        )

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        if output.numel() == 0:
            return
        src, dst = as_bytes(input_), as_bytes(output)
        self.lib.all_gather(
            src.data_ptr(), dst.data_ptr(), src.numel(), _BYTE, self._group_comm().handle, self._cuda_stream()
        )

    def all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: list[int]) -> None:
        if len(set(sizes)) <= 1:
            self.all_gather_into(output, input_)
            return
        comm, stream = self._group_comm().handle, self._cuda_stream()
        size = output.element_size()
        out, mine = output.data_ptr(), input_.data_ptr()
        self.lib.group_start()
        try:
            offset = 0
            for root, n in enumerate(sizes):
                if n:
                    send = mine if root == self.rank_in_group else out + offset
                    self.lib.broadcast(send, out + offset, n * size, _BYTE, root, comm, stream)
                offset += n * size
        finally:
            self.lib.group_end()

    def all_to_all_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_sizes: list[int],
        input_sizes: list[int],
    ) -> None:
        comm, stream = self._group_comm().handle, self._cuda_stream()
        size = input_.element_size()
        src, dst = input_.data_ptr(), output.data_ptr()
        self.lib.group_start()
        try:
            sent = received = 0
            for peer in range(self.world_size):
                if input_sizes[peer]:
                    self.lib.send(src + sent, input_sizes[peer] * size, _BYTE, peer, comm, stream)
                if output_sizes[peer]:
                    self.lib.recv(dst + received, output_sizes[peer] * size, _BYTE, peer, comm, stream)
                sent += input_sizes[peer] * size
                received += output_sizes[peer] * size
        finally:
            self.lib.group_end()

    def gather_into(self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, dst: int) -> None:
        nbytes = input_.numel() * input_.element_size()
        comm, stream = self._group_comm().handle, self._cuda_stream()
        if nbytes == 0:
            return
        self.lib.group_start()
        try:
            if self.rank_in_group != dst:
                self.lib.send(input_.data_ptr(), nbytes, _BYTE, dst, comm, stream)
            else:
                for peer, out in enumerate(outputs):
                    if peer == dst:
                        out.copy_(input_)
                    else:
                        self.lib.recv(out.data_ptr(), nbytes, _BYTE, peer, comm, stream)
        finally:
            self.lib.group_end()

    def scatter_from(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, src: int) -> None:
        nbytes = output.numel() * output.element_size()
        comm, stream = self._group_comm().handle, self._cuda_stream()
        if nbytes == 0:
            return
        self.lib.group_start()
        try:
            if self.rank_in_group != src:
                self.lib.recv(output.data_ptr(), nbytes, _BYTE, src, comm, stream)
            else:
                for peer, inp in enumerate(inputs):
                    if peer == src:
                        output.copy_(inp)
                    else:
                        self.lib.send(inp.data_ptr(), nbytes, _BYTE, peer, comm, stream)
        finally:
            self.lib.group_end()

    def _transfer_comm(self, peer: int) -> tuple[nccl.Comm, int]:
        """The communicator a send/recv with ``peer`` uses, and ``peer``'s rank in it."""
        if self._batching:
            return self._group_comm().handle, peer
        comm, rank = self._pair_comm(peer)
        return comm.handle, rank

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Transfer:
        """Enqueue a send (NCCL has no tags: a pair's transfers match in order)."""
        if tensor.numel():
            comm, peer = self._transfer_comm(dst)
            buf = as_bytes(tensor)
            self.lib.send(buf.data_ptr(), buf.numel(), _BYTE, peer, comm, self._cuda_stream())
        return DoneTransfer()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Transfer:
        """Enqueue a receive (stream-ordered: the op's stream holds the result)."""
        if tensor.numel():
            comm, peer = self._transfer_comm(src)
            buf = as_bytes(tensor)
            self.lib.recv(buf.data_ptr(), buf.numel(), _BYTE, peer, comm, self._cuda_stream())
        return DoneTransfer()

    def begin_batch(self) -> None:
        """Hold this thread's next sends and receives in one NCCL group until
        :meth:`end_batch` (``batch_isend_irecv``). Like torch's nccl backend
        they then use the group's communicator, not the pairs': a group's
        first batch makes it, with every rank taking part, and a rank may
        send to itself."""
        self._group_comm()
        self.lib.group_start()
        self._batching = True

    def end_batch(self) -> torch.cuda.Stream | None:
        """Launch the transfers held since :meth:`begin_batch`; the stream they
        run on (None inside a CUDA graph capture: the capturing stream)."""
        self._batching = False
        self.lib.group_end()
        if self._stream is not None:
            self._watchdog.watch(self._stream)
        return self._stream

    def barrier(self) -> None:
        """Host barrier over the cpu_group once this device's queued work is done."""
        torch.cuda.current_stream(self.device).synchronize()
        self.cpu_group.barrier(c10d.BarrierOptions()).wait()

    # -- reductions -----------------------------------------------------------------

    def _native(self, tensor: torch.Tensor, reduction: Reduction) -> _Native | None:
        """NCCL's own way to reduce ``tensor`` with ``reduction``, or None."""
        plan = wire_plan(tensor.dtype, reduction.kind, bitwise=False)
        if plan is None:
            return None
        kind, view = plan.kind, plan.apply(tensor)
        try:
            datatype = nccl.nccl_dtype(view.dtype)
        except TypeError:
            return None
        if kind in _NATIVE_OPS:
            return _Native(view, datatype, _NATIVE_OPS[kind])
        if kind != Kind.PREMUL_SUM or not view.dtype.is_floating_point or self.world_size == 1:
            # one rank: NCCL 2.28.9 leaves some tail elements of a PREMUL_SUM unscaled (torch's
            # own nccl backend too, H200: fp64 n=2049 misses [2048], fp32 n=4097 [4096]); the
            # generic path scales every element
            return None
        factor = reduction.factor
        if isinstance(factor, torch.Tensor):
            if factor.is_complex():
                return None
            scalar = factor.to(device=self.device, dtype=view.dtype).reshape(1)
            residence = nccl.ScalarResidence.DEVICE
        else:
            if isinstance(factor, complex):
                return None
            scalar = torch.tensor([factor], dtype=view.dtype, device="cpu")  # read by NCCL at creation
            residence = nccl.ScalarResidence.HOST_IMMEDIATE
        comm = self._group_comm().handle
        op = self.lib.red_op_create_pre_mul_sum(scalar.data_ptr(), datatype, residence, comm)
        return _Native(view, datatype, op, premul=comm, keep=scalar)

    def _release(self, native: _Native) -> None:
        if native.premul is not None:
            self.lib.red_op_destroy(native.op, native.premul)
            if native.keep.is_cuda:
                native.keep.record_stream(torch.cuda.current_stream(self.device))

    def all_reduce_(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        native = self._native(tensor, reduction) if tensor.numel() else None
        if native is None:
            if tensor.numel():
                super().all_reduce_(tensor, reduction)
            return
        try:
            buf = native.view
            self.lib.all_reduce(
                buf.data_ptr(),
                buf.data_ptr(),
                buf.numel(),
                native.datatype,
                native.op,
                self._group_comm().handle,
                self._cuda_stream(),
            )
        finally:
            self._release(native)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        native = self._native(tensor, reduction) if tensor.numel() else None
        if native is None:
            if tensor.numel():
                super().reduce_(tensor, dst, reduction)
            return
        try:
            buf = native.view
            self.lib.reduce(
                buf.data_ptr(),
                buf.data_ptr(),
                buf.numel(),
                native.datatype,
                native.op,
                dst,
                self._group_comm().handle,
                self._cuda_stream(),
            )
        finally:
            self._release(native)

    def reduce_scatterv_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        sizes: list[int],
        reduction: Reduction,
    ) -> None:
        native = self._native(input_, reduction) if len(set(sizes)) == 1 and output.numel() else None
        if native is None:
            if input_.numel():
                super().reduce_scatterv_into(output, input_, sizes, reduction)
            return
        try:
            out = self._native_view(output, reduction.kind)
            self.lib.reduce_scatter(
                native.view.data_ptr(),
                out.data_ptr(),
                out.numel(),
                native.datatype,
                native.op,
                self._group_comm().handle,
                self._cuda_stream(),
            )
        finally:
            self._release(native)

    @staticmethod
    def _native_view(t: torch.Tensor, kind: Kind) -> torch.Tensor:
        """The output ``t`` as the kernel sees the input it reduces with ``kind``."""
        return wire_plan(t.dtype, kind, bitwise=False).apply(t)

    # -- lifecycle ----------------------------------------------------------------------

    def _comms(self) -> list[NcclComm]:
        with self._lock:
            return ([self.comm] if self.comm is not None else []) + list(self._pairs.values())

    def fail(self, reason: GroupCommError) -> None:
        """Abort every NCCL communicator; later calls raise ``reason`` again."""
        if self._failure is None:
            self._failure = reason
        if self._path:
            self._path.disable()
        for comm in self._comms():
            comm.abort()

    def abort(self) -> None:
        self.fail(GroupCommError(f"groupcomm: NCCL group {self.unique_name!r} aborted"))
        self._watchdog.stop()

    def destroy(self) -> None:
        if self._path:
            self._path.disable()
        if self._stream is not None and self._failure is None:
            self._stream.synchronize()  # the watchdog still aborts a hung op meanwhile
        self._watchdog.stop()
        if self._failure is None:
            for comm in self._comms():
                comm.destroy()


def _cuda_runtime_function(name: str) -> int | None:
    """The address of the CUDA runtime's function ``name`` in the libcudart
    this process loaded (torch's), or None."""
    for path in (nccl.mapped_library("libcudart.so"), None):  # None: the symbols the process already has
        try:
            return ctypes.cast(getattr(ctypes.CDLL(path), name), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


class _Watchdog:
    """Aborts the communicator when an enqueued op outlives its timeout (the
    group's, or the op's own)
    (a peer that died or never arrived leaves NCCL kernels spinning forever),
    or when NCCL reports an asynchronous error."""

    POLL_S = 0.1  # while ops are in flight
    IDLE_POLL_S = 1.0  # otherwise, for NCCL's asynchronous errors

    def __init__(self, owner: CudaCommunicator) -> None:
        self._owner = owner
        self._pending: collections.deque[tuple[torch.cuda.Event, float, float]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._path = None  # the C++ path's ops are followed there

    def watch(self, stream: torch.cuda.Stream) -> None:
        """Follow the work enqueued on ``stream`` so far."""
        event = torch.cuda.Event()
        event.record(stream)
        timeout_s = (self._owner.current_timeout() or timedelta(minutes=30)).total_seconds()
        with self._cond:
            # no wake-up: the deadline is a whole timeout away, the next poll sees it
            self._pending.append((event, time.monotonic() + timeout_s, timeout_s))
            self._start()

    def follow(self, path) -> None:
        """Also follow the ops the C++ path (``_C.NcclPath``) enqueues."""
        with self._cond:
            self._path = path
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="groupcomm-nccl-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        owner = self._owner
        while True:
            with self._cond:
                path = self._path
                busy = self._pending or (path is not None and path.pending())
                self._cond.wait_for(lambda: self._stopped, timeout=self.POLL_S if busy else self.IDLE_POLL_S)
                if self._stopped:
                    return
                while self._pending and self._pending[0][0].query():
                    self._pending.popleft()
                late_s = self._pending[0][2] if self._pending and time.monotonic() > self._pending[0][1] else None
            if late_s is None and path is not None:
                default_s = (owner.timeout or timedelta(minutes=30)).total_seconds()
                late_ms = path.late(int(default_s * 1000))
                late_s = late_ms / 1000 if late_ms >= 0 else None
            if late_s is not None:
                owner.fail(
                    CommTimeoutError(
                        f"groupcomm: NCCL op on group {owner.unique_name!r} (rank {owner.rank_in_group}) did not finish "
                        f"within its timeout of {late_s:g} s; communicators aborted"
                    )
                )
                return
            for comm in owner._comms():
                code = owner.lib.comm_get_async_error(comm.handle) if comm.is_open else 0
                if code not in (0, 7):  # 7: ncclInProgress
                    owner.fail(
                        GroupCommError(
                            f"groupcomm: NCCL reported an error on group {owner.unique_name!r}: "
                            f"{owner.lib.error_string(code)} {owner.lib.last_error(comm.handle)}"
                        )
                    )
                    return
