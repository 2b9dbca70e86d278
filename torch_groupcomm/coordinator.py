"""GroupCoordinator: one per group; decides which communicator carries each call.

It owns the group's ``cpu_group`` (a gloo backend over the same ranks, on its
own prefix of the group's store) used for barriers and metadata, and one device
communicator per device type, created on first use.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Dict, List, Optional

import torch
from torch._C import _distributed_c10d as c10d

from .communicators.base import DeviceCommunicatorBase
from .communicators.gloo import GlooCommunicator

CPU_GROUP_PREFIX = "groupcomm/cpu_group/"


class GroupCoordinator:
    """The routing brain of one process group."""

    def __init__(
        self,
        cpu_group,
        rank: int,
        world_size: int,
        timeout: timedelta,
        group_name: str,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        self.cpu_group = cpu_group
        self.rank_in_group = rank
        self.world_size = world_size
        self.timeout = timeout
        self.unique_name = group_name
        self.ranks = list(global_ranks) if global_ranks else list(range(world_size))
        self._communicators: Dict[str, DeviceCommunicatorBase] = {}
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
        return cls(cpu_group, rank, world_size, timeout, group_name, global_ranks)

    def communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator that carries tensors living on ``device``."""
        if self._destroyed:
            raise RuntimeError(f"groupcomm: group {self.unique_name} has been destroyed")
        kind = device.type
        with self._lock:
            comm = self._communicators.get(kind)
            if comm is None:
                comm = self._make_communicator(device)
                self._communicators[kind] = comm
        return comm

    def _make_communicator(self, device: torch.device) -> DeviceCommunicatorBase:
        if device.type == "cpu":
            return GlooCommunicator(
                self.cpu_group, device=device, unique_name=self.unique_name, timeout=self.timeout
            )
        raise NotImplementedError(
            f"groupcomm: tensors on device type {device.type!r} are not supported yet (CPU only)"
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
        self.cpu_group = None
