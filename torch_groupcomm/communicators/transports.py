"""The one place communicators are built: a table from transport name to a
builder, each taking the same :class:`Setting`.

The coordinator decides which transport serves a device (``coordinator/routing.py``);
this module only knows how to build each one. Building is collective over
the setting's ``cpu_group``: every rank of the group calls it at the same
point of the group's op sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
from torch._C import _distributed_c10d as c10d

from .. import config as config_module
from ..config import Config
from ..topology import Topology
from . import shm
from .base import DeviceCommunicatorBase
from .gloo import GlooCommunicator
from .hierarchical import HierarchicalCommunicator


@dataclass(frozen=True)
class Setting:
    """What any transport is built from."""

    cpu_group: object  # the gloo group (or c10d backend) over the ranks
    store: c10d.Store  # private to the group
    timeout: timedelta
    unique_name: str
    config: Config
    device: torch.device = torch.device("cpu")
    topology: Topology | None = None  # hosts of the ranks, for hierarchical
    key: str = "groupcomm/shm"  # store key of a shared-memory segment's name
    rank_names: Sequence[int] = ()  # what messages call the ranks (default: their rank)


def _gloo(setting: Setting) -> DeviceCommunicatorBase:
    return GlooCommunicator(
        setting.cpu_group, unique_name=setting.unique_name, timeout=setting.timeout, rank_names=setting.rank_names
    )


def _shm(setting: Setting) -> DeviceCommunicatorBase | None:
    """Shared memory, or None (with a warning) when a rank cannot map the segment."""
    group, cfg = setting.cpu_group, setting.config
    policy = config_module.wait_policy(cfg, group.size())
    return shm.create(
        group,
        setting.store,
        cfg.shm_chunk_bytes,
        policy,
        setting.timeout,
        setting.unique_name,
        setting.key,
        setting.rank_names,
        cfg.shm_direct,
    )


def _hierarchical(setting: Setting) -> DeviceCommunicatorBase:
    """Shared memory (else gloo) inside each host, gloo between one leader per
    host, and between the ranks of each local index (rails) on even layouts."""
    topo = setting.topology
    host = topo.host_index
    local_group = c10d.ProcessGroupGloo(
        c10d.PrefixStore(f"groupcomm/host{host}/", setting.store),
        topo.local_rank,
        len(topo.local_ranks),
        setting.timeout,
    )
    local_setting = replace(
        setting, cpu_group=local_group, key=f"groupcomm/shm/host{host}", rank_names=topo.local_ranks
    )
    local = _shm(local_setting) or _gloo(local_setting)
    leaders = None
    if topo.local_rank == 0:
        leader_group = c10d.ProcessGroupGloo(
            c10d.PrefixStore("groupcomm/leaders/", setting.store), host, len(topo.hosts), setting.timeout
        )
        leaders = _gloo(replace(setting, cpu_group=leader_group, rank_names=topo.leaders))
    # Rails, when every host has the same number of ranks: rail i joins the
    # ranks of local index i on every host. Rail 0 is the leaders' group.
    rail = None
    if len(topo.hosts) >= 2 and len({len(ranks) for ranks in topo.hosts}) == 1:
        if topo.local_rank == 0:
            rail = leaders
        else:
            rail_group = c10d.ProcessGroupGloo(
                c10d.PrefixStore(f"groupcomm/rail{topo.local_rank}/", setting.store),
                host,
                len(topo.hosts),
                setting.timeout,
            )
            rail = _gloo(replace(setting, cpu_group=rail_group, rank_names=[h[topo.local_rank] for h in topo.hosts]))
    return HierarchicalCommunicator(
        setting.cpu_group,
        topo,
        local,
        leaders,
        setting.store,
        timeout=setting.timeout,
        unique_name=setting.unique_name,
        rail=rail,
    )


def _nccl(setting: Setting) -> DeviceCommunicatorBase:
    from .cuda import CudaCommunicator

    return CudaCommunicator(setting.cpu_group, setting.device, setting.store, setting.unique_name, setting.timeout)


TRANSPORTS: dict[str, Callable[[Setting], DeviceCommunicatorBase | None]] = {
    "gloo": _gloo,
    "shm": _shm,
    "hierarchical": _hierarchical,
    "nccl": _nccl,
}


def build(transport: str, setting: Setting) -> DeviceCommunicatorBase | None:
    """The ``transport`` communicator for ``setting``; None when it cannot be
    made on this machine (shared memory unavailable: the caller falls back)."""
    return TRANSPORTS[transport](setting)
