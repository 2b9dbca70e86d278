"""GroupCoordinator: one per group; decides which communicator carries each
call (``routing.py``) and offers vLLM's coordinator API on top.

It owns the group's ``cpu_group`` (a gloo group over the same ranks, on its own
prefix of the group's store) used for barriers and metadata, and one device
communicator per device type, created by the first collective on that device
(so every rank creates it at the same point of the op sequence). Here: how a
coordinator is formed (over ranks of the default group, a c10d group, a
split or shrunk group) and how it ends.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .. import config as config_module
from .. import custom_ops
from .._native import _C
from .._registry import coordinator_for, get_coordinator, name
from ..communicators.base import DeviceCommunicatorBase
from ..topology import Topology
from .collectives import Collectives
from .model_hooks import ModelHooks
from .object_exchange import ObjectExchange
from .ranks import RankOrder
from .routing import Routing

CPU_GROUP_PREFIX = "groupcomm/cpu_group/"


_anonymous = itertools.count()


class GroupCoordinator(Routing, RankOrder, Collectives, ModelHooks, ObjectExchange):
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

    def rename(self, unique_name: str) -> None:
        """Go by ``unique_name`` from now on (torch named the group), for the
        custom ops as well."""
        old, self.unique_name = self.unique_name, unique_name
        name(self, unique_name, old)
        cpu = self.built_communicator("cpu")
        if cpu is not None:
            custom_ops.withdraw(old, self.ops)
            custom_ops.publish(unique_name, cpu.native_engine(), self.ops)

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
