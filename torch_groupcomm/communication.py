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

import enum
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import config, staging, topology
from ._registry import BACKEND_NAME
from .checks import check_peer, check_rank
from .reduction import Kind, Reduction, divide_

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


class ReduceOp(enum.IntEnum):
    """Bagua's reduction operations, with Bagua's values.

    The values are not c10d's (Bagua's AVG is 10, c10d's is 1), so members are
    matched by name wherever this package takes a reduce op: here, in
    :class:`torch_groupcomm.reduction.Reduction`, and through
    :func:`to_torch_op` for torch.distributed calls.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


#: What the functions take as ``op``: a ReduceOp, an int in Bagua's numbering, or a torch ReduceOp.
OpLike = Union[ReduceOp, int, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]


def to_torch_op(op: OpLike) -> "dist.ReduceOp.RedOpType":
    """The ``torch.distributed.ReduceOp`` equal to ``op``.

    ``op`` is a :class:`ReduceOp`, a plain int read with Bagua's numbering
    (as Bagua's IntEnum would), or a torch ``ReduceOp`` (returned as is).
    """
    return _parse_op("to_torch_op", op)[1]


def _parse_op(fn: str, op: OpLike) -> Tuple[Kind, Any]:
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        kind = Reduction.parse(op).kind
        return kind, op
    if type(op) is int:
        try:
            op = ReduceOp(op)
        except ValueError:
            raise ValueError(f"communication.{fn}: {op} is not a ReduceOp value") from None
    if not isinstance(op, ReduceOp):
        raise TypeError(f"communication.{fn}: op must be a communication.ReduceOp, got {op!r}")
    kind = Reduction.parse(op).kind
    return kind, getattr(dist.ReduceOp, kind.name)


def _op_for(fn: str, op: OpLike, dtype: torch.dtype) -> Tuple[Kind, Any]:
    """(kind, torch op), refusing pairs such as a bitwise op on floats up front."""
    kind, torch_op = _parse_op(fn, op)
    if kind == Kind.PREMUL_SUM:
        raise ValueError(f"communication.{fn}: PREMUL_SUM is not supported here")
    Reduction(kind).check(dtype, f"communication.{fn}")
    return kind, torch_op


class Communicator:
    """A handle on a torch process group, with Bagua's ``rank()``/``nranks()``.

    Obtain one from a :class:`BaguaProcessGroup`; pass it as ``comm=`` to the
    functions of this module. ``rank()`` is this process's rank within the
    communicator, ``nranks()`` its size, ``ranks`` the global ranks in it.
    """

    def __init__(self, group: dist.ProcessGroup, owner: Optional["BaguaProcessGroup"] = None,
                 default: bool = False) -> None:
        self._group = group
        self._owner = owner
        self._default = default
        self._rank = dist.get_rank(group)
        self._nranks = dist.get_world_size(group)
        self.ranks: List[int] = dist.get_process_group_ranks(group)
        self._backends: Dict[str, str] = {}

    @property
    def group(self) -> dist.ProcessGroup:
        """The torch process group this communicator runs on."""
        return self._group

    def rank(self) -> int:
        """This process's rank within the communicator."""
        return self._rank

    def nranks(self) -> int:
        """The number of processes in the communicator."""
        return self._nranks

    def __repr__(self) -> str:
        return f"Communicator(rank={self._rank}, nranks={self._nranks}, ranks={self.ranks})"

    def _backend(self, device: torch.device) -> str:
        name = self._backends.get(device.type)
        if name is None:
            spec = dist.get_backend(self._group)
            name = spec
            if ":" in spec:
                pairs = dict(part.split(":", 1) for part in spec.split(","))
                name = pairs.get(device.type, spec)
            self._backends[device.type] = name
        return name

    def _native_avg(self, device: torch.device) -> bool:
        # groupcomm implements the package's AVG (integers truncate toward
        # zero); elsewhere AVG is done here as SUM then a division.
        return self._backend(device) == BACKEND_NAME


class BaguaProcessGroup:
    """A process group with its global, intra-node and inter-node communicators.

    Made by :func:`new_group` or :func:`from_torch_group`. ``ranks`` are the
    global ranks of the members (sorted). The intra-node communicator holds
    the members on this process's host; the inter-node communicator holds one
    leader per host (the lowest rank there) and is ``None`` on every other
    member. On a process that is not a member, every communicator is ``None``.
    ``hosts`` lists the members per host (hosts in order of their lowest rank);
    ``torch_group`` and ``group_name`` name the wrapped torch group (``None``
    on a non-member). ``hierarchical=True`` makes :func:`allreduce` on this group's global
    communicator hierarchical by default. ``stream`` is kept for Bagua
    compatibility (a CUDA stream); the backend orders its own work.
    """

    def __init__(self, torch_group: Optional[dist.ProcessGroup], ranks: List[int],
                 hosts: List[List[int]], intra: Optional[dist.ProcessGroup],
                 inter: Optional[dist.ProcessGroup], stream: Any = None,
                 hierarchical: bool = False) -> None:
        self.ranks = ranks
        self.hosts = hosts
        self.stream = stream
        self.hierarchical = hierarchical
        self.torch_group = torch_group
        self.group_name = torch_group.group_name if torch_group is not None else None
        self._global = Communicator(torch_group, owner=self) if torch_group is not None else None
        self._intra = Communicator(intra) if intra is not None else None
        self._inter = Communicator(inter) if inter is not None else None

    def get_global_communicator(self) -> Optional[Communicator]:
        """The communicator over all members (``None`` on a non-member)."""
        return self._global

    def get_intra_node_communicator(self) -> Optional[Communicator]:
        """The communicator over the members on this host (``None`` on a non-member)."""
        return self._intra

    def get_inter_node_communicator(self) -> Optional[Communicator]:
        """The communicator over one leader per host; ``None`` unless this
        process is its host's leader (the lowest member rank on the host).
        Do not pass that ``None`` as ``comm``: it means the default group."""
        return self._inter

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(ranks={self.ranks}, hosts={self.hosts}, hierarchical={self.hierarchical})"


# Default group state, tied to the torch default group it was made for.
_state: Dict[str, Any] = {"world": None, "group": None, "comm": None}


def _world() -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "communication: torch.distributed is not initialised; "
            "call communication.init_process_group() first"
        )
    world = dist.group.WORLD
    if _state["world"] is not world:
        _state.update(world=world, group=None, comm=None)
    return world


