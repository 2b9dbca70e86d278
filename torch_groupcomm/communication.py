"""A Bagua-style functional communication API over torch.distributed.

Code written against ``bagua.torch_api.communication`` runs here with the same
names and signatures::

    from torch_groupcomm import communication as comm

    comm.init_process_group()                      # torchrun's env vars, "groupcomm" backend
    comm.allreduce_inplace(grad, op=comm.ReduceOp.AVG, hierarchical=True)
    comm.broadcast(weights, src=0)

Every function is a thin, checked layer over a ``torch.distributed`` call on
the communicator's torch process group, so it runs on whatever backend that
group has (``groupcomm`` for groups made here, gloo for a wrapped gloo group).
What this module adds over plain torch.distributed:

* Bagua's buffer conventions: flat send/recv buffers of any shape, in-place
  variants, per-peer counts and displacements (:func:`alltoall_v`); every size
  precondition is checked before any communication, on the calling rank, with
  a ``ValueError`` (``TypeError`` for dtypes) naming the function and argument.
* Communicators (:class:`Communicator`): a process group seen as a whole
  (global), per host (intra-node) and across host leaders (inter-node), which
  make a hierarchical all-reduce possible on any backend.
* Bagua's :class:`ReduceOp` numbering (which differs from c10d's).

Ranks passed as ``src``/``dst`` are ranks within the communicator.
``comm=None`` means the global communicator of the default process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import staging
from .bagua.arguments import (
    OpLike,
    ReduceOp,
    check_comm_peer,
    check_comm_rank,
    check_counts,
    check_divisible,
    check_numel,
    check_pair,
    check_tensor,
    op_for,
    packed,
    to_torch_op,
)
from .bagua.groups import (
    BaguaProcessGroup,
    Communicator,
    from_torch_group,
    get_default_group,
    init_process_group,
    is_initialized,
    new_group,
    resolve,
)
from .reduction import Kind, divide_

__all__ = [
    "BaguaProcessGroup",
    "Communicator",
    "ReduceOp",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "barrier",
    "broadcast",
    "broadcast_object",
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_default_group",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
    "to_torch_op",
]


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- all-reduce -----------------------------------------------------------------


def _allreduce_flat(fn: str, flat: torch.Tensor, op: OpLike, comm: Communicator, hierarchical: bool) -> None:
    kind, torch_op = op_for(fn, op, flat.dtype)
    owner = comm._owner
    if owner is None and comm._default and hierarchical:
        owner = get_default_group()
    if owner is not None and (hierarchical or owner.hierarchical):
        # One host, or one rank per host: the flat all-reduce is already that.
        if 1 < len(owner.hosts) < len(owner.ranks):
            _hierarchical_allreduce(flat, kind, torch_op, owner)
            return
    _plain_allreduce(flat, kind, torch_op, comm)


def _plain_allreduce(flat: torch.Tensor, kind: Kind, torch_op: Any, comm: Communicator) -> None:
    if kind == Kind.AVG and not comm._native_avg(flat.device):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=comm.group)
        divide_(flat, comm.nranks())
        return
    dist.all_reduce(flat, op=torch_op, group=comm.group)


def _hierarchical_allreduce(flat: torch.Tensor, kind: Kind, torch_op: Any, owner: BaguaProcessGroup) -> None:
    """Reduce to each host's leader, all-reduce among leaders, broadcast on
    each host. AVG runs as SUM and is divided by the group size once."""
    stage_op = dist.ReduceOp.SUM if kind == Kind.AVG else torch_op
    intra = owner.get_intra_node_communicator()
    inter = owner.get_inter_node_communicator()
    if intra.nranks() > 1:
        dist.reduce(flat, group_dst=0, op=stage_op, group=intra.group)
    if inter is not None:
        if inter.nranks() > 1:
            dist.all_reduce(flat, op=stage_op, group=inter.group)
        if kind == Kind.AVG:
            divide_(flat, len(owner.ranks))
    if intra.nranks() > 1:
        dist.broadcast(flat, group_src=0, group=intra.group)


def allreduce(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    op: OpLike = ReduceOp.SUM,
    comm: Communicator | None = None,
    hierarchical: bool = False,
) -> None:
    """Reduce ``send_tensor`` over the communicator into every rank's
    ``recv_tensor`` (same number of elements, same dtype).

    ``hierarchical=True`` (or a group made with ``hierarchical=True``) on a
    group's global communicator reduces inside each host, then among host
    leaders, then broadcasts inside each host; the result equals the flat one
    (bitwise for integers). AVG divides by the whole communicator's size.
    """
    comm = resolve(comm)
    check_pair("allreduce", send_tensor, recv_tensor)
    check_numel("allreduce", "recv_tensor", recv_tensor, send_tensor.numel(), "send_tensor.numel()")
    op_for("allreduce", op, send_tensor.dtype)
    out = staging.Staged(recv_tensor, load=False)
    out.flat.copy_(send_tensor.reshape(-1))
    _allreduce_flat("allreduce", out.flat, op, comm, hierarchical)
    out.commit()


def allreduce_inplace(
    tensor: torch.Tensor, op: OpLike = ReduceOp.SUM, comm: Communicator | None = None, hierarchical: bool = False
) -> None:
    """The in-place :func:`allreduce`: ``tensor`` is input and output."""
    comm = resolve(comm)
    check_tensor("allreduce_inplace", "tensor", tensor)
    op_for("allreduce_inplace", op, tensor.dtype)
    out = staging.Staged(tensor, load=True)
    _allreduce_flat("allreduce_inplace", out.flat, op, comm, hierarchical)
    out.commit()


# -- data movement --------------------------------------------------------------


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Communicator | None = None) -> None:
    """Concatenate every rank's ``send_tensor`` (in rank order) into
    ``recv_tensor``, which holds ``nranks * send_tensor.numel()`` elements."""
    comm = resolve(comm)
    check_pair("allgather", send_tensor, recv_tensor)
    n = comm.nranks()
    check_numel(
        "allgather",
        "recv_tensor",
        recv_tensor,
        n * send_tensor.numel(),
        f"nranks * send_tensor.numel() = {n} * {send_tensor.numel()}",
    )
    out = staging.Staged(recv_tensor, load=False)
    _all_gather_single(out.flat, staging.flat(send_tensor), group=comm.group)
    out.commit()


def allgather_inplace(tensor: torch.Tensor, comm: Communicator | None = None) -> None:
    """The in-place :func:`allgather`: ``tensor`` holds ``nranks * count``
    elements and this rank's slice ``[rank * count, (rank + 1) * count)`` is
    its input."""
    comm = resolve(comm)
    check_tensor("allgather_inplace", "tensor", tensor)
    n, rank = comm.nranks(), comm.rank()
    check_divisible("allgather_inplace", "tensor", tensor, n)
    count = tensor.numel() // n
    out = staging.Staged(tensor, load=True)
    mine = out.flat[rank * count : (rank + 1) * count].clone()
    _all_gather_single(out.flat, mine, group=comm.group)
    out.commit()


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Communicator | None = None) -> None:
    """Split ``send_tensor`` into ``nranks`` equal chunks, send chunk ``i`` to
    rank ``i``, and place the chunk from rank ``i`` at chunk ``i`` of
    ``recv_tensor`` (same number of elements, divisible by ``nranks``)."""
    comm = resolve(comm)
    check_pair("alltoall", send_tensor, recv_tensor)
    n = comm.nranks()
    check_divisible("alltoall", "send_tensor", send_tensor, n)
    check_numel("alltoall", "recv_tensor", recv_tensor, send_tensor.numel(), "send_tensor.numel()")
    out = staging.Staged(recv_tensor, load=False)
    dist.all_to_all_single(out.flat, staging.flat(send_tensor), group=comm.group)
    out.commit()


def alltoall_inplace(tensor: torch.Tensor, comm: Communicator | None = None) -> None:
    """The in-place :func:`alltoall`."""
    comm = resolve(comm)
    check_tensor("alltoall_inplace", "tensor", tensor)
    n = comm.nranks()
    check_divisible("alltoall_inplace", "tensor", tensor, n)
    out = staging.Staged(tensor, load=True)
    dist.all_to_all_single(out.flat, out.flat.clone(), group=comm.group)
    out.commit()


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: Sequence[int],
    send_displs: Sequence[int],
    recv_tensor: torch.Tensor,
    recv_counts: Sequence[int],
    recv_displs: Sequence[int],
    comm: Communicator | None = None,
) -> None:
    """All-to-all with per-peer sizes: send ``send_counts[i]`` elements from
    offset ``send_displs[i]`` of ``send_tensor`` to rank ``i``, and receive
    ``recv_counts[i]`` elements from rank ``i`` at offset ``recv_displs[i]``
    of ``recv_tensor`` (counts and offsets in elements). ``recv_counts[i]``
    here must equal ``send_counts[rank]`` on rank ``i``."""
    comm = resolve(comm)
    fn = "alltoall_v"
    check_pair(fn, send_tensor, recv_tensor)
    n = comm.nranks()
    send_counts, send_displs = check_counts(fn, "send", send_counts, send_displs, send_tensor, n)
    recv_counts, recv_displs = check_counts(fn, "recv", recv_counts, recv_displs, recv_tensor, n)
    flat_in = staging.flat(send_tensor)
    if not packed(send_counts, send_displs):
        flat_in = torch.cat([flat_in[d : d + c] for c, d in zip(send_counts, send_displs)])
    else:
        flat_in = flat_in[: sum(send_counts)]
    out = staging.Staged(recv_tensor, load=True)
    total = sum(recv_counts)
    direct = packed(recv_counts, recv_displs)
    target = out.flat[:total] if direct else torch.empty(total, dtype=recv_tensor.dtype, device=recv_tensor.device)
    dist.all_to_all_single(target, flat_in, recv_counts, send_counts, group=comm.group)
    if not direct:
        for piece, c, d in zip(target.split(recv_counts), recv_counts, recv_displs):
            out.flat[d : d + c].copy_(piece)
    out.commit()


def barrier(comm: Communicator | None = None) -> None:
    """Block until every process of the communicator has entered it."""
    comm = resolve(comm)
    dist.barrier(group=comm.group)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Communicator | None = None) -> None:
    """Copy ``src``'s ``tensor`` into ``tensor`` on every rank (the same
    number of elements everywhere)."""
    comm = resolve(comm)
    check_tensor("broadcast", "tensor", tensor)
    check_comm_rank("broadcast", "src", src, comm)
    out = staging.Staged(tensor, load=comm.rank() == src)
    dist.broadcast(out.flat, group_src=src, group=comm.group)
    out.commit()


def broadcast_object(obj: Any, src: int = 0, comm: Communicator | None = None) -> Any:
    """Pickle ``obj`` on ``src`` and return it on every rank (e.g. an
    optimizer's ``state_dict()``); other ranks' ``obj`` is ignored."""
    comm = resolve(comm)
    check_comm_rank("broadcast_object", "src", src, comm)
    box = [obj if comm.rank() == src else None]
    dist.broadcast_object_list(box, group_src=src, group=comm.group)
    return box[0]


def gather(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor | None, dst: int, comm: Communicator | None = None
) -> None:
    """Concatenate every rank's ``send_tensor`` (in rank order) into ``dst``'s
    ``recv_tensor`` (``nranks * send_tensor.numel()`` elements); other ranks'
    ``recv_tensor`` is not used and may be ``None``."""
    comm = resolve(comm)
    check_comm_rank("gather", "dst", dst, comm)
    if comm.rank() != dst:
        check_tensor("gather", "send_tensor", send_tensor)
        dist.gather(staging.flat(send_tensor), None, group_dst=dst, group=comm.group)
        return
    check_pair("gather", send_tensor, recv_tensor)
    n, count = comm.nranks(), send_tensor.numel()
    check_numel("gather", "recv_tensor", recv_tensor, n * count, f"nranks * send_tensor.numel() = {n} * {count}")
    out = staging.Staged(recv_tensor, load=False)
    dist.gather(staging.flat(send_tensor), list(out.flat.view(n, count).unbind(0)), group_dst=dst, group=comm.group)
    out.commit()


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: Communicator | None = None) -> None:
    """The in-place :func:`gather`: on ``dst``, ``tensor`` holds
    ``nranks * count`` elements and its own slice is its input; elsewhere
    ``tensor`` holds ``count`` elements."""
    comm = resolve(comm)
    check_tensor("gather_inplace", "tensor", tensor)
    check_comm_rank("gather_inplace", "dst", dst, comm)
    n = comm.nranks()
    if comm.rank() != dst:
        check_numel("gather_inplace", "tensor", tensor, count, "count on a non-dst rank")
        dist.gather(staging.flat(tensor), None, group_dst=dst, group=comm.group)
        return
    check_numel("gather_inplace", "tensor", tensor, n * count, f"nranks * count = {n} * {count}")
    out = staging.Staged(tensor, load=True)
    mine = out.flat[dst * count : (dst + 1) * count].clone()
    dist.gather(mine, list(out.flat.view(n, count).unbind(0)), group_dst=dst, group=comm.group)
    out.commit()


def scatter(
    send_tensor: torch.Tensor | None, recv_tensor: torch.Tensor, src: int, comm: Communicator | None = None
) -> None:
    """Split ``src``'s ``send_tensor`` (``nranks * recv_tensor.numel()``
    elements) into ``nranks`` chunks; rank ``i`` receives chunk ``i`` in
    ``recv_tensor``. Other ranks' ``send_tensor`` is not used and may be ``None``."""
    comm = resolve(comm)
    check_tensor("scatter", "recv_tensor", recv_tensor)
    check_comm_rank("scatter", "src", src, comm)
    n, count = comm.nranks(), recv_tensor.numel()
    pieces = None
    if comm.rank() == src:
        check_pair("scatter", send_tensor, recv_tensor)
        check_numel("scatter", "send_tensor", send_tensor, n * count, f"nranks * recv_tensor.numel() = {n} * {count}")
        pieces = list(staging.flat(send_tensor).view(n, count).unbind(0))
    out = staging.Staged(recv_tensor, load=False)
    dist.scatter(out.flat, pieces, group_src=src, group=comm.group)
    out.commit()


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Communicator | None = None) -> None:
    """The in-place :func:`scatter`: on ``src``, ``tensor`` holds
    ``nranks * count`` elements (its own chunk stays in place); elsewhere it
    holds ``count`` elements and receives its chunk."""
    comm = resolve(comm)
    check_tensor("scatter_inplace", "tensor", tensor)
    check_comm_rank("scatter_inplace", "src", src, comm)
    n = comm.nranks()
    if comm.rank() != src:
        check_numel("scatter_inplace", "tensor", tensor, count, "count on a non-src rank")
        out = staging.Staged(tensor, load=False)
        dist.scatter(out.flat, None, group_src=src, group=comm.group)
        out.commit()
        return
    check_numel("scatter_inplace", "tensor", tensor, n * count, f"nranks * count = {n} * {count}")
    pieces = list(staging.flat(tensor).view(n, count).unbind(0))
    dist.scatter(torch.empty_like(pieces[src]), pieces, group_src=src, group=comm.group)


