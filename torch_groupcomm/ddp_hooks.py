"""A DDP communication hook that lets ``groupcomm`` read gradient buckets in place.

DDP allocates its gradient buckets itself, so a backend cannot place them in
memory its peers can read, the way FSDP2's
``set_allocate_memory_from_process_group_for_comm`` lets it place FSDP2's
buffers. A comm hook sees each bucket's buffer, owned by DDP's reducer: this
one moves the buffer into the group's shared memory the first time it sees it
(``GroupCoordinator.share_storage``) and averages it with an all-reduce that
the peers read in place, with no copy into the shared segment.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._registry import get_coordinator

__all__ = ["shared_allreduce_hook"]


def _first(future: torch.futures.Future) -> torch.Tensor:
    return future.value()[0]


def _served_by_groupcomm(group: dist.ProcessGroup, device: torch.device) -> bool:
    from ._native import _C

    try:
        return isinstance(group._get_backend(device), _C.GroupCommBackend)
    except RuntimeError:  # no backend for that device
        return False


def shared_allreduce_hook(process_group: dist.ProcessGroup | None, bucket):  # unannotated: DDP checks the annotation
    """Average ``bucket`` across ``process_group`` (the default group when
    None) like torch's ``allreduce_hook``; on a ``groupcomm`` group with shared
    memory, from a buffer the peers read in place.

    Register it with ``ddp_model.register_comm_hook(process_group,
    shared_allreduce_hook)``. DDP's reducer owns the buffer, and with
    ``gradient_as_bucket_view=True`` the gradients are its views; both follow
    the move. Where gloo or another backend carries the bucket it is torch's
    ``allreduce_hook``: divide, then sum.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if _served_by_groupcomm(group, buffer.device):
        # Every rank averages alike whether or not its own buffer could move:
        # the kernel mixes ranks in blocks and ranks without.
        get_coordinator(group).share_storage(buffer)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True)
    else:
        buffer.div_(group.size())
        work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(_first)
