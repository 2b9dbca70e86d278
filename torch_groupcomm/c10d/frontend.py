"""What the C++ bridge calls (the ops of ``ops.OPS``): c10d's ops, checked,
staged and queued.

Each method receives exactly what c10d handed the backend, checks it (raising
TypeError/ValueError that name the op), turns the tensors into flat contiguous
buffers, and queues the work on the group's ordered executor. It returns a
``torch.futures.Future`` whose value is the op's output tensors; the bridge
wraps it in a c10d ``Work``.

A synchronous call on the CPU whose tensors are dense and contiguous skips
the staging and the queued task: once the queue is drained it runs the
communicator's primitive on the caller's thread. At a few microseconds per
call the general path's bookkeeping would otherwise cost more than the
collective itself.
"""

from __future__ import annotations

import collections
import math
import time
from datetime import timedelta
from typing import Callable, Deque, Dict, List, NoReturn, Optional, Sequence, Tuple

import torch

from .._registry import forget
from ..communicators.base import DeviceCommunicatorBase
from ..coordinator import GroupCoordinator
from ..errors import CommTimeoutError, GroupCommError
from ..op_queue import OpQueue
from ..reduction import Kind, Reduction
from ..staging import Staged, cat, flat, scatter_back

Tensors = List[torch.Tensor]

# Floating dtypes torch has no CPU reduction kernels for: reducing them would
# fail half-way through the collective, so they are refused up front.
_UNREDUCIBLE = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
    if hasattr(torch, name)
)


def _as_is(tensor: torch.Tensor) -> bool:
    """Whether a CPU communicator can take ``tensor`` without staging it."""
    return tensor.is_cpu and tensor.layout is torch.strided and tensor.is_contiguous()


