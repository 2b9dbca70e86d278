"""``groupcomm`` as a torch.distributed backend: registration and the
creator c10d calls for every group.

Kept free of heavy imports: on torch < 2.14 it runs during ``import torch``
(backend autoload), so the coordinator, the communicators and the C++
extension load only when a group is created.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .. import _registry
from .._registry import BACKEND_NAME

DEVICES = ["cpu", "cuda"]


def register_backend() -> None:
    """Make ``"groupcomm"`` a torch.distributed backend for CPU and CUDA (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES)


def _create_backend(options, backend_options=None):
    """c10d's creator hook: one coordinator per group, one bridge per call."""
    from .._native import _C
    from ..coordinator import GroupCoordinator

    name = options.group_id
    # enable_reconfigure (torch 2.14.1+): the group is formed by dist._reconfigure, not now
    formed = not getattr(options, "enable_reconfigure", False)
    coordinator = _registry.coordinator_for(
        name,
        lambda: GroupCoordinator.for_c10d(
            store=options.store,
            rank=options.group_rank,
            world_size=options.group_size,
            timeout=options.timeout,
            group_name=name,
            global_ranks=list(options.global_ranks_in_group),
            formed=formed,
        ),
    )
    pg, serves_cpu = _group_being_built(options)
    if pg is not None and pg._get_backend_name() == "undefined":
        # torch sets a group's default backend before calling the creator and,
        # for "cpu:groupcomm" style strings, compares plugin names in the wrong
        # case, so the default stays UNDEFINED.
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    if serves_cpu and formed:
        coordinator.prepare_cpu()
    return _C.GroupCommBackend(options.group_rank, options.group_size, _frontend(coordinator))


def _frontend(coordinator):
    """The frontend the bridge calls: the checking one under ``GROUPCOMM_DEBUG``."""
    if coordinator.config.debug and coordinator.world_size > 1:
        from .debug_check import CheckedFrontend

        return CheckedFrontend(coordinator)
    from .frontend import C10dFrontend

    return C10dFrontend(coordinator)


def _group_being_built(options) -> tuple[dist.ProcessGroup | None, bool]:
    """The ProcessGroup c10d is building, and whether groupcomm will serve its
    CPU tensors (then send/recv on the CPU can use the group's CPU
    communicator, which must be built now, with the group).

    torch >= 2.14 hands the group to the creator. c10d creates the backends
    of a group device by device, in the order of the backend string, and asks
    the creator once when every device has the same backend: groupcomm serves
    the CPU unless a backend came before it for the CPU. (A string that names
    groupcomm for another device before the CPU's own backend,
    ``"cuda:groupcomm,cpu:gloo"``, prepares a CPU communicator that is never
    used: memory, not correctness.)
    """
    pg = getattr(options, "process_group", None)
    if pg is not None:
        return pg, torch.device("cpu") not in pg._device_types
    return _group_being_built_before_2_14()


def _group_being_built_before_2_14() -> tuple[dist.ProcessGroup | None, bool]:
    """torch 2.11 to 2.13 pass no group to the creator: read it and the
    device -> backend map from the frame of ``_new_process_group_helper``
    (None and False if torch changed shape). Goes when 2.13 support does."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_new_process_group_helper":
        frame = frame.f_back
    if frame is None:
        return None, False
    config = frame.f_locals.get("backend_config")
    try:
        device_backends: dict[str, str] = dict(config.get_device_backend_map()) if config is not None else {}
    except Exception:  # noqa: BLE001 - only an optimisation depends on it
        device_backends = {}
    pg = frame.f_locals.get("pg")
    return (pg if isinstance(pg, dist.ProcessGroup) else None), device_backends.get("cpu") == BACKEND_NAME
