"""Which GroupCoordinator serves which process group: the package's only
module state, keyed by the group's name.

A leaf: it imports nothing of the package, so every layer can reach it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch.distributed as dist

BACKEND_NAME = "groupcomm"

_lock = threading.Lock()
_coordinators: dict[str, Any] = {}  # group name -> GroupCoordinator


def get_coordinator(group: dist.ProcessGroup | None = None) -> Any:
    """Return the GroupCoordinator behind a ``groupcomm`` process group
    (the default group when ``group`` is None)."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    name = group.group_name
    with _lock:
        coordinator = _coordinators.get(name)
    if coordinator is None:
        raise ValueError(f"groupcomm: process group {name!r} is not served by the groupcomm backend")
    return coordinator


def coordinator_for(name: str, build: Callable[[], Any]) -> Any:
    """The coordinator of group ``name``, built by ``build()`` the first time
    (c10d asks once per device type that a group gives to groupcomm)."""
    with _lock:
        coordinator = _coordinators.get(name)
    if coordinator is None:
        coordinator = build()
        with _lock:
            coordinator = _coordinators.setdefault(name, coordinator)
    return coordinator


def rename(coordinator: Any, group_name: str) -> None:
    """Find ``coordinator`` under ``group_name`` (torch named its group) instead
    of the name it was built under."""
    with _lock:
        if _coordinators.get(coordinator.unique_name) is coordinator:
            del _coordinators[coordinator.unique_name]
        _coordinators[group_name] = coordinator
    coordinator.unique_name = group_name


def forget(group_name: str) -> None:
    """Drop a destroyed group's coordinator from the map."""
    with _lock:
        _coordinators.pop(group_name, None)