def _reduce_flat(fn: str, buf: torch.Tensor, dst: int, op: OpLike, comm: Communicator) -> None:
    """Reduce ``buf`` into ``dst``'s ``buf``; other ranks' ``buf`` may be clobbered."""
    kind, torch_op = op_for(fn, op, buf.dtype)
    if kind == Kind.AVG and not comm._native_avg(buf.device):
        dist.reduce(buf, group_dst=dst, op=dist.ReduceOp.SUM, group=comm.group)
        if comm.rank() == dst:
            divide_(buf, comm.nranks())
        return
    dist.reduce(buf, group_dst=dst, op=torch_op, group=comm.group)


def reduce(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor | None,
    dst: int,
    op: OpLike = ReduceOp.SUM,
    comm: Communicator | None = None,
) -> None:
    """Reduce every rank's ``send_tensor`` into ``dst``'s ``recv_tensor``
    (same number of elements); other ranks' ``recv_tensor`` is left as is
    (it may be ``None`` there)."""
    comm = resolve(comm)
    check_comm_rank("reduce", "dst", dst, comm)
    if recv_tensor is None and comm.rank() != dst:
        check_tensor("reduce", "send_tensor", send_tensor)
    else:
        check_pair("reduce", send_tensor, recv_tensor)
        check_numel("reduce", "recv_tensor", recv_tensor, send_tensor.numel(), "send_tensor.numel()")
    op_for("reduce", op, send_tensor.dtype)
    if comm.rank() != dst:
        _reduce_flat("reduce", send_tensor.reshape(-1).clone(), dst, op, comm)
        return
    out = staging.Staged(recv_tensor, load=False)
    out.flat.copy_(send_tensor.reshape(-1))
    _reduce_flat("reduce", out.flat, dst, op, comm)
    out.commit()