def init_process_group(store: Optional[dist.Store] = None) -> None:
    """Initialise torch.distributed with the ``groupcomm`` backend and build
    the default :class:`BaguaProcessGroup` (collective: call it on every rank).

    Without ``store``, the rendezvous reads RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT as torchrun sets them; with ``store``, only RANK and
    WORLD_SIZE are read. Raises ``RuntimeError`` if torch.distributed is
    already initialised or a variable is missing.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "communication.init_process_group: torch.distributed is already initialised "
            f"(backend {dist.get_backend()!r}); use communication.get_default_group() instead"
        )
    needed = ["RANK", "WORLD_SIZE"] + (["MASTER_ADDR", "MASTER_PORT"] if store is None else [])
    missing = [name for name in needed if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"communication.init_process_group: environment variable(s) {', '.join(missing)} not set "
            "(launch with torchrun, or set them)"
        )
    if store is None:
        dist.init_process_group(BACKEND_NAME, init_method="env://")
    else:
        dist.init_process_group(BACKEND_NAME, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    get_default_group()


def is_initialized() -> bool:
    """Whether the default process group exists (made here or by
    ``torch.distributed.init_process_group``), so the functions can run."""
    return dist.is_initialized()


def get_default_group() -> BaguaProcessGroup:
    """The :class:`BaguaProcessGroup` over all processes, made on first use.

    Making it is collective (it creates the intra/inter-node subgroups): the
    first call must happen on every rank, in the same order relative to other
    group creations. :func:`init_process_group` makes it; after a plain
    ``torch.distributed.init_process_group`` the first hierarchical
    all-reduce with ``comm=None`` (which every rank calls) makes it.
    """
    world = _world()
    if _state["group"] is None:
        _state["group"] = from_torch_group(world)
    return _state["group"]


def _default_comm() -> Communicator:
    # Not collective: the default group's hierarchy is only built when needed.
    world = _world()
    if _state["group"] is not None:
        return _state["group"].get_global_communicator()
    if _state["comm"] is None:
        _state["comm"] = Communicator(world, default=True)
    return _state["comm"]


def new_group(ranks: Optional[Sequence[int]] = None, stream: Any = None,
              hierarchical: bool = False) -> BaguaProcessGroup:
    """Create a process group over ``ranks`` (all ranks when ``None``).

    Every process of the default group must call this, in the same order,
    members or not (as with ``torch.distributed.new_group``): it also
    creates the intra- and inter-node subgroups. The new groups use the
    default group's backend.
    """
    world_size = dist.get_world_size(_world())
    if ranks is None:
        ranks = list(range(world_size))
    ranks = list(ranks)
    if not ranks:
        raise ValueError("communication.new_group: ranks is empty")
    for r in ranks:
        if type(r) is not int or not 0 <= r < world_size:
            raise ValueError(f"communication.new_group: rank {r!r} is not in [0, {world_size})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"communication.new_group: ranks {ranks} has duplicates")
    group = dist.new_group(sorted(ranks))
    return from_torch_group(group, stream, hierarchical=hierarchical)


def from_torch_group(group: Optional[Any], stream: Any = None,
                     hierarchical: bool = False) -> BaguaProcessGroup:
    """Wrap an existing torch process group (any backend) as a
    :class:`BaguaProcessGroup`; ``None`` means the default group.

    Collective over the default group: every process calls it, passing what
    ``torch.distributed.new_group`` returned to it (non-members too). It
    exchanges host identities (``GROUPCOMM_HOST_ID`` overrides them) with
    ``all_gather_object`` and creates the intra/inter-node subgroups with the
    group's backend, reusing the group itself where a subgroup would equal it.
    """
    world = _world()
    if group is None:
        group = world
    member = isinstance(group, dist.ProcessGroup)
    if not member and group != dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError(f"communication.from_torch_group: expected a torch ProcessGroup, got {group!r}")
    mine = (dist.get_process_group_ranks(group), dist.get_backend(group)) if member else None
    host = topology.host_identity(config.load().host_id)
    gathered: List[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(gathered, (host, mine), group=world)
    reported = {tuple(entry[1][0]) for entry in gathered if entry[1] is not None}
    if len(reported) != 1:
        raise RuntimeError(
            "communication.from_torch_group: processes passed different groups "
            f"({sorted(reported)}); call it on every rank in the same order"
        )
    ranks = sorted(reported.pop())
    backend = next(entry[1][1] for entry in gathered if entry[1] is not None)
    names = [entry[0] for entry in gathered]
    order: List[str] = []
    for r in ranks:
        if names[r] not in order:
            order.append(names[r])
    hosts = [[r for r in ranks if names[r] == name] for name in order]
    leaders = [h[0] for h in hosts]
    me = dist.get_rank(world)

    def subgroup(sub_ranks: List[int]) -> Any:
        # Every process makes every subgroup, in the same order (torch's rule).
        return group if sub_ranks == ranks else dist.new_group(sub_ranks, backend=backend)

    intra = None
    for h in hosts:
        made = subgroup(h)
        if me in h:
            intra = made
    made = subgroup(leaders)
    inter = made if me in leaders else None
    if not member:
        return BaguaProcessGroup(None, ranks, hosts, None, None, stream, hierarchical)
    return BaguaProcessGroup(group, ranks, hosts, intra, inter, stream, hierarchical)


# -- checks and buffers ---------------------------------------------------------


def _comm(comm: Optional[Communicator]) -> Communicator:
    if comm is None:
        return _default_comm()
    if not isinstance(comm, Communicator):
        raise TypeError(f"communication: comm must be a Communicator or None, got {type(comm).__name__}")
    return comm


def _check_tensor(fn: str, name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"communication.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_pair(fn: str, send: Any, recv: Any, send_name: str = "send_tensor",
                recv_name: str = "recv_tensor") -> None:
    _check_tensor(fn, send_name, send)
    _check_tensor(fn, recv_name, recv)
    if send.dtype != recv.dtype:
        raise TypeError(f"communication.{fn}: {send_name} is {send.dtype} but {recv_name} is {recv.dtype}")
    if send.device != recv.device:
        raise ValueError(f"communication.{fn}: {send_name} is on {send.device} but {recv_name} on {recv.device}")


def _check_numel(fn: str, name: str, t: torch.Tensor, expected: int, rule: str) -> None:
    if t.numel() != expected:
        raise ValueError(
            f"communication.{fn}: {name} has {t.numel()} elements, expected {rule} = {expected}"
        )


def _check_divisible(fn: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.numel() % n:
        raise ValueError(f"communication.{fn}: {name} has {t.numel()} elements, not divisible by nranks = {n}")


def _check_rank(fn: str, name: str, value: Any, comm: Communicator) -> int:
    return check_rank(f"communication.{fn}: {name}", value, comm.nranks(), "the communicator")


def _check_peer(fn: str, name: str, value: Any, comm: Communicator) -> int:
    return check_peer(f"communication.{fn}: {name}", value, comm.rank(), comm.nranks(), "the communicator")


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- all-reduce -----------------------------------------------------------------


def _allreduce_flat(fn: str, flat: torch.Tensor, op: OpLike, comm: Communicator,
                    hierarchical: bool) -> None:
    kind, torch_op = _op_for(fn, op, flat.dtype)
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


def _hierarchical_allreduce(flat: torch.Tensor, kind: Kind, torch_op: Any,
                            owner: BaguaProcessGroup) -> None:
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


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: OpLike = ReduceOp.SUM,
              comm: Optional[Communicator] = None, hierarchical: bool = False) -> None:
    """Reduce ``send_tensor`` over the communicator into every rank's
    ``recv_tensor`` (same number of elements, same dtype).

    ``hierarchical=True`` (or a group made with ``hierarchical=True``) on a
    group's global communicator reduces inside each host, then among host
    leaders, then broadcasts inside each host; the result equals the flat one
    (bitwise for integers). AVG divides by the whole communicator's size.
    """
    comm = _comm(comm)
    _check_pair("allreduce", send_tensor, recv_tensor)
    _check_numel("allreduce", "recv_tensor", recv_tensor, send_tensor.numel(), "send_tensor.numel()")
    _op_for("allreduce", op, send_tensor.dtype)
    out = staging.Staged(recv_tensor, load=False)
    out.flat.copy_(send_tensor.reshape(-1))
    _allreduce_flat("allreduce", out.flat, op, comm, hierarchical)
    out.commit()


def allreduce_inplace(tensor: torch.Tensor, op: OpLike = ReduceOp.SUM,
                      comm: Optional[Communicator] = None, hierarchical: bool = False) -> None:
    """The in-place :func:`allreduce`: ``tensor`` is input and output."""
    comm = _comm(comm)
    _check_tensor("allreduce_inplace", "tensor", tensor)
    _op_for("allreduce_inplace", op, tensor.dtype)
    out = staging.Staged(tensor, load=True)
    _allreduce_flat("allreduce_inplace", out.flat, op, comm, hierarchical)
    out.commit()


# -- data movement --------------------------------------------------------------


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor,
              comm: Optional[Communicator] = None) -> None:
    """Concatenate every rank's ``send_tensor`` (in rank order) into
    ``recv_tensor``, which holds ``nranks * send_tensor.numel()`` elements."""
    comm = _comm(comm)
    _check_pair("allgather", send_tensor, recv_tensor)
    n = comm.nranks()
    _check_numel("allgather", "recv_tensor", recv_tensor, n * send_tensor.numel(),
                 f"nranks * send_tensor.numel() = {n} * {send_tensor.numel()}")
    out = staging.Staged(recv_tensor, load=False)
    _all_gather_single(out.flat, staging.flat(send_tensor), group=comm.group)
    out.commit()


def allgather_inplace(tensor: torch.Tensor, comm: Optional[Communicator] = None) -> None:
    """The in-place :func:`allgather`: ``tensor`` holds ``nranks * count``
    elements and this rank's slice ``[rank * count, (rank + 1) * count)`` is
    its input."""
    comm = _comm(comm)
    _check_tensor("allgather_inplace", "tensor", tensor)
    n, rank = comm.nranks(), comm.rank()
    _check_divisible("allgather_inplace", "tensor", tensor, n)
    count = tensor.numel() // n
    out = staging.Staged(tensor, load=True)
    mine = out.flat[rank * count:(rank + 1) * count].clone()
    _all_gather_single(out.flat, mine, group=comm.group)
    out.commit()


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor,
             comm: Optional[Communicator] = None) -> None:
    """Split ``send_tensor`` into ``nranks`` equal chunks, send chunk ``i`` to
    rank ``i``, and place the chunk from rank ``i`` at chunk ``i`` of
    ``recv_tensor`` (same number of elements, divisible by ``nranks``)."""
    comm = _comm(comm)
    _check_pair("alltoall", send_tensor, recv_tensor)
    n = comm.nranks()
    _check_divisible("alltoall", "send_tensor", send_tensor, n)
    _check_numel("alltoall", "recv_tensor", recv_tensor, send_tensor.numel(), "send_tensor.numel()")
    out = staging.Staged(recv_tensor, load=False)
    dist.all_to_all_single(out.flat, staging.flat(send_tensor), group=comm.group)
    out.commit()


def alltoall_inplace(tensor: torch.Tensor, comm: Optional[Communicator] = None) -> None:
    """The in-place :func:`alltoall`."""
    comm = _comm(comm)
    _check_tensor("alltoall_inplace", "tensor", tensor)
    n = comm.nranks()
    _check_divisible("alltoall_inplace", "tensor", tensor, n)
    out = staging.Staged(tensor, load=True)
    dist.all_to_all_single(out.flat, out.flat.clone(), group=comm.group)
    out.commit()


def _check_counts(fn: str, what: str, counts: Sequence[int], displs: Sequence[int],
                  t: torch.Tensor, n: int) -> Tuple[List[int], List[int]]:
    counts, displs = [int(c) for c in counts], [int(d) for d in displs]
    if len(counts) != n or len(displs) != n:
        raise ValueError(
            f"communication.{fn}: {what}_counts and {what}_displs need one entry per rank "
            f"(nranks {n}), got {len(counts)} and {len(displs)}"
        )
    for peer, (c, d) in enumerate(zip(counts, displs)):
        if c < 0 or d < 0 or d + c > t.numel():
            raise ValueError(
                f"communication.{fn}: {what}_tensor has {t.numel()} elements, but peer {peer} "
                f"needs [{d}, {d + c}) ({what}_displs[{peer}]={d}, {what}_counts[{peer}]={c})"
            )
    return counts, displs


def _packed(counts: List[int], displs: List[int]) -> bool:
    offset = 0
    for c, d in zip(counts, displs):
        if d != offset:
            return False
        offset += c
    return True


def alltoall_v(send_tensor: torch.Tensor, send_counts: Sequence[int], send_displs: Sequence[int],
               recv_tensor: torch.Tensor, recv_counts: Sequence[int], recv_displs: Sequence[int],
               comm: Optional[Communicator] = None) -> None:
    """All-to-all with per-peer sizes: send ``send_counts[i]`` elements from
    offset ``send_displs[i]`` of ``send_tensor`` to rank ``i``, and receive
    ``recv_counts[i]`` elements from rank ``i`` at offset ``recv_displs[i]``
    of ``recv_tensor`` (counts and offsets in elements). ``recv_counts[i]``
    here must equal ``send_counts[rank]`` on rank ``i``."""
    comm = _comm(comm)
    fn = "alltoall_v"
    _check_pair(fn, send_tensor, recv_tensor)
    n = comm.nranks()
    send_counts, send_displs = _check_counts(fn, "send", send_counts, send_displs, send_tensor, n)
    recv_counts, recv_displs = _check_counts(fn, "recv", recv_counts, recv_displs, recv_tensor, n)
    flat_in = staging.flat(send_tensor)
    if not _packed(send_counts, send_displs):
        flat_in = torch.cat([flat_in[d:d + c] for c, d in zip(send_counts, send_displs)])
    else:
        flat_in = flat_in[:sum(send_counts)]
    out = staging.Staged(recv_tensor, load=True)
    total = sum(recv_counts)
    direct = _packed(recv_counts, recv_displs)
    target = out.flat[:total] if direct else torch.empty(total, dtype=recv_tensor.dtype,
                                                          device=recv_tensor.device)
    dist.all_to_all_single(target, flat_in, recv_counts, send_counts, group=comm.group)
    if not direct:
        for piece, c, d in zip(target.split(recv_counts), recv_counts, recv_displs):
            out.flat[d:d + c].copy_(piece)
    out.commit()


def barrier(comm: Optional[Communicator] = None) -> None:
    """Block until every process of the communicator has entered it."""
    comm = _comm(comm)
    dist.barrier(group=comm.group)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Optional[Communicator] = None) -> None:
    """Copy ``src``'s ``tensor`` into ``tensor`` on every rank (the same
    number of elements everywhere)."""
    comm = _comm(comm)
    _check_tensor("broadcast", "tensor", tensor)
    _check_rank("broadcast", "src", src, comm)
    out = staging.Staged(tensor, load=comm.rank() == src)
    dist.broadcast(out.flat, group_src=src, group=comm.group)
    out.commit()


def broadcast_object(obj: Any, src: int = 0, comm: Optional[Communicator] = None) -> Any:
    """Pickle ``obj`` on ``src`` and return it on every rank (e.g. an
    optimizer's ``state_dict()``); other ranks' ``obj`` is ignored."""
    comm = _comm(comm)
    _check_rank("broadcast_object", "src", src, comm)
    box = [obj if comm.rank() == src else None]
    dist.broadcast_object_list(box, group_src=src, group=comm.group)
    return box[0]


def gather(send_tensor: torch.Tensor, recv_tensor: Optional[torch.Tensor], dst: int,
           comm: Optional[Communicator] = None) -> None:
    """Concatenate every rank's ``send_tensor`` (in rank order) into ``dst``'s
    ``recv_tensor`` (``nranks * send_tensor.numel()`` elements); other ranks'
    ``recv_tensor`` is not used and may be ``None``."""
    comm = _comm(comm)
    _check_rank("gather", "dst", dst, comm)
    if comm.rank() != dst:
        _check_tensor("gather", "send_tensor", send_tensor)
        dist.gather(staging.flat(send_tensor), None, group_dst=dst, group=comm.group)
        return
    _check_pair("gather", send_tensor, recv_tensor)
    n, count = comm.nranks(), send_tensor.numel()
    _check_numel("gather", "recv_tensor", recv_tensor, n * count,
                 f"nranks * send_tensor.numel() = {n} * {count}")
    out = staging.Staged(recv_tensor, load=False)
    dist.gather(staging.flat(send_tensor), list(out.flat.view(n, count).unbind(0)), group_dst=dst,
                group=comm.group)
    out.commit()


def gather_inplace(tensor: torch.Tensor, count: int, dst: int,
                   comm: Optional[Communicator] = None) -> None:
    """The in-place :func:`gather`: on ``dst``, ``tensor`` holds
    ``nranks * count`` elements and its own slice is its input; elsewhere
    ``tensor`` holds ``count`` elements."""
    comm = _comm(comm)
    _check_tensor("gather_inplace", "tensor", tensor)
    _check_rank("gather_inplace", "dst", dst, comm)
    n = comm.nranks()
    if comm.rank() != dst:
        _check_numel("gather_inplace", "tensor", tensor, count, "count on a non-dst rank")
        dist.gather(staging.flat(tensor), None, group_dst=dst, group=comm.group)
        return
    _check_numel("gather_inplace", "tensor", tensor, n * count, f"nranks * count = {n} * {count}")
    out = staging.Staged(tensor, load=True)
    mine = out.flat[dst * count:(dst + 1) * count].clone()
    dist.gather(mine, list(out.flat.view(n, count).unbind(0)), group_dst=dst, group=comm.group)
    out.commit()


def scatter(send_tensor: Optional[torch.Tensor], recv_tensor: torch.Tensor, src: int,
            comm: Optional[Communicator] = None) -> None:
    """Split ``src``'s ``send_tensor`` (``nranks * recv_tensor.numel()``
    elements) into ``nranks`` chunks; rank ``i`` receives chunk ``i`` in
    ``recv_tensor``. Other ranks' ``send_tensor`` is not used and may be ``None``."""
    comm = _comm(comm)
    _check_tensor("scatter", "recv_tensor", recv_tensor)
    _check_rank("scatter", "src", src, comm)
    n, count = comm.nranks(), recv_tensor.numel()
    pieces = None
    if comm.rank() == src:
        _check_pair("scatter", send_tensor, recv_tensor)
        _check_numel("scatter", "send_tensor", send_tensor, n * count,
                     f"nranks * recv_tensor.numel() = {n} * {count}")
        pieces = list(staging.flat(send_tensor).view(n, count).unbind(0))
    out = staging.Staged(recv_tensor, load=False)
    dist.scatter(out.flat, pieces, group_src=src, group=comm.group)
    out.commit()


