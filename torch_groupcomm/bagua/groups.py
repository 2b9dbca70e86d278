"""Bagua's process groups and communicators over torch process groups: a
group seen as a whole (global), per host (intra-node) and across host leaders
(inter-node), and the default group tied to torch's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import config, topology
from .._registry import BACKEND_NAME


class Communicator:
    """A handle on a torch process group, with Bagua's ``rank()``/``nranks()``.

    Obtain one from a :class:`BaguaProcessGroup`; pass it as ``comm=`` to the
    functions of this module. ``rank()`` is this process's rank within the
    communicator, ``nranks()`` its size, ``ranks`` the global ranks in it.
    """

    def __init__(self, group: dist.ProcessGroup, owner: BaguaProcessGroup | None = None, default: bool = False) -> None:
        self._group = group
        self._owner = owner
        self._default = default
        self._rank = dist.get_rank(group)
        self._nranks = dist.get_world_size(group)
        self.ranks: list[int] = dist.get_process_group_ranks(group)
        self._backends: dict[str, str] = {}

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

    def __init__(
        self,
        torch_group: dist.ProcessGroup | None,
        ranks: list[int],
        hosts: list[list[int]],
        intra: dist.ProcessGroup | None,
        inter: dist.ProcessGroup | None,
        stream: Any = None,
        hierarchical: bool = False,
    ) -> None:
        self.ranks = ranks
        self.hosts = hosts
        self.stream = stream
        self.hierarchical = hierarchical
        self.torch_group = torch_group
        self.group_name = torch_group.group_name if torch_group is not None else None
        self._global = Communicator(torch_group, owner=self) if torch_group is not None else None
        self._intra = Communicator(intra) if intra is not None else None
        self._inter = Communicator(inter) if inter is not None else None

    def get_global_communicator(self) -> Communicator | None:
        """The communicator over all members (``None`` on a non-member)."""
        return self._global

    def get_intra_node_communicator(self) -> Communicator | None:
        """The communicator over the members on this host (``None`` on a non-member)."""
        return self._intra

    def get_inter_node_communicator(self) -> Communicator | None:
        """The communicator over one leader per host; ``None`` unless this
        process is its host's leader (the lowest member rank on the host).
        Do not pass that ``None`` as ``comm``: it means the default group."""
        return self._inter

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(ranks={self.ranks}, hosts={self.hosts}, hierarchical={self.hierarchical})"


# Default group state, tied to the torch default group it was made for.
_state: dict[str, Any] = {"world": None, "group": None, "comm": None}


def _world() -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "communication: torch.distributed is not initialised; call communication.init_process_group() first"
        )
    world = dist.group.WORLD
    if _state["world"] is not world:
        _state.update(world=world, group=None, comm=None)
    return world


def init_process_group(store: dist.Store | None = None) -> None:
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
        dist.init_process_group(
            BACKEND_NAME, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
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


def new_group(ranks: Sequence[int] | None = None, stream: Any = None, hierarchical: bool = False) -> BaguaProcessGroup:
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


def from_torch_group(group: Any | None, stream: Any = None, hierarchical: bool = False) -> BaguaProcessGroup:
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
    gathered: list[Any] = [None] * dist.get_world_size(world)
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
    hosts = topology.group_by_host(names, ranks)
    leaders = [h[0] for h in hosts]
    me = dist.get_rank(world)

    def subgroup(sub_ranks: list[int]) -> Any:
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


def resolve(comm: Communicator | None) -> Communicator:
    """The communicator a function runs on: ``comm``, or the default group's when ``None``."""
    if comm is None:
        return _default_comm()
    if not isinstance(comm, Communicator):
        raise TypeError(f"communication: comm must be a Communicator or None, got {type(comm).__name__}")
    return comm
