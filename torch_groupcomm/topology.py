"""Which ranks of a group share a host, learned through the group's store."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch._C import _distributed_c10d as c10d

from .stores import get_within


def host_identity(override: str | None = None) -> str:
    """This process's host: hostname plus boot id, or ``GROUPCOMM_HOST_ID``."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Topology:
    """The group's ranks grouped by host, hosts in order of their first rank."""

    rank: int
    hosts: list[list[int]]

    @property
    def single_host(self) -> bool:
        return len(self.hosts) == 1

    @property
    def host_index(self) -> int:
        return next(i for i, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_ranks(self) -> list[int]:
        return self.hosts[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def leaders(self) -> list[int]:
        return [ranks[0] for ranks in self.hosts]

    def host_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.hosts) if rank in ranks)


def group_by_host(names: Sequence[str], ranks: Sequence[int]) -> list[list[int]]:
    """``ranks`` grouped by their host ``names[rank]``, hosts in order of their first rank."""
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(names[r], []).append(r)
    return list(hosts.values())


def discover(store: c10d.Store, rank: int, world_size: int, identity: str, timeout: timedelta) -> Topology:
    """Exchange host identities; every rank gets the same answer, or
    DistStoreError after ``timeout`` (the group's, not the store's own)."""
    store.set(f"groupcomm/host/{rank}", identity)
    names = [v.decode() for v in get_within(store, [f"groupcomm/host/{r}" for r in range(world_size)], timeout)]
    return Topology(rank, group_by_host(names, range(world_size)))