def scatter_inplace(tensor: torch.Tensor, count: int, src: int,
                    comm: Optional[Communicator] = None) -> None:
    """The in-place :func:`scatter`: on ``src``, ``tensor`` holds
    ``nranks * count`` elements (its own chunk stays in place); elsewhere it
    holds ``count`` elements and receives its chunk."""
    comm = _comm(comm)
    _check_tensor("scatter_inplace", "tensor", tensor)
    _check_rank("scatter_inplace", "src", src, comm)
    n = comm.nranks()
    if comm.rank() != src:
        _check_numel("scatter_inplace", "tensor", tensor, count, "count on a non-src rank")
        out = staging.Staged(tensor, load=False)
        dist.scatter(out.flat, None, group_src=src, group=comm.group)
        out.commit()
        return
    _check_numel("scatter_inplace", "tensor", tensor, n * count, f"nranks * count = {n} * {count}")
    pieces = list(staging.flat(tensor).view(n, count).unbind(0))
    dist.scatter(torch.empty_like(pieces[src]), pieces, group_src=src, group=comm.group)


def _reduce_flat(fn: str, buf: torch.Tensor, dst: int, op: OpLike, comm: Communicator) -> None:
    """Reduce ``buf`` into ``dst``'s ``buf``; other ranks' ``buf`` may be clobbered."""
    kind, torch_op = _op_for(fn, op, buf.dtype)
    if kind == Kind.AVG and not comm._native_avg(buf.device):
        dist.reduce(buf, group_dst=dst, op=dist.ReduceOp.SUM, group=comm.group)
        if comm.rank() == dst:
            divide_(buf, comm.nranks())
        return
    dist.reduce(buf, group_dst=dst, op=torch_op, group=comm.group)


