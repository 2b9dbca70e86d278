"""Registration of ``groupcomm`` with torch.distributed and the map from a
process group's name to its coordinator (the package's only module state).

Kept free of heavy imports: it runs during ``import torch`` (backend autoload),
so the coordinator, the communicators and the C++ extension load only when a
group is created.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Dict, Optional

import torch.distributed as dist

if TYPE_CHECKING:
    from .coordinator import GroupCoordinator

BACKEND_NAME = "groupcomm"
DEVICES = ["cpu", "cuda"]

_lock = threading.Lock()
_coordinators: Dict[str, "GroupCoordinator"] = {}


def register_backend() -> None:
    """Make ``"groupcomm"`` a torch.distributed backend for CPU and CUDA (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES
    )


def get_coordinator(group: Optional[dist.ProcessGroup] = None) -> "GroupCoordinator":
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


def forget(group_name: str) -> None:
    """Drop a destroyed group's coordinator from the map."""
    with _lock:
        _coordinators.pop(group_name, None)


def _create_backend(options, backend_options=None):
    """c10d's creator hook: one coordinator per group, one bridge per call."""
    from ._native import _C
    from .c10d_frontend import C10dFrontend
    from .coordinator import GroupCoordinator

    name = options.group_id
    with _lock:
        coordinator = _coordinators.get(name)
    if coordinator is None:
        coordinator = GroupCoordinator.for_c10d(
            store=options.store,
            rank=options.group_rank,
            world_size=options.group_size,
            timeout=options.timeout,
            group_name=name,
            global_ranks=list(options.global_ranks_in_group),
        )
        with _lock:
            _coordinators[name] = coordinator
    pg, device_backends = _group_being_built()
    if isinstance(pg, dist.ProcessGroup) and pg._get_backend_name() == "undefined":
        # torch sets a group's default backend before calling the creator and,
        # for "cpu:groupcomm" style strings, compares plugin names in the wrong
        # case, so the default stays UNDEFINED.
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    if device_backends.get("cpu") == BACKEND_NAME:
        coordinator.prepare_cpu()
    return _C.GroupCommBackend(options.group_rank, options.group_size, C10dFrontend(coordinator))


def _group_being_built():
    """The ``pg`` and device->backend map of torch's ``_new_process_group_helper``
    frame that called the creator (None and {} if torch changed shape)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_new_process_group_helper":
        frame = frame.f_back
    if frame is None:
        return None, {}
    config = frame.f_locals.get("backend_config")
    try:
        device_backends = dict(config.get_device_backend_map()) if config is not None else {}
    except Exception:  # noqa: BLE001 - only an optimisation depends on it
        device_backends = {}
    return frame.f_locals.get("pg"), device_backends
