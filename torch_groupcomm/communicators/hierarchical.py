"""Collectives for a group spanning hosts: shared memory inside each host,
gloo between one leader per host.

All-reduce, reduce, broadcast, all-gather and barrier go host-local first,
then across leaders, then back out; large even all-reduces (and reduces),
reduce-scatters and all-gathers go on rails (below), and large even
all-to-alls per pair of hosts where hosts have 3 or more ranks; the other
collectives (gather, scatter, all-to-all) travel over the whole
group's gloo ``cpu_group`` (correct for any layout of ranks over hosts),
the C++ bridge running the common ones (``_gloo_routes``).

When every host has the same number of ranks L, rail i (the ranks of local
index i, one per host) carries 1/L of each large op, so that all of a host's
ranks drive its link at once. All-reduce: a local reduce-scatter, gloo's own
all-reduce of each slice on its rail (typed, where gloo has the dtype and
op), and a local all-gather. Reduce-scatter: the blocks reordered by (local
index, host), so that each stage is one contiguous exchange. All-gather: the
rail swaps each rank's block while the host gathers its own rows. The stages
run in pieces, so that the link and the host work at once.

A rank whose two-level op fails gives up on both levels at once (its host's
peers and the other leaders then fail at once too, not at their timeout) and
records why in the group's store, so that every rank's error names the first
failure, e.g. the rank that died on another host.
"""

from __future__ import annotations

import contextlib
import functools
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch
from torch._C import _distributed_c10d as c10d

from ..errors import GroupCommError
from ..reduction import Kind, Reduction, divide_
from ..topology import Topology
from .base import DeviceCommunicatorBase, even_pieces, even_sizes
from .gloo import NEVER_BYTES, GlooCommunicator

# How each op combines across stages: (within a host, across leaders).
_SUM = Reduction(Kind.SUM)
# In the group's private store: the first failure any rank of the group saw.
_FIRST_FAILURE = "groupcomm/hierarchical/first-failure"
# A connection lost between hosts names no rank, where the dead rank's own
# host sees "peer rank 3 (pid N) exited" through shared memory within 0.1 s:
# a rank whose step between hosts failed waits this long for that record
# before it records its own.
_BETWEEN_HOSTS_GRACE_S = 0.5

# All-reduces below this many bytes take the leaders' path, not the rails
# (2x2 hosts, 1 Gbit/s: 16 KiB 1.47 ms on rails vs 0.91 ms; 64 KiB 1.72 vs 3.55 ms).
RAIL_MIN_BYTES = 64 << 10
# Reduces below this many bytes take one step between hosts (through the
# leaders), larger ones an all-reduce on rails (2x2 hosts, 1 Gbit/s, 64 KiB:
# 3.6 ms on rails, gloo 3.1 ms).
_REDUCE_RAIL_MIN_BYTES = 1 << 20
# Ops on rails run in pieces of about this many bytes (at most _MAX_PIECES),
# so that one piece's step between hosts overlaps another's within the host.
_PIECE_BYTES = 4 << 20
_MAX_PIECES = 4
# all_to_all_single without split sizes of _RAIL_ALL_TO_ALL_MIN_BYTES or
# more goes per pair of hosts where hosts have _RAIL_ALL_TO_ALL_MIN_RANKS
# ranks or more each: the link then carries L streams instead of L². Per
# pair of hosts against flat, 256 KiB-16 MiB, 2 cores: 2 hosts of 4 ranks
# at 1 Gbit/s 1.5x-1.8x from 512 KiB (2 MiB: 37 ms against 110-140 ms, the
# bound 33.5 ms), 0.6x-0.7x at 10 Gbit/s (8 ranks on 2 cores: the extra
# copy in each host); 2 hosts of 2 ranks 0.86x-1.01x at 1 Gbit/s,
# 0.53x-0.92x at 10 Gbit/s. Timing both ways on a group's first calls chose
# wrongly in about 1 run in 3 here (a shaped link's retransmissions, busy
# cores).
_RAIL_ALL_TO_ALL_MIN_RANKS = 3
_RAIL_ALL_TO_ALL_MIN_BYTES = 256 << 10

Op = TypeVar("Op", bound=Callable)