def reduce(send_tensor: torch.Tensor, recv_tensor: Optional[torch.Tensor], dst: int,
           op: OpLike = ReduceOp.SUM, comm: Optional[Communicator] = None) -> None:
    """Reduce every rank's ``send_tensor`` into ``dst``'s ``recv_tensor``
    (same number of elements); other ranks' ``recv_tensor`` is left as is
    (it may be ``None`` there)."""
    comm = _comm(comm)
    _check_rank("reduce", "dst", dst, comm)
    if recv_tensor is None and comm.rank() != dst:
        _check_tensor("reduce", "send_tensor", send_tensor)
    else:
        _check_pair("reduce", send_tensor, recv_tensor)
        _check_numel("reduce", "recv_tensor", recv_tensor, send_tensor.numel(), "send_tensor.numel()")
    _op_for("reduce", op, send_tensor.dtype)
    if comm.rank() != dst:
        _reduce_flat("reduce", send_tensor.reshape(-1).clone(), dst, op, comm)
        return
    out = staging.Staged(recv_tensor, load=False)
    out.flat.copy_(send_tensor.reshape(-1))
    _reduce_flat("reduce", out.flat, dst, op, comm)
    out.commit()


def reduce_inplace(tensor: torch.Tensor, dst: int, op: OpLike = ReduceOp.SUM,
                   comm: Optional[Communicator] = None) -> None:
    """The in-place :func:`reduce`: ``dst``'s ``tensor`` receives the result;
    other ranks' ``tensor`` is left as is."""
    comm = _comm(comm)
    _check_tensor("reduce_inplace", "tensor", tensor)
    _check_rank("reduce_inplace", "dst", dst, comm)
    _op_for("reduce_inplace", op, tensor.dtype)
    if comm.rank() != dst:
        _reduce_flat("reduce_inplace", tensor.reshape(-1).clone(), dst, op, comm)
        return
    out = staging.Staged(tensor, load=True)
    _reduce_flat("reduce_inplace", out.flat, dst, op, comm)
    out.commit()


