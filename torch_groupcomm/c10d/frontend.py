"""What the C++ bridge calls (the ops of ``ops.OPS``): c10d's ops, checked,
staged and queued.

Each method receives exactly what c10d handed the backend, checks it (raising
TypeError/ValueError that name the op, ``arguments.py``), and hands the
submission (``submission.py``) a task that stages the tensors into flat
contiguous buffers and runs the communicator's primitive. It returns the op's
output tensors, or a ``torch.futures.Future`` of them; the bridge wraps that
in a c10d ``Work``.

Every op has the same shape: the checks, then one task handed to the
submission. The common synchronous CPU calls never get here once the group's
CPU communicator is the shared-memory one: :meth:`C10dFrontend.native_plan`
hands its engine to the bridge, which runs them in C++ (``csrc/bridge/native.*``).
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Callable

import torch
from torch._C import _distributed_c10d as c10d

from .._registry import coordinator_for, forget, rename
from ..checks import check_peer, check_rank
from ..coordinator import GroupCoordinator
from ..reduction import Kind, Reduction
from ..staging import Staged, cat, flat, scatter_back
from ..stores import get_within
from .arguments import (
    allgather_sizes,
    check_dtypes,
    check_numel,
    check_pairs,
    device_of,
    reduction_of,
    split_elements,
)
from .membership import Member, members
from .submission import Route, Submission, Tensors, as_timeout

SHRINK_ABORT = 0x01  # torch.distributed.SHRINK_ABORT


class C10dFrontend(Submission):
    """Serves one group's c10d backend(s) on top of its coordinator: each op
    checks its arguments, then hands one task to the submission."""

    generation = -1  # the uuid of the reconfigure that formed the group (-1: none did)
    formed_from: c10d.Store | None = None  # the store the group was made with, when a reconfigure formed it

    def native_plan(self) -> None | bool | tuple[object, object, bool]:
        """What the bridge may run without Python, asked by it until decided:
        ``(engine, op queue, p2p)`` when the CPU communicator has a C++
        engine (the bridge queues its asynchronous ops in the group's queue,
        behind the ones Python queued; with ``p2p`` it also posts send/recv
        to the engine, which is then the group's send/recv transport), False
        when it has none, None while no CPU communicator is built yet
        (building one is a collective the bridge must not start)."""
        comm = self.coordinator.built_communicator("cpu")
        if comm is None:
            return None
        engine = comm.native_engine()
        return False if engine is None else (engine, self.coordinator.ops, self.coordinator.sends_through(comm))

    def gloo_plan(self) -> None | bool | object:
        """What the bridge may run on the CPU communicator's gloo group
        without Python, asked by it until decided: a ``_C.GlooPath`` (its
        ops run in the group's op queue; when the communicator is also the
        group's send/recv transport, it posts those too and completes them
        in this frontend's completion queue), False when the communicator
        has none, None while no CPU communicator is built yet."""
        comm = self.coordinator.built_communicator("cpu")
        if comm is None:
            return None
        path = comm.gloo_path(self.coordinator.ops)
        if path is None:
            return False
        if self.coordinator.sends_through(comm):
            path.carry_transfers(self._completions)
        return path

    def cuda_plan(self) -> None | bool | object:
        """What the bridge may enqueue on CUDA without Python, asked by it
        until decided: the NCCL communicator's ``_C.NcclPath`` once its
        communicator and side stream exist, False when it can have none,
        None until then."""
        comm = self.coordinator.built_communicator("cuda")
        return None if comm is None else comm.native_path(self.coordinator.ops)

    # -- checks ------------------------------------------------------------------

    def _check_rank(self, op: str, what: str, rank: int) -> None:
        check_rank(f"groupcomm: {op} {what}", rank, self.world_size, f"group {self.coordinator.unique_name!r}")

    # -- collectives ---------------------------------------------------------------

    def broadcast(self, tensors: Tensors, root: int, async_op: bool, timeout_ms: int):
        route = self._route("broadcast", tensors)
        self._check_rank("broadcast", "root", root)

        def task() -> Tensors:
            for t in tensors:
                staged = Staged(t)
                route.communicator().broadcast_(staged.flat, root)
                staged.commit()
            return tensors

        return self._submit("broadcast", task, async_op, route, timeout_ms)

    def allreduce(self, tensors: Tensors, reduce_op, async_op: bool, timeout_ms: int):
        if len(tensors) == 1 and tensors[0].layout is torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], reduce_op, async_op, timeout_ms)
        route = self._route("allreduce", tensors)
        reduction = reduction_of("allreduce", reduce_op, tensors)

        def task() -> Tensors:
            for t in tensors:
                staged = Staged(t)
                route.communicator().all_reduce_(staged.flat, reduction)
                staged.commit()
            return tensors

        return self._submit("allreduce", task, async_op, route, timeout_ms)

    def _sparse_allreduce(self, tensor: torch.Tensor, reduce_op, async_op: bool, timeout_ms: int):
        """Sum of a sparse COO tensor over the group, as gloo offers it: every
        rank's (coalesced) entries are all-gathered, summed into one coalesced
        tensor, and copied into ``tensor``."""
        reduction = Reduction.parse(reduce_op)
        if reduction.kind is not Kind.SUM:
            raise ValueError(
                f"groupcomm: allreduce of a sparse tensor supports ReduceOp.SUM only, got ReduceOp.{reduction.kind.name}"
            )
        self.coordinator.check_device(tensor.device)
        entries = tensor.coalesce()
        indices, values = entries.indices(), entries.values()
        route = Route(self.coordinator, tensor.device, [indices, values])

        def gather(part: torch.Tensor, counts: list[int]) -> torch.Tensor:
            # one rank's entries after another; `counts` entries of part's rows each
            row = math.prod(part.shape[1:])
            out = part.new_empty(sum(counts) * row)
            route.communicator().all_gatherv_into(out, flat(part), [n * row for n in counts])
            return out.view(sum(counts), *part.shape[1:])

        def task() -> Tensors:
            nnz = torch.tensor([indices.shape[1]], dtype=torch.int64, device=tensor.device)
            counts = gather(nnz, [1] * self.world_size).view(-1).tolist()
            all_indices = gather(indices.t(), counts).t()
            all_values = gather(values, counts)
            tensor.copy_(torch.sparse_coo_tensor(all_indices, all_values, tensor.shape).coalesce())
            return [tensor]

        return self._submit("allreduce", task, async_op, route, timeout_ms)

    def allreduce_coalesced(self, tensors: Tensors, reduce_op, async_op: bool, timeout_ms: int):
        route = self._route("allreduce_coalesced", tensors)
        reduction = reduction_of("allreduce_coalesced", reduce_op, tensors)
        if tensors:
            check_dtypes("allreduce_coalesced", tensors, tensors[0].dtype)

        def task() -> Tensors:
            if tensors:
                joined = cat(tensors)
                route.communicator().all_reduce_(joined, reduction)
                scatter_back(joined, tensors)
            return tensors

        return self._submit("allreduce_coalesced", task, async_op, route, timeout_ms)

    def reduce(self, tensors: Tensors, reduce_op, root: int, async_op: bool, timeout_ms: int):
        route = self._route("reduce", tensors)
        reduction = reduction_of("reduce", reduce_op, tensors)
        self._check_rank("reduce", "root", root)

        def task() -> Tensors:
            for t in tensors:
                staged = Staged(t)
                route.communicator().reduce_(staged.flat, root, reduction)
                if self.rank == root:
                    staged.commit()
            return tensors

        return self._submit("reduce", task, async_op, route, timeout_ms)

    def allgather(self, outputs: list[Tensors], inputs: Tensors, async_op: bool, timeout_ms: int):
        """c10d's layout: ``outputs[i][r]`` receives rank r's ``inputs[i]``."""
        op = "allgather"
        if len(outputs) != len(inputs):
            raise ValueError(f"groupcomm: {op} got {len(outputs)} output lists for {len(inputs)} inputs")
        return self._allgather_each(op, outputs, inputs, async_op, timeout_ms, [t for ts in outputs for t in ts])

    def allgather_coalesced(self, output_lists: list[Tensors], inputs: Tensors, async_op: bool, timeout_ms: int):
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
        return self._allgather_each(op, per_input, inputs, async_op, timeout_ms, [t for ts in output_lists for t in ts])

    def _allgather_each(
        self, op: str, outputs: list[Tensors], inputs: Tensors, async_op: bool, timeout_ms: int, result: Tensors
    ):
        """All-gather ``inputs[i]`` into ``outputs[i]`` (one tensor per rank) for each i."""
        route = self._route(op, result + list(inputs))
        plans = [allgather_sizes(op, outs, inp, self.rank, self.world_size) for outs, inp in zip(outputs, inputs)]

        def task() -> Tensors:
            for outs, inp, sizes in zip(outputs, inputs, plans):
                gathered = inp.new_empty(sum(sizes))
                route.communicator().all_gatherv_into(gathered, flat(inp), sizes)
                scatter_back(gathered, outs)
            return result

        return self._submit(op, task, async_op, route, timeout_ms)

    def _allgather_base(self, output: torch.Tensor, input_: torch.Tensor, async_op: bool, timeout_ms: int):
        return self.allgather_into_tensor_coalesced([output], [input_], async_op, timeout_ms, op="_allgather_base")

    def allgather_into_tensor_coalesced(
        self,
        outputs: Tensors,
        inputs: Tensors,
        async_op: bool,
        timeout_ms: int,
        *,
        op: str = "allgather_into_tensor_coalesced",
    ):
        route = self._route(op, list(outputs) + list(inputs))
        check_pairs(op, outputs, inputs)
        for out, inp in zip(outputs, inputs):
            check_dtypes(op, [out], inp.dtype)
            check_numel(op, "output", out.numel(), inp.numel() * self.world_size)

        def task() -> Tensors:
            for out, inp in zip(outputs, inputs):
                staged = Staged(out)
                route.communicator().all_gather_into(staged.flat, flat(inp))
                staged.commit()
            return list(outputs)

        return self._submit(op, task, async_op, route, timeout_ms)

    def gather(self, outputs: list[Tensors], inputs: Tensors, root: int, async_op: bool, timeout_ms: int):
        route = self._route("gather", [t for ts in outputs for t in ts] + list(inputs))
        self._check_rank("gather", "root", root)
        if len(inputs) != 1:
            raise ValueError(f"groupcomm: gather takes one input tensor, got {len(inputs)}")
        input_ = inputs[0]
        is_root = self.rank == root
        if is_root:
            if len(outputs) != 1 or len(outputs[0]) != self.world_size:
                raise ValueError(f"groupcomm: gather on the root needs a list of {self.world_size} output tensors")
            check_dtypes("gather", outputs[0], input_.dtype)
            for o in outputs[0]:
                check_numel("gather", "output", o.numel(), input_.numel())
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

        return self._submit("gather", task, async_op, route, timeout_ms)

    def scatter(self, outputs: Tensors, inputs: list[Tensors], root: int, async_op: bool, timeout_ms: int):
        route = self._route("scatter", list(outputs) + [t for ts in inputs for t in ts])
        self._check_rank("scatter", "root", root)
        if len(outputs) != 1:
            raise ValueError(f"groupcomm: scatter takes one output tensor, got {len(outputs)}")
        output = outputs[0]
        is_root = self.rank == root
        if is_root:
            if len(inputs) != 1 or len(inputs[0]) != self.world_size:
                raise ValueError(f"groupcomm: scatter on the root needs a list of {self.world_size} input tensors")
            check_dtypes("scatter", inputs[0], output.dtype)
            for i in inputs[0]:
                check_numel("scatter", "input", i.numel(), output.numel())
        elif inputs and any(inputs):
            raise ValueError("groupcomm: scatter takes input tensors on the root only")

        def task() -> Tensors:
            staged = Staged(output)
            route.communicator().scatter_from(staged.flat, [flat(t) for t in inputs[0]] if is_root else None, root)
            staged.commit()
            return [output]

        return self._submit("scatter", task, async_op, route, timeout_ms)

    def reduce_scatter(self, outputs: Tensors, inputs: list[Tensors], reduce_op, async_op: bool, timeout_ms: int):
        op = "reduce_scatter"
        route = self._route(op, list(outputs) + [t for ts in inputs for t in ts])
        reduction = reduction_of(op, reduce_op, outputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"groupcomm: {op} got {len(inputs)} input lists for {len(outputs)} outputs")
        plans = []
        for out, ins in zip(outputs, inputs):
            if len(ins) != self.world_size:
                raise ValueError(f"groupcomm: {op} needs {self.world_size} input tensors, got {len(ins)}")
            check_dtypes(op, ins, out.dtype)
            check_numel(op, f"input for rank {self.rank}", ins[self.rank].numel(), out.numel())
            plans.append([i.numel() for i in ins])

        def task() -> Tensors:
            for out, ins, sizes in zip(outputs, inputs, plans):
                staged = Staged(out)
                route.communicator().reduce_scatterv_into(staged.flat, cat(ins), sizes, reduction)
                staged.commit()
            return list(outputs)

        return self._submit(op, task, async_op, route, timeout_ms)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input_: torch.Tensor, reduce_op, async_op: bool, timeout_ms: int
    ):
        return self.reduce_scatter_tensor_coalesced(
            [output], [input_], reduce_op, async_op, timeout_ms, op="_reduce_scatter_base"
        )

    def reduce_scatter_tensor_coalesced(
        self,
        outputs: Tensors,
        inputs: Tensors,
        reduce_op,
        async_op: bool,
        timeout_ms: int,
        *,
        op: str = "reduce_scatter_tensor_coalesced",
    ):
        route = self._route(op, list(outputs) + list(inputs))
        reduction = reduction_of(op, reduce_op, outputs)
        check_pairs(op, outputs, inputs)
        for out, inp in zip(outputs, inputs):
            check_dtypes(op, [inp], out.dtype)
            check_numel(op, "input", inp.numel(), out.numel() * self.world_size)

        def task() -> Tensors:
            for out, inp in zip(outputs, inputs):
                staged = Staged(out)
                route.communicator().reduce_scatterv_into(
                    staged.flat, flat(inp), [out.numel()] * self.world_size, reduction
                )
                staged.commit()
            return list(outputs)

        return self._submit(op, task, async_op, route, timeout_ms)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
        timeout_ms: int,
    ):
        op = "alltoall_base"
        route = self._route(op, [output, input_])
        check_dtypes(op, [output], input_.dtype)
        out_sizes = split_elements(op, "output", output, list(output_splits), self.world_size)
        in_sizes = split_elements(op, "input", input_, list(input_splits), self.world_size)
        even = not output_splits and not input_splits
        if even:
            # even splits on every rank: each receives as much as it sends
            check_numel(op, "output", output.numel(), input_.numel())

        def task() -> Tensors:
            staged = Staged(output)
            if even:
                route.communicator().all_to_all_even_into(staged.flat, flat(input_))
            else:
                route.communicator().all_to_all_into(staged.flat, flat(input_), out_sizes, in_sizes)
            staged.commit()
            return [output]

        return self._submit(op, task, async_op, route, timeout_ms)

    def alltoall(self, outputs: Tensors, inputs: Tensors, async_op: bool, timeout_ms: int):
        op = "alltoall"
        route = self._route(op, list(outputs) + list(inputs))
        if len(outputs) != self.world_size or len(inputs) != self.world_size:
            raise ValueError(f"groupcomm: {op} needs {self.world_size} input and output tensors")
        if inputs:
            check_dtypes(op, list(outputs) + list(inputs), inputs[0].dtype)

        def task() -> Tensors:
            received = inputs[0].new_empty(sum(o.numel() for o in outputs))
            route.communicator().all_to_all_into(
                received, cat(inputs), [o.numel() for o in outputs], [i.numel() for i in inputs]
            )
            scatter_back(received, outputs)
            return list(outputs)

        return self._submit(op, task, async_op, route, timeout_ms)

    def barrier(self, async_op: bool, timeout_ms: int):
        route = self._route("barrier", [])

        def task() -> Tensors:
            route.communicator().barrier()
            return []

        return self._submit("barrier", task, async_op, route, timeout_ms)

    def monitored_barrier(self, timeout_ms: int, wait_all_ranks: bool) -> None:
        """gloo's monitored barrier, on the group's gloo cpu_group after the ops
        issued before it: rank 0 raises naming the first rank that did not
        arrive within the timeout (every such rank with ``wait_all_ranks``);
        the others raise when rank 0 does not release them in time."""
        timeout = as_timeout(timeout_ms, self.coordinator.timeout)
        self.coordinator.check_formed()
        self._run_now("monitored_barrier", self.coordinator.cpu_group.monitored_barrier, timeout, wait_all_ranks)

    # -- point to point ---------------------------------------------------------------

    def _check_peer(self, op: str, peer: int, route: Route) -> None:
        # as with torch's nccl backend, a CUDA batch may hold a rank's transfers with itself
        if route.device.type != "cpu" and self._batch is not None:
            self._check_rank(op, "peer", peer)
            return
        check_peer(f"groupcomm: {op} peer", peer, self.rank, self.world_size, f"group {self.coordinator.unique_name!r}")

    def send(self, tensors: Tensors, dst: int, tag: int):
        route = self._route("send", tensors)
        self._check_peer("send", dst, route)
        if route.device.type != "cpu":

            def enqueue() -> Tensors:
                flats = [flat(t) for t in tensors]
                for f in flats:
                    route.communicator().isend(f, dst, tag)
                self._after_transfer(flats.clear)  # copies of non-contiguous tensors live until then
                return tensors

            return self._on_stream("send", enqueue, route, transfer=True)
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
        self._check_peer("recv", src, route)
        if route.device.type != "cpu":

            def enqueue() -> Tensors:
                staged = [Staged(t) for t in tensors]
                for s in staged:
                    route.communicator().irecv(s.flat, src, tag)
                self._after_transfer(lambda: [s.commit() for s in staged])
                return tensors

            return self._on_stream("recv", enqueue, route, transfer=True)
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

    def _complete_p2p(self, op: str, handles, task: Callable[[], Tensors], direct: Tensors | None = None):
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
        comm = self.coordinator.p2p_communicator_for(
            device_of("recv_anysource", tensors, self.coordinator.check_device)
        )
        if len(tensors) != 1:
            raise ValueError(f"groupcomm: recv from any source takes one tensor, got {len(tensors)}")
        staged = Staged(tensors[0])
        source = self._guarded("recv_anysource", lambda: comm.recv_any(staged.flat, tag))()
        staged.commit()
        return list(tensors), source

    # -- lifecycle ------------------------------------------------------------------------

    def shrink(self, excluded: list[int], flags: int, timeout_ms: int) -> tuple[int, int, C10dFrontend]:
        """``dist.shrink_group`` on a survivor: the group without the
        ``excluded`` ranks, as ``(rank, size, frontend)`` for the bridge's new
        backend. With ``SHRINK_ABORT`` (flag 1) this group's ops in flight
        fail first. torch destroys this group afterwards."""
        if flags & SHRINK_ABORT:
            self.coordinator.abort()
        survivors = self.coordinator.shrunk(excluded, as_timeout(timeout_ms))
        return survivors.rank_in_group, survivors.world_size, type(self)(survivors)

    def split(self, store, ranks: list[int], name: str, timeout_ms: int) -> tuple[int, int, C10dFrontend]:
        """``dist.split_group`` on one of ``ranks`` (ranks of this group, the
        first becoming rank 0): that group, named ``name`` and built by its
        ranks alone from torch's ``store``, as ``(rank, size, frontend)`` for
        the bridge's new backend."""
        split = self.coordinator.split(store, ranks, name, as_timeout(timeout_ms))
        return split.rank_in_group, split.world_size, type(self)(split)

    def reconfigure_handle(self) -> str:
        """``dist._get_reconfigure_handle``: this process in this generation of
        the group (``membership.Member``), for the peers to exchange out of band."""
        c = self.coordinator
        return Member.this_process(c.rank, c.rank_in_group, self.generation).handle

    def reconfigure(
        self, handles: list[str], ordered: bool, uuid: int, timeout_ms: int
    ) -> Callable[[], tuple[int, int, C10dFrontend]]:
        """``dist._reconfigure``, first half: checks ``handles`` (this
        process's among them) and claims ``uuid``, then returns what forms the
        group of those processes, as ``(rank, size, frontend)`` for the
        bridge. Its rank is its handle's place in the list (``ordered``) or in
        the sorted handles; its store is this group's under a prefix named by
        ``uuid``, which the new rank 0 claims, so a reused uuid fails on every
        member before anything is torn down. Forming it fails this
        generation's ops in flight, releases what it holds and builds the
        new one within ``timeout_ms`` (-1: the group's timeout, which the new
        generation keeps)."""
        chosen = members(handles, ordered)
        mine = self.reconfigure_handle()
        if mine not in chosen:
            raise ValueError(f"groupcomm: reconfigure handles {chosen} do not include this process's, {mine!r}")
        rank, size = chosen.index(mine), len(chosen)
        old = self.coordinator
        timeout = as_timeout(timeout_ms, old.timeout)
        origin = self.formed_from or old.store
        store = c10d.PrefixStore(f"groupcomm/reconfigure/{uuid}/", origin)
        claimed = (
            store.compare_set("claimed", "", chosen[0]) if rank == 0 else get_within(store, ["claimed"], timeout)[0]
        )
        if claimed.decode() != chosen[0]:
            raise RuntimeError(
                f"groupcomm: reconfigure uuid {uuid} was already used on group {old.unique_name!r}; "
                "each reconfigure needs a fresh uuid"
            )

        def form() -> tuple[int, int, C10dFrontend]:
            self.abort()
            built = None
            try:
                built = coordinator_for(
                    old.unique_name,
                    lambda: GroupCoordinator.for_c10d(
                        store=store,
                        rank=rank,
                        world_size=size,
                        timeout=timeout,
                        group_name=old.unique_name,
                        global_ranks=[Member.parse(h).global_rank for h in chosen],
                    ),
                )
                built.prepare_cpu()
            except Exception as exc:
                if built is not None:
                    built.abort()
                    forget(old.unique_name)
                old.ended_by = (
                    f"dist._reconfigure (uuid {uuid}), which failed to form the next generation "
                    f"({type(exc).__name__}: {exc}); dist._reconfigure with a fresh uuid forms the group again"
                )
                raise
            built.set_timeout(old.timeout)
            frontend = type(self)(built)
            frontend.generation, frontend.formed_from = uuid, origin
            return rank, size, frontend

        return form

    def current_timeout(self) -> int:
        """The group's timeout in milliseconds (what a group split from it keeps)."""
        return round(self.coordinator.timeout.total_seconds() * 1000)

    def named(self, name: str) -> None:
        """torch named the group ``name`` (the same as the coordinator's, except
        for a group ``dist.shrink_group`` made): its coordinator goes by it."""
        if name and name != self.coordinator.unique_name:
            rename(self.coordinator, name)

    def set_timeout(self, timeout_ms: int) -> None:
        """``dist.set_timeout``: the ops issued from now on, on every path, use
        this timeout (ops already issued keep theirs, as gloo's do)."""
        self.coordinator.set_timeout(timedelta(milliseconds=timeout_ms))

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