def reduce_inplace(tensor: torch.Tensor, dst: int, op: OpLike = ReduceOp.SUM, comm: Communicator | None = None) -> None:
    """The in-place :func:`reduce`: ``dst``'s ``tensor`` receives the result;
    other ranks' ``tensor`` is left as is."""
    comm = resolve(comm)
    check_tensor("reduce_inplace", "tensor", tensor)
    check_comm_rank("reduce_inplace", "dst", dst, comm)
    op_for("reduce_inplace", op, tensor.dtype)
    if comm.rank() != dst:
        _reduce_flat("reduce_inplace", tensor.reshape(-1).clone(), dst, op, comm)
        return
    out = staging.Staged(tensor, load=True)
    _reduce_flat("reduce_inplace", out.flat, dst, op, comm)
    out.commit()


def _reduce_scatter_flat(fn: str, out: torch.Tensor, inp: torch.Tensor, op: OpLike, comm: Communicator) -> None:
    kind, torch_op = op_for(fn, op, inp.dtype)
    if kind == Kind.AVG and not comm._native_avg(inp.device):
        _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=comm.group)
        divide_(out, comm.nranks())
        return
    _reduce_scatter_single(out, inp, op=torch_op, group=comm.group)


def reduce_scatter(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: OpLike = ReduceOp.SUM, comm: Communicator | None = None
) -> None:
    """Reduce every rank's ``send_tensor`` (``nranks * recv_tensor.numel()``
    elements) and give rank ``i`` chunk ``i`` of the result in ``recv_tensor``."""
    comm = resolve(comm)
    check_pair("reduce_scatter", send_tensor, recv_tensor)
    n, count = comm.nranks(), recv_tensor.numel()
    check_numel(
        "reduce_scatter", "send_tensor", send_tensor, n * count, f"nranks * recv_tensor.numel() = {n} * {count}"
    )
    op_for("reduce_scatter", op, send_tensor.dtype)
    out = staging.Staged(recv_tensor, load=False)
    _reduce_scatter_flat("reduce_scatter", out.flat, staging.flat(send_tensor), op, comm)
    out.commit()