def _reduce_scatter_flat(fn: str, out: torch.Tensor, inp: torch.Tensor, op: OpLike,
                         comm: Communicator) -> None:
    kind, torch_op = _op_for(fn, op, inp.dtype)
    if kind == Kind.AVG and not comm._native_avg(inp.device):
        _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=comm.group)
        divide_(out, comm.nranks())
        return
    _reduce_scatter_single(out, inp, op=torch_op, group=comm.group)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: OpLike = ReduceOp.SUM,
                   comm: Optional[Communicator] = None) -> None:
    """Reduce every rank's ``send_tensor`` (``nranks * recv_tensor.numel()``
    elements) and give rank ``i`` chunk ``i`` of the result in ``recv_tensor``."""
    comm = _comm(comm)
    _check_pair("reduce_scatter", send_tensor, recv_tensor)
    n, count = comm.nranks(), recv_tensor.numel()
    _check_numel("reduce_scatter", "send_tensor", send_tensor, n * count,
                 f"nranks * recv_tensor.numel() = {n} * {count}")
    _op_for("reduce_scatter", op, send_tensor.dtype)
    out = staging.Staged(recv_tensor, load=False)
    _reduce_scatter_flat("reduce_scatter", out.flat, staging.flat(send_tensor), op, comm)
    out.commit()


