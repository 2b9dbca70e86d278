"""GroupCoordinator: one per group; decides which communicator carries each call.

It owns the group's ``cpu_group`` (a gloo group over the same ranks, on its own
prefix of the group's store) used for barriers and metadata, and one device
communicator per device type, created by the first collective on that device
(so every rank creates it at the same point of the op sequence).

CPU routing: ranks on one host use shared memory; a group spanning hosts uses
shared memory inside each host and gloo between hosts; ``GROUPCOMM_CPU_COMMUNICATOR``
can force ``gloo`` or ``shm``. CPU point-to-point traffic goes over the
communicator prepared with the group, or gloo: it is not ordered with
collectives, so it cannot create anything. CUDA tensors go to NCCL (the
communicator object is local; its NCCL communicators are made by the first
collective, or by a pair's first send/recv).

The same object offers vLLM's ``GroupCoordinator`` API (out-of-place
collectives here; objects, tensor dicts and message-queue broadcast from its
base ``object_exchange.ObjectExchange``) to code that
drives groups directly: build one with ``GroupCoordinator(group_ranks, ...)``,
get the one behind a c10d group with ``torch_groupcomm.get_coordinator(group)``,
or one over a :class:`~torch_groupcomm.stateless.StatelessProcessGroup`.
Its calls are synchronous and run in order with the group's queued c10d ops.
Its tensor collectives call the custom ops ``torch.ops.groupcomm.*``
(``custom_ops.py``), so that eager and compiled code take one route: on a
shared-memory group the op runs in C++; elsewhere it comes back to
:meth:`GroupCoordinator.python_path`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from . import config as config_module
from . import custom_ops
from ._native import _C
from ._registry import coordinator_for, get_coordinator, name
from .checks import check_peer, check_rank
from .communicators.base import DeviceCommunicatorBase
from .communicators.transports import Setting, build
from .object_exchange import ObjectExchange
from .staging import Staged
from .topology import Topology, discover, host_identity

CPU_GROUP_PREFIX = "groupcomm/cpu_group/"


_anonymous = itertools.count()


@dataclass
class GraphCaptureContext:
    """What ``graph_capture`` yields: the stream work is captured on (None on CPU)."""

    stream: Any | None


class GroupCoordinator(ObjectExchange):
    """The routing brain of one process group, and vLLM's coordinator API on top."""

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str | dist.Backend = "groupcomm",
        use_device_communicator: bool = True,
        use_message_queue_broadcaster: bool = False,
        group_name: str | None = None,
    ) -> None:
        """Form one group per entry of ``group_ranks`` (collective over the
        default group: every process passes the same lists) and keep the one
        holding this process. ``torch_distributed_backend`` serves
        ``device_group``; a gloo ``cpu_group`` over the same ranks carries
        metadata and barriers."""
        if not dist.is_initialized():
            raise RuntimeError(
                "groupcomm: GroupCoordinator(group_ranks, ...) needs torch.distributed.init_process_group first "
                "(StatelessProcessGroup forms groups without it)"
            )
        rank = dist.get_rank()
        mine: tuple[list[int], Any, Any] | None = None
        for ranks in group_ranks:
            ranks = [int(r) for r in ranks]
            device_group = dist.new_group(ranks, backend=torch_distributed_backend)
            cpu_group = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                mine = (ranks, device_group, cpu_group)
        if mine is None:
            raise ValueError(f"groupcomm: rank {rank} is in none of group_ranks {group_ranks}")
        ranks, device_group, cpu_group = mine
        store = c10d.PrefixStore("groupcomm/coordinator/", dist.distributed_c10d._get_process_group_store(cpu_group))
        name = f"{group_name or 'anonymous'}:{next(_anonymous)}"
        self._setup(cpu_group, store, ranks.index(rank), len(ranks), _group_timeout(), name, ranks)
        self.device_group = device_group
        self.local_rank = local_rank
        self.use_device_communicator = use_device_communicator
        self._owns_groups = True
        if torch.cuda.is_available() and torch_distributed_backend != "gloo":
            self.device = torch.device(f"cuda:{local_rank}")
        if self.world_size > 1:
            self.prepare_cpu()
            if use_message_queue_broadcaster:
                self.mq_broadcaster = self.create_mq_broadcaster()

    @classmethod
    def from_cpu_group(
        cls,
        cpu_group,
        store: c10d.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        group_name: str,
        global_ranks: list[int] | None = None,
    ) -> GroupCoordinator:
        """A coordinator over an existing gloo ``cpu_group`` (a c10d backend or
        ProcessGroup) whose ``store`` is private to the group."""
        self = cls.__new__(cls)
        self._setup(cpu_group, store, rank, world_size, timeout, group_name, global_ranks)
        return self

    def _setup(self, cpu_group, store, rank, world_size, timeout, group_name, global_ranks) -> None:
        self.cpu_group = cpu_group
        self.store = store
        self.config = config_module.load()
        self.topology: Topology | None = None
        self.rank_in_group = rank
        self.world_size = world_size
        self.timeout = timeout
        self.unique_name = group_name
        self.ranks = list(global_ranks) if global_ranks else list(range(world_size))
        self.rank = self.ranks[rank]
        self.local_rank = rank
        self.device = torch.device("cpu")
        self.device_group = None
        self.use_device_communicator = True
        self.mq_broadcaster = None
        self.ops = _C.OpQueue(group_name)
        self._owns_groups = False
        self._communicators: dict[str, DeviceCommunicatorBase] = {}
        self._p2p_cpu: DeviceCommunicatorBase | None = None
        self._lock = threading.Lock()
        self._destroyed = False
        self.ended_by = ""  # what destroyed the group, when not its owner: named in every later op's error
        name(self, group_name)

    @classmethod
    def for_c10d(
        cls,
        store: c10d.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        group_name: str,
        global_ranks: list[int] | None = None,
        formed: bool = True,
    ) -> GroupCoordinator:
        """Build the coordinator of a c10d process group from its factory
        arguments. ``formed=False`` (a group made with
        ``enable_reconfigure=True``): it knows its place but has no members
        (no gloo group, no communicator, every op refused) until
        ``dist._reconfigure`` forms the group."""
        cpu_group = (
            c10d.ProcessGroupGloo(c10d.PrefixStore(CPU_GROUP_PREFIX, store), rank, world_size, timeout)
            if formed
            else None
        )
        return cls.from_cpu_group(cpu_group, store, rank, world_size, timeout, group_name, global_ranks)

    def check_formed(self) -> None:
        """Raise RuntimeError while the group has no members (``for_c10d(formed=False)``)."""
        if self.cpu_group is None and not self._destroyed:
            raise RuntimeError(
                f"groupcomm: group {self.unique_name!r} was made with enable_reconfigure=True and has no "
                "members until torch.distributed._reconfigure(uuid, handles) forms it"
            )

    def shrunk(self, excluded: Sequence[int], timeout: timedelta | None = None) -> GroupCoordinator:
        """The coordinator of this group without the ``excluded`` ranks (of
        this group), built by the survivors alone, each calling this
        (``dist.shrink_group`` after a rank died), with its CPU communicator
        ready. Its store is this group's under a prefix naming the survivors,
        so the dead rank is never waited for; its settings and timeout are this
        group's unless ``timeout`` is given. Registered under the name torch
        will give the group (re-keyed if torch picks another, see
        ``C10dFrontend.named``)."""
        gone = set(excluded)
        survivors = [r for r in range(self.world_size) if r not in gone]
        name = _shrunk_group_name([self.ranks[r] for r in survivors])
        store = c10d.PrefixStore(f"groupcomm/shrunk/{name}/", self.store)
        coordinator = self.split(store, survivors, name, timeout)
        coordinator.prepare_cpu()
        return coordinator

    def split(
        self, store: c10d.Store, ranks: Sequence[int], name: str, timeout: timedelta | None = None
    ) -> GroupCoordinator:
        """The coordinator of the group of this group's ``ranks``, in that
        order (``dist.split_group``), built by those ranks alone, each calling
        this, from ``store`` (private to the new group) and registered
        under ``name``. Its settings and timeout are this group's unless
        ``timeout`` is given; its CPU communicator is ready where this group's
        was made ready (``prepare_cpu``)."""
        ranks = list(ranks)

        def build() -> GroupCoordinator:
            return GroupCoordinator.for_c10d(
                store=store,
                rank=ranks.index(self.rank_in_group),
                world_size=len(ranks),
                timeout=timeout or self.timeout,
                group_name=name,
                global_ranks=[self.ranks[r] for r in ranks],
            )

        coordinator = coordinator_for(name, build)
        cpu = self.built_communicator("cpu")
        if cpu is not None and self.sends_through(cpu):
            coordinator.prepare_cpu()
        return coordinator

    # -- routing -----------------------------------------------------------------------

    def communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator that carries tensors living on ``device``."""
        comm = self._communicators.get(device.type)
        if comm is not None:
            return comm
        if self._destroyed:
            ended_by = f" by {self.ended_by}" if self.ended_by else ""
            raise RuntimeError(f"groupcomm: group {self.unique_name} has been destroyed{ended_by}")
        with self._lock:
            comm = self._communicators.get(device.type)
            if comm is None:
                comm = self._make_communicator(device)
                self._communicators[device.type] = comm
                if device.type == "cpu":
                    custom_ops.publish(self.unique_name, comm.native_engine(), self.ops)
        return comm

    def rename(self, unique_name: str) -> None:
        """Go by ``unique_name`` from now on (torch named the group), for the
        custom ops as well."""
        old, self.unique_name = self.unique_name, unique_name
        name(self, unique_name, old)
        cpu = self.built_communicator("cpu")
        if cpu is not None:
            custom_ops.withdraw(old, self.ops)
            custom_ops.publish(unique_name, cpu.native_engine(), self.ops)

    def built_communicator(self, device_type: str) -> DeviceCommunicatorBase | None:
        """The communicator for ``device_type`` if it exists already (None
        otherwise: building one is a collective, which this never starts)."""
        return self._communicators.get(device_type)

    def share_storage(self, tensor: torch.Tensor) -> bool:
        """Move ``tensor``'s storage into memory the group's peers read in
        place, contents kept, as ``Tensor.share_memory_()`` moves it: the
        collectives on it then skip the copy through the shared segment.
        Every view of that storage follows; anything holding its old address
        (``numpy()``, ``data_ptr()``) does not, so call it only on a buffer
        you own. Returns whether the storage now lies there (False: not a
        shared-memory group, not yet used on the CPU, under 64 KiB, or not a
        plain CPU allocation; nothing moved)."""
        comm = self.built_communicator(tensor.device.type)
        return comm is not None and comm.share_storage(tensor)

    def prepare_cpu(self) -> None:
        """Build the CPU communicator now (collective over the group), so that
        send/recv, which are not ordered with collectives, can use it too."""
        self._p2p_cpu = self.communicator_for(torch.device("cpu"))

    def sends_through(self, comm: DeviceCommunicatorBase) -> bool:
        """Whether CPU send/recv go through ``comm`` (it was prepared with the
        group), without settling the choice as ``p2p_communicator_for`` does."""
        return self._p2p_cpu is comm

    def p2p_communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator for send/recv. Every rank must pick the same one
        whatever it has run so far: the CPU communicator if it was prepared
        when the group was made, otherwise gloo over the cpu_group."""
        if device.type == "cpu":
            if self._p2p_cpu is None:
                self._p2p_cpu = self._gloo()
            return self._p2p_cpu
        return self.communicator_for(device)

    @property
    def device_communicator(self) -> DeviceCommunicatorBase | None:
        """The communicator for this coordinator's device (None for a group of one)."""
        if self.world_size == 1:
            return None
        return self.communicator_for(self.device)

    def _setting(self, **fields) -> Setting:
        self.check_formed()
        return Setting(self.cpu_group, self.store, self.timeout, self.unique_name, self.config, **fields)

    def _gloo(self) -> DeviceCommunicatorBase:
        return build("gloo", self._setting())

    def check_device(self, device: torch.device) -> None:
        """Raise NotImplementedError for a device type no communicator serves."""
        if device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"groupcomm: tensors on device type {device.type!r} are not supported (CPU and CUDA only)"
            )

    def _make_communicator(self, device: torch.device) -> DeviceCommunicatorBase:
        """The routing decision for ``device``: NCCL for CUDA; on the CPU gloo
        when told so (or when the coordinator is asked not to use a device
        communicator), shared memory on one host (gloo if it cannot be
        mapped), hierarchical across hosts (gloo with one rank a host)."""
        self.check_device(device)
        if device.type == "cuda":
            return build("nccl", self._setting(device=device))
        cfg = self.config
        if not self.use_device_communicator or cfg.cpu_communicator == "gloo":
            return self._gloo()
        self.topology = discover(
            self.store, self.rank_in_group, self.world_size, host_identity(cfg.host_id), self.timeout
        )
        if self.topology.single_host or cfg.cpu_communicator == "shm":
            return build("shm", self._setting()) or self._gloo()
        if all(len(ranks) == 1 for ranks in self.topology.hosts):
            return self._gloo()  # nothing to share within a host
        return build("hierarchical", self._setting(topology=self.topology))

    def _run(self, task):
        """Run ``task`` in order with the group's queued c10d work."""
        return self.ops.run(task)

    # -- ranks -------------------------------------------------------------------------

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """Whether this process is the group's first member."""
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        """Whether this process is the group's last member."""
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _check_rank(self, what: str, rank: int) -> int:
        return check_rank(f"groupcomm: {what}", rank, self.world_size, f"group {self.unique_name!r}")

    def _check_peer(self, what: str, rank: int) -> int:
        return check_peer(
            f"groupcomm: {what}", rank, self.rank_in_group, self.world_size, f"group {self.unique_name!r}"
        )

    @staticmethod
    def _check_dim(tensor: torch.Tensor, dim: int) -> int:
        ndim = max(tensor.dim(), 1)
        if not -ndim <= dim < ndim:
            raise ValueError(f"groupcomm: dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
        return dim % ndim

    # -- tensors (out of place unless said) ----------------------------------------------

    def _on_device(self, method: str, input_: torch.Tensor, *args):
        """``input_``'s communicator's ``method`` run in order (``input_``
        itself in a group of one)."""
        if self.world_size == 1:
            return input_
        comm = self.communicator_for(input_.device)
        return self._run(lambda: getattr(comm, method)(input_, *args))

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the group, as a new tensor."""
        if self.world_size == 1:
            return input_
        return custom_ops.ALL_REDUCE(input_, self.unique_name)

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim`` in rank order."""
        dim = self._check_dim(input_, dim)
        if self.world_size == 1:
            return input_
        return custom_ops.ALL_GATHER(input_, dim, self.unique_name)

    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        return self.all_gather(input_, dim)

    def all_gatherv(
        self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Concatenate along ``dim`` where rank i holds ``sizes[i]`` rows
        (equal rows when None); a list of tensors gathers each of them."""
        if isinstance(input_, (list, tuple)):
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        dim, sizes = self._check_gatherv(input_, dim, sizes)
        if self.world_size == 1:
            return input_
        return custom_ops.ALL_GATHERV(input_, dim, sizes, self.unique_name)

    def _check_gatherv(self, input_: torch.Tensor, dim: int, sizes: list[int] | None) -> tuple[int, list[int] | None]:
        dim = self._check_dim(input_, dim)
        if sizes is not None:
            sizes = [int(n) for n in sizes]
            if len(sizes) != self.world_size:
                raise ValueError(f"groupcomm: all_gatherv got {len(sizes)} sizes for {self.world_size} ranks")
            if input_.dim() and sizes[self.rank_in_group] != input_.shape[dim]:
                raise ValueError(
                    f"groupcomm: all_gatherv size for rank {self.rank_in_group} is {sizes[self.rank_in_group]}, "
                    f"but the input has {input_.shape[dim]} along dim {dim}"
                )
        return dim, sizes

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group; this rank keeps its equal slice along ``dim``."""
        dim = self._check_dim(input_, dim)
        if self.world_size == 1:
            return input_
        return custom_ops.REDUCE_SCATTER(input_, dim, self.unique_name)

    def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        return self.reduce_scatter(input_, dim)

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Sum over the group; rank i keeps ``sizes[i]`` rows along ``dim``."""
        dim, sizes = self._check_scatterv(input_, dim, sizes)
        if self.world_size == 1:
            return input_
        return custom_ops.REDUCE_SCATTERV(input_, dim, sizes, self.unique_name)

    def _check_scatterv(self, input_: torch.Tensor, dim: int, sizes: list[int] | None) -> tuple[int, list[int] | None]:
        dim = self._check_dim(input_, dim)
        if sizes is not None:
            sizes = [int(n) for n in sizes]
            if len(sizes) != self.world_size:
                raise ValueError(f"groupcomm: reduce_scatterv got {len(sizes)} sizes for {self.world_size} ranks")
        return dim, sizes

    def python_path(self, op: str, input_: torch.Tensor, *args) -> torch.Tensor:
        """Run custom op ``op``'s call (``custom_ops.py``) on the group's
        communicator from Python: what the C++ kernel leaves (no
        shared-memory engine, another device, a dtype or shape it declines).
        Checks the arguments as the method of that name does."""
        if op == "broadcast":
            (src,) = args
            self._check_rank("broadcast src", src)
            out = input_.clone(memory_format=torch.contiguous_format)
            if self.world_size > 1:
                self._broadcast_in_place(out, src)
            return out
        if op == "all_reduce":
            return self._on_device("all_reduce", input_)
        if op in ("all_gather", "reduce_scatter"):
            return self._on_device(op, input_, self._check_dim(input_, args[0]))
        if op == "all_gatherv":
            return self._on_device(op, input_, *self._check_gatherv(input_, *args))
        if op == "reduce_scatterv":
            return self._on_device(op, input_, *self._check_scatterv(input_, *args))
        raise ValueError(f"groupcomm: no custom op {op!r}")

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``input_`` concatenated along ``dim`` on ``dst`` (a rank
        in the group); None on the others."""
        self._check_rank("gather dst", dst)
        dim = self._check_dim(input_, dim)
        return self._on_device("gather", input_, dst, dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``input_`` with ``src``'s (a rank in the group); returns it."""
        self._check_rank("broadcast src", src)
        if self.world_size == 1:
            return input_
        out = custom_ops.BROADCAST(input_, src, self.unique_name)
        if self.rank_in_group != src:
            input_.copy_(out)
        return input_

    def _broadcast_in_place(self, input_: torch.Tensor, src: int) -> None:
        comm = self.communicator_for(input_.device)

        def task() -> None:
            staged = Staged(input_)
            comm.broadcast_(staged.flat, src)
            staged.commit()

        self._run(task)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to ``dst`` (default: the next rank), blocking."""
        dst = self._check_peer("send dst", (self.rank_in_group + 1) % self.world_size if dst is None else dst)
        comm = self.p2p_communicator_for(tensor.device)
        self._run(lambda: comm.send(tensor, dst))

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a ``size``/``dtype`` tensor from ``src`` (default: the previous rank)."""
        src = self._check_peer("recv src", (self.rank_in_group - 1) % self.world_size if src is None else src)
        comm = self.p2p_communicator_for(self.device)
        return self._run(lambda: comm.recv(size, dtype, src))

    def barrier(self) -> None:
        """Synchronise the group's ranks on the cpu_group (never on a device)."""
        opts = c10d.BarrierOptions()
        opts.timeout = self.timeout
        self.check_formed()
        self._run(lambda: self.cpu_group.barrier(opts).wait())

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier on the cpu_group, after the group's queued
        ops: rank 0 raises naming the first rank that did not arrive within
        ``timeout`` (the group's when None), every such rank with
        ``wait_all_ranks``; the others raise when rank 0 does not release them
        in time. Works on any torch, for any coordinator."""
        self.check_formed()
        self._run(lambda: self.cpu_group.monitored_barrier(timeout or self.timeout, wait_all_ranks))

    # -- model hooks ------------------------------------------------------------------------

    @contextmanager
    def graph_capture(self, graph_capture_context: GraphCaptureContext | None = None) -> Iterator[GraphCaptureContext]:
        """Scope for capturing a graph: on CUDA the work runs on a side stream
        (the given context's, or a new one) that first waits for the current
        stream; on the CPU there is nothing to capture on (stream None)."""
        if graph_capture_context is None:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            graph_capture_context = GraphCaptureContext(stream)
        stream = graph_capture_context.stream
        if stream is None:
            yield graph_capture_context
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield graph_capture_context

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Let the device communicator register buffers for ``model``."""
        if self.device_communicator is not None:
            self.device_communicator.prepare_communication_buffer_for_model(model)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ):
        """Expert-parallel dispatch through the device communicator (identity
        in the base communicator)."""
        if self.device_communicator is None:
            return hidden_states, router_logits
        return self.device_communicator.dispatch(hidden_states, router_logits)

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False) -> torch.Tensor:
        """Expert-parallel combine (identity in the base communicator)."""
        if self.device_communicator is None:
            return hidden_states
        return self.device_communicator.combine(hidden_states)

    # -- lifecycle ---------------------------------------------------------------------------

    def set_timeout(self, timeout: timedelta) -> None:
        """Make ``timeout`` the group's timeout (``dist.set_timeout``): every
        communicator and the cpu_group use it for the ops that start from now
        on; an op already waiting keeps the timeout it started with."""
        self.timeout = timeout
        if self.cpu_group is not None:
            self.cpu_group.set_timeout(timeout)
        for comm in self._all_communicators():
            comm.set_timeout(timeout)

    def abort(self) -> None:
        """Make every wait of this process on the group fail now (other
        threads blocked in a collective or send/recv raise), then destroy."""
        for comm in self._all_communicators():
            comm.abort()
        self.destroy()

    def _all_communicators(self) -> list[DeviceCommunicatorBase]:
        """Every communicator built so far, the CPU point-to-point one included, once each."""
        with self._lock:
            communicators = list(self._communicators.values())
        if self._p2p_cpu is not None and self._p2p_cpu not in communicators:
            communicators.append(self._p2p_cpu)
        return communicators

    def destroy(self) -> None:
        """Release the message queue, every communicator, the op queue and,
        for a coordinator that formed its own groups, those groups."""
        if self._destroyed:
            return
        self._destroyed = True
        custom_ops.withdraw(self.unique_name, self.ops)
        self.ops.close()
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.close()
            self.mq_broadcaster = None
        with self._lock:
            communicators = list(self._communicators.values())
            self._communicators.clear()
        for comm in communicators:
            comm.destroy()
        self._p2p_cpu = None
        if self._owns_groups:
            for group in (self.device_group, self.cpu_group):
                if group is not None and dist.is_initialized():
                    dist.destroy_process_group(group)
        self.device_group = None
        self.cpu_group = None


def _shrunk_group_name(global_ranks: list[int]) -> str:
    """The name ``dist.shrink_group`` is about to give the survivors' group
    (torch's own hash of their ranks; any unique name would do, the frontend
    re-keys the coordinator when torch names the group)."""
    name_for = getattr(dist.distributed_c10d, "_hash_ranks_to_str", None)
    return name_for(global_ranks) if name_for is not None else "shrunk_" + "_".join(map(str, global_ranks))


def _group_timeout() -> timedelta:
    """The default group's timeout (torch's default when it cannot be read)."""
    default = dist.distributed_c10d._get_default_group()
    try:
        return get_coordinator(default).timeout
    except ValueError:
        pass
    try:
        timeout = default._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - torch's private option objects may change shape
        timeout = None
    return timeout if isinstance(timeout, timedelta) else dist.default_pg_timeout