class _Route:
    """Where an op's tensors live, and how to reach that device's communicator."""

    __slots__ = ("coordinator", "device", "tensors")

    def __init__(self, coordinator: GroupCoordinator, device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
        self.coordinator, self.device, self.tensors = coordinator, device, tensors

    def communicator(self) -> DeviceCommunicatorBase:
        return self.coordinator.communicator_for(self.device)


class C10dFrontend:
    """Serves one group's c10d backend(s) on top of its coordinator."""

    def __init__(self, coordinator: GroupCoordinator) -> None:
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.world_size = coordinator.world_size
        self._ops = coordinator.ops
        self._completions = OpQueue(f"{coordinator.unique_name}-p2p")
        self._in_flight: Deque[torch.futures.Future] = collections.deque()  # transfers finishing natively
        self._immediate = True  # synchronous CPU calls may run directly (see the module docstring)
        self._reductions: Dict[Tuple[torch.dtype, object], Reduction] = {}  # checked plain reduce ops

    # -- checks and plumbing -----------------------------------------------------

    def _route(self, op: str, tensors: Sequence[torch.Tensor]) -> "_Route":
        """Check the tensors' device; return how to get its communicator.

        The communicator is looked up when the op runs, in op order, because
        creating one is itself a collective.
        """
        return _Route(self.coordinator, self._device(op, tensors), tensors)

    def _device(self, op: str, tensors: Sequence[torch.Tensor]) -> torch.device:
        if len(tensors) == 1 and tensors[0].layout == torch.strided:
            device = tensors[0].device
            self.coordinator.check_device(device)
            return device
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"groupcomm: {op} got tensors on several devices: {sorted(map(str, devices))}")
        for t in tensors:
            if t.layout != torch.strided:
                raise TypeError(f"groupcomm: {op} supports dense tensors only, got layout {t.layout}")
        device = devices.pop() if devices else torch.device("cpu")
        self.coordinator.check_device(device)
        return device

    def _check_rank(self, op: str, what: str, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"groupcomm: {op} {what} {rank} is not a rank of this group (size {self.world_size})")

    def _check_dtypes(self, op: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        for t in tensors:
            if t.dtype != dtype:
                raise TypeError(f"groupcomm: {op} needs one dtype, got {t.dtype} and {dtype}")

    def _check_numel(self, op: str, what: str, got: int, expected: int) -> None:
        if got != expected:
            raise ValueError(f"groupcomm: {op} {what} has {got} elements, expected {expected}")

    def _check_pairs(self, op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        if len(outputs) != len(inputs):
            raise ValueError(f"groupcomm: {op} got {len(outputs)} output tensors for {len(inputs)} inputs")

    def _reduction(self, op: str, reduce_op, tensors: Sequence[torch.Tensor]) -> Reduction:
        reduction = Reduction.parse(reduce_op)
        for t in tensors:
            self._check_reducible(op, reduction, t.dtype)
        return reduction

    def _check_reducible(self, op: str, reduction: Reduction, dtype: torch.dtype) -> None:
        reduction.check(dtype, op)
        if dtype in _UNREDUCIBLE:
            raise TypeError(f"groupcomm: {op} with ReduceOp.{reduction.kind.name} is not defined for dtype {dtype}")

    def _plain_reduction(self, op: str, reduce_op, dtype: torch.dtype) -> Optional[Reduction]:
        """``reduce_op`` checked against ``dtype``, remembered when it carries
        no premul factor; None for one that does (it takes the general path)."""
        key = (dtype, reduce_op)
        reduction = self._reductions.get(key)
        if reduction is None and type(reduce_op) is tuple and reduce_op[1] is None:
            reduction = Reduction.parse(reduce_op)
            self._check_reducible(op, reduction, dtype)
            self._reductions[key] = reduction
        return reduction

    def _now(self, async_op: bool) -> Optional[DeviceCommunicatorBase]:
        """The CPU communicator when a call may run directly: synchronous, not
        under debug checks, the communicator already built. None otherwise."""
        if async_op or not self._immediate:
            return None
        return self.coordinator.built_communicator("cpu")

    def _run_now(self, op: str, primitive: Callable[..., None], *args) -> None:
        """``primitive(*args)`` on this thread after the queued ops; failures
        read as they do on the queued path."""
        try:
            self._ops.run(primitive, *args)
        except RuntimeError as exc:
            self._reraise(op, exc)

    def _submit(self, op: str, task: Callable[[], Tensors], async_op: bool, route: "_Route"):
        if route.device.type == "cpu":
            return self._ops.submit(self._guarded(op, task), async_op)
        return self._on_stream(op, task, route)

    def _on_stream(self, op: str, task: Callable[[], Tensors], route: "_Route") -> torch.futures.Future:
        """Enqueue ``task`` on the device communicator's stream, in op order;
        the future lives on the device, so waiting on it orders the waiter's
        current stream after the op (the host does not wait)."""

        def enqueue() -> torch.futures.Future:
            comm = route.communicator()
            with comm.stream_scope(route.tensors):
                future = torch.futures.Future(devices=[route.device])
                future.set_result(task())
            return future

        return self._ops.run(self._guarded(op, enqueue))

    def _where(self, op: str) -> str:
        """How a failure of ``op`` on this group begins."""
        return f"groupcomm: {op} on group {self.coordinator.unique_name!r} (rank {self.rank} of {self.world_size})"

    def _reraise(self, op: str, exc: RuntimeError) -> NoReturn:
        """Raise ``exc`` as a failure of ``op``: as it is when it already says
        what went wrong, else as GroupCommError/CommTimeoutError naming the group."""
        if isinstance(exc, (NotImplementedError, GroupCommError)):
            raise exc
        where = self._where(op)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            # " timeout " is the word torch's own backends use (gloo, NCCL's watchdog) and
            # what torch's test suite looks for in a timed-out collective's error
            raise CommTimeoutError(f"{where} hit its timeout before completing ({exc})") from exc
        raise GroupCommError(f"{where} failed: {exc}") from exc

    def _guarded(self, op: str, task: Callable[[], Tensors]) -> Callable[[], Tensors]:
        def run() -> Tensors:
            try:
                return task()
            except RuntimeError as exc:
                self._reraise(op, exc)

        return run

    # -- collectives ---------------------------------------------------------------

    def broadcast(self, tensors: Tensors, root: int, async_op: bool):
        now = self._now(async_op)
        if now is not None and len(tensors) == 1 and _as_is(tensors[0]) and 0 <= root < self.world_size:
            self._run_now("broadcast", now.broadcast_, flat(tensors[0]), root)
            return tensors
        route = self._route("broadcast", tensors)
        self._check_rank("broadcast", "root", root)

        def task() -> Tensors:
            for t in tensors:
                staged = Staged(t)
                route.communicator().broadcast_(staged.flat, root)
                staged.commit()
            return tensors

        return self._submit("broadcast", task, async_op, route)

    def allreduce(self, tensors: Tensors, reduce_op, async_op: bool):
        now = self._now(async_op)
        if now is not None and len(tensors) == 1 and _as_is(tensors[0]):
            reduction = self._plain_reduction("allreduce", reduce_op, tensors[0].dtype)
            if reduction is not None:
                self._run_now("allreduce", now.all_reduce_, flat(tensors[0]), reduction)
                return tensors
        if len(tensors) == 1 and tensors[0].layout is torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], reduce_op, async_op)
        route = self._route("allreduce", tensors)
        reduction = self._reduction("allreduce", reduce_op, tensors)

        def task() -> Tensors:
            for t in tensors:
                staged = Staged(t)
                route.communicator().all_reduce_(staged.flat, reduction)
                staged.commit()
            return tensors

        return self._submit("allreduce", task, async_op, route)

    def _sparse_allreduce(self, tensor: torch.Tensor, reduce_op, async_op: bool):
        """Sum of a sparse COO tensor over the group, as gloo offers it: every
        rank's (coalesced) entries are all-gathered, summed into one coalesced
        tensor, and copied into ``tensor``."""
        reduction = Reduction.parse(reduce_op)
        if reduction.kind is not Kind.SUM:
            raise ValueError(f"groupcomm: allreduce of a sparse tensor supports ReduceOp.SUM only, got ReduceOp.{reduction.kind.name}")
        self.coordinator.check_device(tensor.device)
        entries = tensor.coalesce()
        indices, values = entries.indices(), entries.values()
        route = _Route(self.coordinator, tensor.device, [indices, values])

        def gather(part: torch.Tensor, counts: List[int]) -> torch.Tensor:
            # one rank's entries after another; `counts` entries of part's rows each
            row = math.prod(part.shape[1:])
            out = part.new_empty(sum(counts) * row)
            route.communicator().all_gatherv_into(out, part.contiguous().view(-1), [n * row for n in counts])
            return out.view(sum(counts), *part.shape[1:])

        def task() -> Tensors:
            nnz = torch.tensor([indices.shape[1]], dtype=torch.int64, device=tensor.device)
            counts = gather(nnz, [1] * self.world_size).view(-1).tolist()
            all_indices = gather(indices.t(), counts).t()
            all_values = gather(values, counts)
            tensor.copy_(torch.sparse_coo_tensor(all_indices, all_values, tensor.shape).coalesce())
            return [tensor]

        return self._submit("allreduce", task, async_op, route)

    def allreduce_coalesced(self, tensors: Tensors, reduce_op, async_op: bool):
        route = self._route("allreduce_coalesced", tensors)
        reduction = self._reduction("allreduce_coalesced", reduce_op, tensors)
        if tensors:
            self._check_dtypes("allreduce_coalesced", tensors, tensors[0].dtype)

        def task() -> Tensors:
            if tensors:
                flat = cat(tensors)
                route.communicator().all_reduce_(flat, reduction)
                scatter_back(flat, tensors)
            return tensors

        return self._submit("allreduce_coalesced", task, async_op, route)

    def reduce(self, tensors: Tensors, reduce_op, root: int, async_op: bool):
        now = self._now(async_op)
        if now is not None and len(tensors) == 1 and _as_is(tensors[0]) and 0 <= root < self.world_size:
            reduction = self._plain_reduction("reduce", reduce_op, tensors[0].dtype)
            if reduction is not None:
                self._run_now("reduce", now.reduce_, flat(tensors[0]), root, reduction)
                return tensors
        route = self._route("reduce", tensors)
        reduction = self._reduction("reduce", reduce_op, tensors)
        self._check_rank("reduce", "root", root)

        def task() -> Tensors:
            for t in tensors:
                staged = Staged(t)
                route.communicator().reduce_(staged.flat, root, reduction)
                if self.rank == root:
                    staged.commit()
            return tensors

        return self._submit("reduce", task, async_op, route)

    def _allgather_plan(self, op: str, outputs: Tensors, input_: torch.Tensor) -> List[int]:
        if len(outputs) != self.world_size:
            raise ValueError(f"groupcomm: {op} needs {self.world_size} output tensors, got {len(outputs)}")
        self._check_dtypes(op, outputs, input_.dtype)
        sizes = [o.numel() for o in outputs]
        self._check_numel(op, f"output for rank {self.rank}", sizes[self.rank], input_.numel())
        return sizes

    def allgather(self, outputs: List[Tensors], inputs: Tensors, async_op: bool):
        """c10d's layout: ``outputs[i][r]`` receives rank r's ``inputs[i]``."""
        op = "allgather"
        if len(outputs) != len(inputs):
            raise ValueError(f"groupcomm: {op} got {len(outputs)} output lists for {len(inputs)} inputs")
        return self._allgather_each(op, outputs, inputs, async_op, [t for ts in outputs for t in ts])

    def allgather_coalesced(self, output_lists: List[Tensors], inputs: Tensors, async_op: bool):
        """c10d's layout: ``output_lists[r][i]`` receives rank r's ``inputs[i]``
        (one list per rank, the transpose of allgather's)."""
        op = "allgather_coalesced"
        if len(output_lists) != self.world_size:
            raise ValueError(
                f"groupcomm: {op} needs {self.world_size} output lists (one per rank), got {len(output_lists)}"
            )
        for rank, outs in enumerate(output_lists):
            if len(outs) != len(inputs):
                raise ValueError(
                    f"groupcomm: {op} output list for rank {rank} has {len(outs)} tensors for {len(inputs)} inputs"
                )
        per_input = [[outs[i] for outs in output_lists] for i in range(len(inputs))]
        return self._allgather_each(op, per_input, inputs, async_op, [t for ts in output_lists for t in ts])

    def _allgather_each(self, op: str, outputs: List[Tensors], inputs: Tensors, async_op: bool, result: Tensors):
        """All-gather ``inputs[i]`` into ``outputs[i]`` (one tensor per rank) for each i."""
        route = self._route(op, result + list(inputs))
        plans = [self._allgather_plan(op, outs, inp) for outs, inp in zip(outputs, inputs)]

        def task() -> Tensors:
            for outs, inp, sizes in zip(outputs, inputs, plans):
                gathered = inp.new_empty(sum(sizes))
                route.communicator().all_gatherv_into(gathered, flat(inp), sizes)
                scatter_back(gathered, outs)
            return result

        return self._submit(op, task, async_op, route)

    def _allgather_base(self, output: torch.Tensor, input_: torch.Tensor, async_op: bool):
        now = self._now(async_op)
        if (now is not None and _as_is(output) and _as_is(input_) and output.dtype == input_.dtype
                and output.numel() == input_.numel() * self.world_size):
            self._run_now("_allgather_base", now.all_gather_into, flat(output), flat(input_))
            return [output]
        return self.allgather_into_tensor_coalesced([output], [input_], async_op, op="_allgather_base")

    def allgather_into_tensor_coalesced(
        self, outputs: Tensors, inputs: Tensors, async_op: bool, *, op: str = "allgather_into_tensor_coalesced"
    ):
        route = self._route(op, list(outputs) + list(inputs))
        self._check_pairs(op, outputs, inputs)
        for out, inp in zip(outputs, inputs):
            self._check_dtypes(op, [out], inp.dtype)
            self._check_numel(op, "output", out.numel(), inp.numel() * self.world_size)

        def task() -> Tensors:
            for out, inp in zip(outputs, inputs):
                staged = Staged(out)
                route.communicator().all_gather_into(staged.flat, flat(inp))
                staged.commit()
            return list(outputs)

        return self._submit(op, task, async_op, route)

    def gather(self, outputs: List[Tensors], inputs: Tensors, root: int, async_op: bool):
        route = self._route("gather", [t for ts in outputs for t in ts] + list(inputs))
        self._check_rank("gather", "root", root)
        if len(inputs) != 1:
            raise ValueError(f"groupcomm: gather takes one input tensor, got {len(inputs)}")
        input_ = inputs[0]
        is_root = self.rank == root
        if is_root:
            if len(outputs) != 1 or len(outputs[0]) != self.world_size:
                raise ValueError(f"groupcomm: gather on the root needs a list of {self.world_size} output tensors")
            self._check_dtypes("gather", outputs[0], input_.dtype)
            for o in outputs[0]:
                self._check_numel("gather", "output", o.numel(), input_.numel())
        elif outputs and any(outputs):
            raise ValueError("groupcomm: gather takes output tensors on the root only")

        def task() -> Tensors:
            if not is_root:
                route.communicator().gather_into(None, flat(input_), root)
                return []
            staged = [Staged(o) for o in outputs[0]]
            route.communicator().gather_into([s.flat for s in staged], flat(input_), root)
            for s in staged:
                s.commit()
            return list(outputs[0])

        return self._submit("gather", task, async_op, route)

    def scatter(self, outputs: Tensors, inputs: List[Tensors], root: int, async_op: bool):
        route = self._route("scatter", list(outputs) + [t for ts in inputs for t in ts])
        self._check_rank("scatter", "root", root)
        if len(outputs) != 1:
            raise ValueError(f"groupcomm: scatter takes one output tensor, got {len(outputs)}")
        output = outputs[0]
        is_root = self.rank == root
        if is_root:
            if len(inputs) != 1 or len(inputs[0]) != self.world_size:
                raise ValueError(f"groupcomm: scatter on the root needs a list of {self.world_size} input tensors")
            self._check_dtypes("scatter", inputs[0], output.dtype)
            for i in inputs[0]:
                self._check_numel("scatter", "input", i.numel(), output.numel())
        elif inputs and any(inputs):
            raise ValueError("groupcomm: scatter takes input tensors on the root only")

        def task() -> Tensors:
            staged = Staged(output)
            route.communicator().scatter_from(staged.flat, [flat(t) for t in inputs[0]] if is_root else None, root)
            staged.commit()
            return [output]

        return self._submit("scatter", task, async_op, route)

    def reduce_scatter(self, outputs: Tensors, inputs: List[Tensors], reduce_op, async_op: bool):
        op = "reduce_scatter"
        route = self._route(op, list(outputs) + [t for ts in inputs for t in ts])
        reduction = self._reduction(op, reduce_op, outputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"groupcomm: {op} got {len(inputs)} input lists for {len(outputs)} outputs")
        plans = []
        for out, ins in zip(outputs, inputs):
            if len(ins) != self.world_size:
                raise ValueError(f"groupcomm: {op} needs {self.world_size} input tensors, got {len(ins)}")
            self._check_dtypes(op, ins, out.dtype)
            self._check_numel(op, f"input for rank {self.rank}", ins[self.rank].numel(), out.numel())
            plans.append([i.numel() for i in ins])

        def task() -> Tensors:
            for out, ins, sizes in zip(outputs, inputs, plans):
                staged = Staged(out)
                route.communicator().reduce_scatterv_into(staged.flat, cat(ins), sizes, reduction)
                staged.commit()
            return list(outputs)

        return self._submit(op, task, async_op, route)

    def _reduce_scatter_base(self, output: torch.Tensor, input_: torch.Tensor, reduce_op, async_op: bool):
        now = self._now(async_op)
        if (now is not None and _as_is(output) and _as_is(input_) and output.dtype == input_.dtype
                and input_.numel() == output.numel() * self.world_size):
            reduction = self._plain_reduction("_reduce_scatter_base", reduce_op, output.dtype)
            if reduction is not None:
                sizes = [output.numel()] * self.world_size
                self._run_now("_reduce_scatter_base", now.reduce_scatterv_into, flat(output), flat(input_), sizes, reduction)
                return [output]
        return self.reduce_scatter_tensor_coalesced([output], [input_], reduce_op, async_op, op="_reduce_scatter_base")

    def reduce_scatter_tensor_coalesced(
        self, outputs: Tensors, inputs: Tensors, reduce_op, async_op: bool, *, op: str = "reduce_scatter_tensor_coalesced"
    ):
        route = self._route(op, list(outputs) + list(inputs))
        reduction = self._reduction(op, reduce_op, outputs)
        self._check_pairs(op, outputs, inputs)
        for out, inp in zip(outputs, inputs):
            self._check_dtypes(op, [inp], out.dtype)
            self._check_numel(op, "input", inp.numel(), out.numel() * self.world_size)

        def task() -> Tensors:
            for out, inp in zip(outputs, inputs):
                staged = Staged(out)
                route.communicator().reduce_scatterv_into(staged.flat, flat(inp), [out.numel()] * self.world_size, reduction)
                staged.commit()
            return list(outputs)

        return self._submit(op, task, async_op, route)

    def _split_elements(self, op: str, what: str, tensor: torch.Tensor, splits: List[int]) -> List[int]:
        rows = tensor.shape[0] if tensor.dim() else 1
        row_numel = tensor.numel() // rows if rows else 0
        if not splits:
            if rows % self.world_size:
                raise ValueError(
                    f"groupcomm: {op} {what} has {rows} rows, not divisible by world size {self.world_size}; pass split sizes"
                )
            return [rows // self.world_size * row_numel] * self.world_size
        if len(splits) != self.world_size:
            raise ValueError(f"groupcomm: {op} {what} split sizes {list(splits)} need {self.world_size} entries")
        if any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"groupcomm: {op} {what} split sizes {list(splits)} do not add up to its {rows} rows")
        return [s * row_numel for s in splits]

    def alltoall_base(
        self, output: torch.Tensor, input_: torch.Tensor, output_splits: List[int], input_splits: List[int],
        async_op: bool,
    ):
        op = "alltoall_base"
        now = self._now(async_op)
        if (now is not None and not output_splits and not input_splits and _as_is(output) and _as_is(input_)
                and output.dtype == input_.dtype and output.numel() == input_.numel()
                and input_.dim() and output.dim() and input_.shape[0] % self.world_size == 0
                and output.shape[0] % self.world_size == 0):
            sizes = [input_.numel() // self.world_size] * self.world_size
            self._run_now(op, now.all_to_all_into, flat(output), flat(input_), sizes, sizes)
            return [output]
        route = self._route(op, [output, input_])
        self._check_dtypes(op, [output], input_.dtype)
        out_sizes = self._split_elements(op, "output", output, list(output_splits))
        in_sizes = self._split_elements(op, "input", input_, list(input_splits))
        if not output_splits and not input_splits:
            # even splits on every rank: each receives as much as it sends
            self._check_numel(op, "output", output.numel(), input_.numel())

        def task() -> Tensors:
            staged = Staged(output)
            route.communicator().all_to_all_into(staged.flat, flat(input_), out_sizes, in_sizes)
            staged.commit()
            return [output]

        return self._submit(op, task, async_op, route)

    def alltoall(self, outputs: Tensors, inputs: Tensors, async_op: bool):
        op = "alltoall"
        route = self._route(op, list(outputs) + list(inputs))
        if len(outputs) != self.world_size or len(inputs) != self.world_size:
            raise ValueError(f"groupcomm: {op} needs {self.world_size} input and output tensors")
        if inputs:
            self._check_dtypes(op, list(outputs) + list(inputs), inputs[0].dtype)

        def task() -> Tensors:
            received = inputs[0].new_empty(sum(o.numel() for o in outputs))
            route.communicator().all_to_all_into(received, cat(inputs), [o.numel() for o in outputs], [i.numel() for i in inputs])
            scatter_back(received, outputs)
            return list(outputs)

        return self._submit(op, task, async_op, route)

    def barrier(self, async_op: bool):
        now = self._now(async_op)
        if now is not None:
            self._run_now("barrier", now.barrier)
            return []
        route = self._route("barrier", [])

        def task() -> Tensors:
            route.communicator().barrier()
            return []

        return self._submit("barrier", task, async_op, route)

    def monitored_barrier(self, timeout_ms: int, wait_all_ranks: bool) -> None:
        """gloo's monitored barrier, on the group's gloo cpu_group after the ops
        issued before it: rank 0 raises naming the first rank that did not
        arrive within the timeout (every such rank with ``wait_all_ranks``);
        the others raise when rank 0 does not release them in time."""
        timeout = self.coordinator.timeout if timeout_ms < 0 else timedelta(milliseconds=timeout_ms)
        self._run_now("monitored_barrier", self.coordinator.cpu_group.monitored_barrier, timeout, wait_all_ranks)

    # -- point to point ---------------------------------------------------------------

    def _check_peer(self, op: str, peer: int) -> None:
        self._check_rank(op, "peer", peer)
        if peer == self.rank:
            raise ValueError(f"groupcomm: {op} with itself (rank {peer}) is not allowed")

    def send(self, tensors: Tensors, dst: int, tag: int):
        route = self._route("send", tensors)
        self._check_peer("send", dst)
        if route.device.type != "cpu":
            def enqueue() -> Tensors:
                for t in tensors:
                    route.communicator().isend(flat(t), dst, tag)
                return tensors

            return self._on_stream("send", enqueue, route)
        comm = self.coordinator.p2p_communicator_for(route.device)
        flats = [flat(t) for t in tensors]
        handles = [comm.isend(f, dst, tag) for f in flats]

        def task() -> Tensors:
            for h in handles:
                h.wait()
            del flats[:]
            return tensors

        return self._complete_p2p("send", handles, task, tensors)

    def recv(self, tensors: Tensors, src: int, tag: int):
        route = self._route("recv", tensors)
        self._check_peer("recv", src)
        if route.device.type != "cpu":
            def enqueue() -> Tensors:
                for t in tensors:
                    staged = Staged(t)
                    route.communicator().irecv(staged.flat, src, tag)
                    staged.commit()
                return tensors

            return self._on_stream("recv", enqueue, route)
        comm = self.coordinator.p2p_communicator_for(route.device)
        staged = [Staged(t) for t in tensors]
        handles = [comm.irecv(s.flat, src, tag) for s in staged]

        def task() -> Tensors:
            for h, s in zip(handles, staged):
                h.wait()
                s.commit()
            return tensors

        direct = len(staged) == 1 and not staged[0].copies
        return self._complete_p2p("recv", handles, task, tensors if direct else None)

    def _complete_p2p(self, op: str, handles, task: Callable[[], Tensors], direct: Optional[Tensors] = None):
        # Transfers already done (a small send into a ring) finish here. One
        # whose result needs no copying back (``direct``: its outputs) and
        # whose communicator can complete a future itself finishes there;
        # the others finish on the completion thread, in the order posted.
        if all(h.is_completed() for h in handles) and self._completions.idle():
            return self._guarded(op, task)()
        native = getattr(handles[0], "future", None) if direct is not None and len(handles) == 1 else None
        if native is not None:
            future = native(direct, self._where(op))
            while self._in_flight and self._in_flight[0].done():
                self._in_flight.popleft()
            self._in_flight.append(future)
            return future
        return self._completions.submit(self._guarded(op, task), True)

    def recv_anysource(self, tensors: Tensors, tag: int):
        comm = self.coordinator.p2p_communicator_for(self._device("recv_anysource", tensors))
        if len(tensors) != 1:
            raise ValueError(f"groupcomm: recv from any source takes one tensor, got {len(tensors)}")
        staged = Staged(tensors[0])
        source = self._guarded("recv_anysource", lambda: comm.recv_any(staged.flat, tag))()
        staged.commit()
        return list(tensors), source

    # -- lifecycle ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish queued work and release the group (called on destroy_process_group)."""
        self._completions.close()
        deadline = time.monotonic() + 5  # as long as close() gives queued work
        for future in self._in_flight:  # a send whose work was dropped still arrives
            while not future.done() and time.monotonic() < deadline:
                time.sleep(0.001)
        self.coordinator.destroy()
        forget(self.coordinator.unique_name)

    def abort(self) -> None:
        """Make every wait on the group fail now, then release it."""
        self.coordinator.abort()
        self.shutdown()