def _pieces(numel: int, element_bytes: int) -> list[tuple[int, int]]:
    """(start, stop) of the pieces of ``numel`` elements of ``element_bytes``."""
    return even_pieces(numel, max(1, min(_MAX_PIECES, numel * element_bytes // _PIECE_BYTES, numel)))


def _two_level(op: Op) -> Op:
    """A staged op: refused after an earlier failure; on a failure of its
    own, this rank gives up on the group (``_give_up``)."""

    @functools.wraps(op)
    def run(self: HierarchicalCommunicator, *args):
        if self._failure is not None:
            raise GroupCommError(f"groupcomm: hierarchical group unusable after an earlier failure ({self._failure})")
        try:
            return op(self, *args)
        except GroupCommError as exc:
            if self._aborted:  # abort() has told the parts already
                raise
            raise self._give_up(exc) from exc

    return run  # type: ignore[return-value]


class HierarchicalCommunicator(GlooCommunicator):
    """Two-level collectives: ``local`` per host, ``leaders`` across hosts."""

    name = "hierarchical"

    def __init__(
        self,
        cpu_group,
        topology: Topology,
        local: DeviceCommunicatorBase,
        leaders: DeviceCommunicatorBase | None,
        store: c10d.Store,
        timeout: timedelta | None = None,
        unique_name: str = "",
        rail: GlooCommunicator | None = None,
    ) -> None:
        super().__init__(cpu_group, torch.device("cpu"), None, unique_name, timeout)
        self.topology = topology
        # the host's ranks share its link (GlooCommunicator's send_first_max_bytes)
        self.send_first_max_bytes //= max(len(host) for host in topology.hosts)
        self.local = local
        self.leaders = leaders
        # this rank's rail (None: uneven layout); rail 0 is ``leaders`` itself
        self.rail = rail
        self._store = store
        self._failure: str | None = None
        self._between_hosts = False  # a step between hosts is under way
        # The rails' block order, by (local index, host): the rows to take
        # from a reduce-scatter's input (None: rank order already).
        self._rail_rows: torch.Tensor | None = None
        # even all_to_all_singles of this many bytes or more go per pair of hosts
        self.rail_all_to_all_min_bytes = NEVER_BYTES
        if rail is not None and len(topology.local_ranks) >= _RAIL_ALL_TO_ALL_MIN_RANKS:
            self.rail_all_to_all_min_bytes = _RAIL_ALL_TO_ALL_MIN_BYTES
        if rail is not None:
            hosts, per_host = len(topology.hosts), len(topology.local_ranks)
            order = [topology.hosts[h][i] for i in range(per_host) for h in range(hosts)]
            if order != sorted(order):
                self._rail_rows = torch.tensor(order)

    def _give_up(self, exc: GroupCommError) -> GroupCommError:
        """After ``exc``: record it as the group's first failure unless one is
        recorded, disconnect both levels (only then, so that a peer failing
        because of it finds the record), and return the error to raise,
        naming the first failure when that was another one."""
        self._failure = str(exc)
        mine = f"rank {self.rank_in_group}: {exc}"
        try:
            if self._between_hosts:
                deadline = time.monotonic() + _BETWEEN_HOSTS_GRACE_S
                while not self._store.check([_FIRST_FAILURE]) and time.monotonic() < deadline:
                    time.sleep(0.02)
            first = self._store.compare_set(_FIRST_FAILURE, "", mine).decode()
        except RuntimeError:  # the store's host may be the rank that died
            first = mine
        for part in self._parts():
            part.disconnect()
        if first == mine:
            return exc
        return type(exc)(f"{exc} (the group's first failure: {first})")

    @contextlib.contextmanager
    def _across_hosts(self):
        """Marks a step between hosts, for ``_give_up`` (the mark stays when
        the step fails)."""
        self._between_hosts = True
        yield
        self._between_hosts = False

    def _parts(self) -> list[DeviceCommunicatorBase]:
        parts = [self.local] + ([self.leaders] if self.leaders is not None else [])
        if self.rail is not None and self.rail is not self.leaders:
            parts.append(self.rail)
        return parts

    def _on_rails(self, tensor: torch.Tensor) -> bool:
        return self.rail is not None and tensor.nbytes >= RAIL_MIN_BYTES

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        for part in self._parts():
            part.set_timeout(timeout)

    def _use_op_timeout(self, timeout: timedelta | None) -> None:
        super()._use_op_timeout(timeout)
        for part in self._parts():
            part._use_op_timeout(timeout)

    def _stages(self, reduction: Reduction):
        if reduction.kind == Kind.AVG:
            return _SUM, _SUM
        if reduction.kind == Kind.PREMUL_SUM:
            return reduction, _SUM
        return reduction, reduction

    @_two_level
    def all_reduce_(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        inner, outer = self._stages(reduction)
        if self._on_rails(tensor):
            self._rail_all_reduce_(tensor, inner, outer, reduction.kind == Kind.AVG)
            return
        self.local.reduce_(tensor, 0, inner)
        if self.leaders is not None:
            with self._across_hosts():
                self.leaders.all_reduce_(tensor, outer)
        self.local.broadcast_(tensor, 0)
        if reduction.kind == Kind.AVG:
            divide_(tensor, self.world_size)

    def _rail_all_reduce_(self, tensor: torch.Tensor, inner: Reduction, outer: Reduction, average: bool) -> None:
        """All-reduce on rails, piece by piece: local rank i reduce-scatters
        its host's piece (slice i), all-reduces slice i on rail i while the
        host reduce-scatters the next piece, then the host's ranks swap the
        finished slices. Slice i is reduced where it lies in the tensor, so
        that the swap copies only the peers' slices. ``average``: each rank
        divides its own slice of the sum before the swap, not the whole
        tensor after it."""
        per_host, me = len(self.topology.local_ranks), self.topology.local_rank
        previous: Callable[[], None] | None = None
        with self._across_hosts():
            for start, stop in _pieces(tensor.numel(), tensor.element_size()):
                piece = tensor[start:stop]
                sizes = even_sizes(piece.numel(), per_host)
                part = piece.split(sizes)[me]
                self.local.reduce_scatterv_into(part, piece, sizes, inner)
                reduced = self.rail.start_all_reduce(part, outer)
                if previous is not None:
                    previous()
                previous = functools.partial(self._gather_piece, reduced, piece, part, sizes, average)
            previous()

    def _gather_piece(
        self, reduced: Callable[[], None], piece: torch.Tensor, part: torch.Tensor, sizes: list[int], average: bool
    ) -> None:
        reduced()
        if average:
            divide_(part, self.world_size)
        self.local.all_gatherv_into(piece, part, sizes)

    def reduce_scatterv_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        sizes: list[int],
        reduction: Reduction,
    ) -> None:
        if len(set(sizes)) == 1 and sizes[0] > 0 and self._on_rails(input_):
            self._rail_reduce_scatter_into(output, input_, sizes[0], reduction)
            return
        # uneven sizes, uneven hosts or small: the whole group's gloo
        super().reduce_scatterv_into(output, input_, sizes, reduction)

    @_two_level
    def _rail_reduce_scatter_into(
        self, output: torch.Tensor, input_: torch.Tensor, block: int, reduction: Reduction
    ) -> None:
        """Reduce-scatter of ``block`` elements per rank on rails: the blocks
        reordered by (local index, host), a local reduce-scatter hands local
        rank i its host's partials of the H blocks for the ranks of local
        index i (host order), and rail i reduce-scatters those H blocks."""
        hosts, per_host = len(self.topology.hosts), len(self.topology.local_ranks)
        inner, outer = self._stages(reduction)
        rows = input_.view(self.world_size, block)
        previous: Callable[[], None] | None = None
        with self._across_hosts():
            for start, stop in _pieces(block, input_.element_size() * self.world_size):
                columns = rows[:, start:stop]
                if self._rail_rows is not None:
                    columns = columns.index_select(0, self._rail_rows)
                part = input_.new_empty(hosts * (stop - start))
                self.local.reduce_scatterv_into(part, columns.contiguous().view(-1), [part.numel()] * per_host, inner)
                # the rail's reduce-scatter is an all-to-all of bytes (gloo's
                # own typed one measured slower than its all-reduce: 16 MiB
                # over loopback 32 vs 12 ms) and a local reduction
                reduced = self.rail.start_reduce_scatter(output[start:stop], part, outer)
                if previous is not None:
                    previous()
                previous = reduced
            previous()
        if reduction.kind == Kind.AVG:
            divide_(output, self.world_size)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        if self.rail is not None and tensor.nbytes >= _REDUCE_RAIL_MIN_BYTES:
            self._rail_reduce_(tensor, dst, reduction)
        else:
            self._leaders_reduce_(tensor, dst, reduction)

    @_two_level
    def _rail_reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        """Reduce on rails: local rank i reduce-scatters its host's slice i
        (shared memory), reduces it on rail i into the rank of local index i
        on dst's host, and dst's host gathers the slices into dst: every
        local rank drives its link (one leader's stream: 2x2 at 10 Gbit/s,
        16 MiB 77 ms against 45 ms for the all-reduce on rails)."""
        topo = self.topology
        inner, outer = self._stages(reduction)
        dst_host = topo.host_of(dst)
        sizes = even_sizes(tensor.numel(), len(topo.local_ranks))
        # dst's own slice is reduced where it lies; every other rank keeps its tensor
        mine = self.rank_in_group == dst
        slices = tensor.split(sizes)
        part = slices[topo.local_rank] if mine else tensor.new_empty(sizes[topo.local_rank])
        self.local.reduce_scatterv_into(part, tensor, sizes, inner)
        with self._across_hosts():
            self.rail.reduce_(part, dst_host, outer)
        if topo.host_index != dst_host:
            return
        self.local.gatherv_into(list(slices) if mine else None, part, sizes, topo.local_ranks.index(dst))
        if mine and reduction.kind == Kind.AVG:
            divide_(tensor, self.world_size)

    @_two_level
    def _leaders_reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        """Reduce within each host into its first rank (shared memory), across
        those into the first rank of dst's host (gloo: each other host's
        partial crosses its link once), then hand the result to dst: one
        step between hosts where the all-reduce takes two."""
        topo = self.topology
        inner, outer = self._stages(reduction)
        dst_host = topo.host_of(dst)
        partial = tensor.clone()  # every rank but dst keeps its tensor
        self.local.reduce_(partial, 0, inner)
        if self.leaders is not None:
            with self._across_hosts():
                self.leaders.reduce_(partial, dst_host, outer)
        if topo.host_index != dst_host:
            return
        if topo.local_ranks.index(dst) != 0:
            self.local.broadcast_(partial, 0)
        if self.rank_in_group == dst:
            tensor.copy_(partial)
            if reduction.kind == Kind.AVG:
                divide_(tensor, self.world_size)

    @_two_level
    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        topo = self.topology
        src_host = topo.host_of(src)
        if topo.host_index == src_host:
            self.local.broadcast_(tensor, topo.hosts[src_host].index(src))
        if self.leaders is not None:
            with self._across_hosts():
                self.leaders.broadcast_(tensor, src_host)
        if topo.host_index != src_host:
            self.local.broadcast_(tensor, 0)

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        self.all_gatherv_into(output, input_, [input_.numel()] * self.world_size)

    def all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: list[int]) -> None:
        if len(set(sizes)) == 1 and sizes[0] > 0 and self._on_rails(output):
            self._rail_all_gather_into(output, input_, sizes[0])
        else:
            self._leaders_all_gatherv_into(output, input_, sizes)

    @_two_level
    def _rail_all_gather_into(self, output: torch.Tensor, input_: torch.Tensor, block: int) -> None:
        """All-gather of ``block`` elements per rank on rails: rail i swaps
        the blocks of the ranks of local index i; meanwhile the host's ranks
        all-gather their own blocks (their host's rows of ``output``), then
        each other host's rows once the rail brought them."""
        topo = self.topology
        rows = output.view(self.world_size, block)
        part = input_.new_empty(len(topo.hosts), block)
        with self._across_hosts():
            arrived: Callable[[], None] | None = self.rail.start_all_gather(part.view(-1), input_)
            self._gather_host_rows(rows, topo.host_index, input_)
            for host in range(len(topo.hosts)):
                if host != topo.host_index:
                    if arrived is not None:
                        arrived()
                        arrived = None
                    self._gather_host_rows(rows, host, part[host])

    def _gather_host_rows(self, rows: torch.Tensor, host: int, mine: torch.Tensor) -> None:
        """``rows`` of ``host``'s ranks, local rank i holding the row of the
        rank of local index i there (``mine``): straight into ``rows`` where
        that host's ranks are consecutive."""
        ranks = self.topology.hosts[host]
        sizes = [mine.numel()] * len(ranks)
        if self._consecutive(host):
            self.local.all_gatherv_into(rows[ranks[0] : ranks[0] + len(ranks)].view(-1), mine, sizes)
            return
        gathered = mine.new_empty(len(ranks), mine.numel())
        self.local.all_gatherv_into(gathered.view(-1), mine, sizes)
        rows.index_copy_(0, torch.tensor(ranks), gathered)

    @_two_level
    def _leaders_all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: list[int]) -> None:
        topo = self.topology
        host_sizes = [[sizes[r] for r in ranks] for ranks in topo.hosts]
        # 1. every rank of the host gets the host's block (shared memory)
        mine = host_sizes[topo.host_index]
        block = input_.new_empty(sum(mine))
        self.local.all_gatherv_into(block, input_, mine)
        # 2. leaders swap host blocks; 3. each leader hands the result to its host
        gathered = input_.new_empty(sum(sizes))
        if self.leaders is not None:
            with self._across_hosts():
                self.leaders.all_gatherv_into(gathered, block, [sum(h) for h in host_sizes])
        self.local.broadcast_(gathered, 0)
        # host-major order back to rank order
        offsets = [0] * self.world_size
        position = 0
        for ranks in topo.hosts:
            for r in ranks:
                offsets[r] = position
                position += sizes[r]
        out_at = 0
        for r in range(self.world_size):
            output[out_at : out_at + sizes[r]].copy_(gathered[offsets[r] : offsets[r] + sizes[r]])
            out_at += sizes[r]

    def all_to_all_even_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        if input_.nbytes >= self.rail_all_to_all_min_bytes:
            self._rail_all_to_all_into(output, input_)
        else:
            super().all_to_all_even_into(output, input_)

    @_two_level
    def _rail_all_to_all_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """All-to-all of equal blocks per pair of hosts: for each other host
        h, the host's ranks swap (shared memory) their blocks for h's ranks,
        so that local rank i holds all of them for the rank of local index i
        there, and sends them in one message on rail i; meanwhile what h's
        ranks send the same way arrives, each block where it belongs. The
        host's own blocks go last, while the messages travel."""
        topo = self.topology
        hosts, me = len(topo.hosts), topo.host_index
        per_host = len(topo.local_ranks)
        block = input_.numel() // self.world_size
        sizes = [block] * per_host
        rows_in, rows_out = input_.view(self.world_size, block), output.view(self.world_size, block)
        others = [(me + k) % hosts for k in range(1, hosts)]
        arrivals = {h: self._host_rows(rows_out, h, fresh=True) for h in others}
        with self._across_hosts():
            arrived = self.rail.start_exchange([(arrivals[h], h) for h in others], [])
            sent = []
            for h in others:
                outgoing = input_.new_empty(per_host, block)
                self.local.all_to_all_into(outgoing.view(-1), self._host_rows(rows_in, h).view(-1), sizes, sizes)
                sent.append(self.rail.start_exchange([], [(outgoing, h)]))
            own = self._host_rows(rows_out, me, fresh=True)
            self.local.all_to_all_into(own.view(-1), self._host_rows(rows_in, me).view(-1), sizes, sizes)
            self._put_host_rows(rows_out, me, own)
            arrived()
            for h in others:
                self._put_host_rows(rows_out, h, arrivals[h])
            for finish in sent:
                finish()

    def _consecutive(self, host: int) -> bool:
        ranks = self.topology.hosts[host]
        return ranks == list(range(ranks[0], ranks[0] + len(ranks)))

    def _host_rows(self, rows: torch.Tensor, host: int, fresh: bool = False) -> torch.Tensor:
        """The rows of ``host``'s ranks: a view where they are consecutive,
        else a copy (``fresh``: an empty one, for :meth:`_put_host_rows`)."""
        ranks = self.topology.hosts[host]
        if self._consecutive(host):
            return rows[ranks[0] : ranks[0] + len(ranks)]
        if fresh:
            return rows.new_empty(len(ranks), rows.shape[1])
        return rows.index_select(0, torch.tensor(ranks))

    def _put_host_rows(self, rows: torch.Tensor, host: int, values: torch.Tensor) -> None:
        """Write ``values`` (from :meth:`_host_rows`) to ``host``'s rows."""
        if not self._consecutive(host):
            rows.index_copy_(0, torch.tensor(self.topology.hosts[host]), values)

    @_two_level
    def barrier(self) -> None:
        self.local.barrier()
        if self.leaders is not None:
            with self._across_hosts():
                self.leaders.barrier()
        self.local.barrier()

    def abort(self) -> None:
        super().abort()  # the waits and posted send/recv on the whole group's cpu_group
        for part in self._parts():
            part.abort()

    def _gloo_routes(self) -> dict[str, bool | int]:
        # what runs flat over the whole group's gloo (barrier, broadcast, all-gather and all-reduce are two-level)
        return {
            **super()._gloo_routes(),
            "barrier": False,
            "broadcast": False,
            "all_gather": False,
            "all_reduce": False,
            "python_all_to_all_min_bytes": self.rail_all_to_all_min_bytes,
        }

    def destroy(self) -> None:
        super().destroy()
        for part in self._parts():
            part.destroy()
