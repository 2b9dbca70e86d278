"""Which GroupCoordinator serves which process group: the package's only
module state, keyed by the group's name. Besides the c10d groups' map, a weak
one finds every live coordinator by its unique name (the custom ops name
their group so).

A leaf: it imports nothing of the package, so every layer can reach it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch.distributed as dist

BACKEND_NAME = "groupcomm"

_lock = threading.Lock()
_coordinators: dict[str, Any] = {}  # group name -> GroupCoordinator
_named: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # unique name -> coordinator


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
    coordinator.rename(group_name)


def name(coordinator: Any, unique_name: str, old: str | None = None) -> None:
    """``coordinator`` goes by ``unique_name`` (instead of ``old``) for
    ``coordinator_named``, while it lives."""
    with _lock:
        if old is not None and _named.get(old) is coordinator:
            del _named[old]
        _named[unique_name] = coordinator


def coordinator_named(unique_name: str) -> Any:
    """The live coordinator whose unique name is ``unique_name``."""
    with _lock:
        coordinator = _named.get(unique_name)
    if coordinator is None:
        raise ValueError(f"groupcomm: no live GroupCoordinator is named {unique_name!r} in this process")
    return coordinator


def forget(group_name: str) -> None:
    """Drop a destroyed group's coordinator from the map."""
    with _lock:
        _coordinators.pop(group_name, None)