def reduce_scatter_inplace(tensor: torch.Tensor, op: OpLike = ReduceOp.SUM,
                           comm: Optional[Communicator] = None) -> None:
    """The in-place :func:`reduce_scatter`: ``tensor`` (size divisible by
    ``nranks``) is the input; this rank's chunk ``[rank * count, (rank + 1) *
    count)`` receives its result, the other chunks are left as they were."""
    comm = _comm(comm)
    _check_tensor("reduce_scatter_inplace", "tensor", tensor)
    n, rank = comm.nranks(), comm.rank()
    _check_divisible("reduce_scatter_inplace", "tensor", tensor, n)
    _op_for("reduce_scatter_inplace", op, tensor.dtype)
    count = tensor.numel() // n
    out = staging.Staged(tensor, load=True)
    _reduce_scatter_flat("reduce_scatter_inplace", out.flat[rank * count:(rank + 1) * count],
                         out.flat.clone(), op, comm)
    out.commit()


# -- point to point -------------------------------------------------------------


def send(tensor: torch.Tensor, dst: int, comm: Optional[Communicator] = None) -> None:
    """Send ``tensor`` to ``dst``, returning when it has been handed over."""
    comm = _comm(comm)
    _check_tensor("send", "tensor", tensor)
    _check_peer("send", "dst", dst, comm)
    dist.send(staging.flat(tensor), group_dst=dst, group=comm.group)


def recv(tensor: torch.Tensor, src: int, comm: Optional[Communicator] = None) -> None:
    """Receive into ``tensor`` what ``src`` sends (the same number of elements)."""
    comm = _comm(comm)
    _check_tensor("recv", "tensor", tensor)
    _check_peer("recv", "src", src, comm)
    out = staging.Staged(tensor, load=False)
    dist.recv(out.flat, group_src=src, group=comm.group)
    out.commit()