def reduce_scatter_inplace(tensor: torch.Tensor, op: OpLike = ReduceOp.SUM, comm: Communicator | None = None) -> None:
    """The in-place :func:`reduce_scatter`: ``tensor`` (size divisible by
    ``nranks``) is the input; this rank's chunk ``[rank * count, (rank + 1) *
    count)`` receives its result, the other chunks are left as they were."""
    comm = resolve(comm)
    check_tensor("reduce_scatter_inplace", "tensor", tensor)
    n, rank = comm.nranks(), comm.rank()
    check_divisible("reduce_scatter_inplace", "tensor", tensor, n)
    op_for("reduce_scatter_inplace", op, tensor.dtype)
    count = tensor.numel() // n
    out = staging.Staged(tensor, load=True)
    _reduce_scatter_flat(
        "reduce_scatter_inplace", out.flat[rank * count : (rank + 1) * count], out.flat.clone(), op, comm
    )
    out.commit()


# -- point to point -------------------------------------------------------------


def send(tensor: torch.Tensor, dst: int, comm: Communicator | None = None) -> None:
    """Send ``tensor`` to ``dst``, returning when it has been handed over."""
    comm = resolve(comm)
    check_tensor("send", "tensor", tensor)
    check_comm_peer("send", "dst", dst, comm)
    dist.send(staging.flat(tensor), group_dst=dst, group=comm.group)


def recv(tensor: torch.Tensor, src: int, comm: Communicator | None = None) -> None:
    """Receive into ``tensor`` what ``src`` sends (the same number of elements)."""
    comm = resolve(comm)
    check_tensor("recv", "tensor", tensor)
    check_comm_peer("recv", "src", src, comm)
    out = staging.Staged(tensor, load=False)
    dist.recv(out.flat, group_src=src, group=comm.group)
    out.commit()
