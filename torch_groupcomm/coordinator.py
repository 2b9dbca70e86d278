"""GroupCoordinator: one per group; decides which communicator carries each call.

It owns the group's ``cpu_group`` (a gloo backend over the same ranks, on its
own prefix of the group's store) used for barriers and metadata, and one device
communicator per device type, created by the first collective on that device
(so every rank creates it at the same point of the op sequence).

CPU routing: ranks on one host use shared memory; a group spanning hosts uses
shared memory inside each host and gloo between hosts; ``GROUPCOMM_CPU_COMMUNICATOR``
can force ``gloo`` or ``shm``. Point-to-point traffic always goes over the
cpu_group: it is not ordered with collectives, so it cannot create anything.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Dict, List, Optional

import torch
from torch._C import _distributed_c10d as c10d

from . import config as config_module
from .communicators import shm
from .communicators.base import DeviceCommunicatorBase
from .communicators.gloo import GlooCommunicator
from .communicators.hierarchical import HierarchicalCommunicator
from .topology import Topology, discover, host_identity

CPU_GROUP_PREFIX = "groupcomm/cpu_group/"


class GroupCoordinator:
    """The routing brain of one process group."""

    @classmethod
    def from_cpu_group(
        cls,
        cpu_group,
        store: c10d.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        group_name: str,
        global_ranks: Optional[List[int]] = None,
    ) -> "GroupCoordinator":
        """A coordinator over an existing gloo ``cpu_group`` (a c10d backend or
        ProcessGroup) whose ``store`` is private to the group."""
        self = cls.__new__(cls)
        self._setup(cpu_group, store, rank, world_size, timeout, group_name, global_ranks)
        return self

    def _setup(self, cpu_group, store, rank, world_size, timeout, group_name, global_ranks) -> None:
        self.cpu_group = cpu_group
        self.store = store
        self.config = config_module.load()
        self.topology: Optional[Topology] = None
        self.rank_in_group = rank
        self.world_size = world_size
        self.timeout = timeout
        self.unique_name = group_name
        self.ranks = list(global_ranks) if global_ranks else list(range(world_size))
        self._communicators: Dict[str, DeviceCommunicatorBase] = {}
        self._p2p_cpu: Optional[DeviceCommunicatorBase] = None
        self._lock = threading.Lock()
        self._destroyed = False

    @classmethod
    def for_c10d(
        cls,
        store: c10d.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        group_name: str,
        global_ranks: Optional[List[int]] = None,
    ) -> "GroupCoordinator":
        """Build the coordinator of a c10d process group from its factory arguments."""
        cpu_group = c10d.ProcessGroupGloo(
            c10d.PrefixStore(CPU_GROUP_PREFIX, store), rank, world_size, timeout
        )
        return cls.from_cpu_group(cpu_group, store, rank, world_size, timeout, group_name, global_ranks)

    def communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator that carries tensors living on ``device``."""
        comm = self._communicators.get(device.type)
        if comm is not None:
            return comm
        if self._destroyed:
            raise RuntimeError(f"groupcomm: group {self.unique_name} has been destroyed")
        with self._lock:
            comm = self._communicators.get(device.type)
            if comm is None:
                comm = self._make_communicator(device)
                self._communicators[device.type] = comm
        return comm

    def prepare_cpu(self) -> None:
        """Build the CPU communicator now (collective over the group), so that
        send/recv, which are not ordered with collectives, can use it too."""
        self._p2p_cpu = self.communicator_for(torch.device("cpu"))

    def p2p_communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator for send/recv. Every rank must pick the same one
        whatever it has run so far: the CPU communicator if it was prepared
        when the group was made, otherwise gloo over the cpu_group."""
        if device.type == "cpu":
            if self._p2p_cpu is None:
                self._p2p_cpu = self._gloo()
            return self._p2p_cpu
        return self.communicator_for(device)

    def _gloo(self) -> GlooCommunicator:
        return GlooCommunicator(self.cpu_group, unique_name=self.unique_name, timeout=self.timeout)

    def check_device(self, device: torch.device) -> None:
        """Raise NotImplementedError for a device type no communicator serves."""
        if device.type != "cpu":
            raise NotImplementedError(
                f"groupcomm: tensors on device type {device.type!r} are not supported yet (CPU only)"
            )

    def _make_communicator(self, device: torch.device) -> DeviceCommunicatorBase:
        self.check_device(device)
        return self._make_cpu_communicator()

    def _make_cpu_communicator(self) -> DeviceCommunicatorBase:
        cfg = self.config
        if cfg.cpu_communicator == "gloo":
            return self._gloo()
        self.topology = discover(self.store, self.rank_in_group, self.world_size, host_identity(cfg.host_id))
        if self.topology.single_host or cfg.cpu_communicator == "shm":
            return self._shm(self.cpu_group, "groupcomm/shm") or self._gloo()
        return self._hierarchical(self.topology)

    def _shm(self, cpu_group, key: str) -> Optional[DeviceCommunicatorBase]:
        cfg = self.config
        spin_us, yield_us = config_module.wait_policy(cfg, cpu_group.size())
        return shm.create(
            cpu_group, self.store, cfg.shm_chunk_bytes, spin_us, yield_us, self.timeout, self.unique_name, key
        )

    def _hierarchical(self, topo: Topology) -> DeviceCommunicatorBase:
        host = topo.host_index
        local_group = c10d.ProcessGroupGloo(
            c10d.PrefixStore(f"groupcomm/host{host}/", self.store), topo.local_rank, len(topo.local_ranks), self.timeout
        )
        local = self._shm(local_group, f"groupcomm/shm/host{host}") or GlooCommunicator(
            local_group, unique_name=self.unique_name, timeout=self.timeout
        )
        leaders = None
        if topo.local_rank == 0:
            leader_group = c10d.ProcessGroupGloo(
                c10d.PrefixStore("groupcomm/leaders/", self.store), host, len(topo.hosts), self.timeout
            )
            leaders = GlooCommunicator(leader_group, unique_name=self.unique_name, timeout=self.timeout)
        return HierarchicalCommunicator(
            self.cpu_group, topo, local, leaders, timeout=self.timeout, unique_name=self.unique_name
        )

    def barrier(self) -> None:
        """Synchronise the group's ranks on the cpu_group (never on a device)."""
        opts = c10d.BarrierOptions()
        opts.timeout = self.timeout
        self.cpu_group.barrier(opts).wait()

    def destroy(self) -> None:
        """Release every communicator and the cpu_group."""
        if self._destroyed:
            return
        self._destroyed = True
        with self._lock:
            communicators = list(self._communicators.values())
            self._communicators.clear()
        for comm in communicators:
            comm.destroy()
        self._p2p_cpu = None
        self.cpu_group = None
