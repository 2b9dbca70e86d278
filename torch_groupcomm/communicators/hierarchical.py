"""Collectives for a group spanning hosts: shared memory inside each host,
gloo between one leader per host.

All-reduce, reduce, broadcast, all-gather and barrier go host-local first,
then across leaders, then back out; large even reduce-scatters go on rails
(below); the other collectives travel over the whole group's gloo
``cpu_group`` (correct for any layout of ranks over hosts).

When every host has the same number of ranks L, rail i (the ranks of local
index i, one per host) carries 1/L of each large all-reduce, so that all of
a host's ranks drive its link at once: a local reduce-scatter, gloo's own
all-reduce of each slice on its rail (typed, where gloo has the dtype and
op), and a local all-gather. (All-gather on rails measured slower than the
leaders' path: 16 MiB 132 vs 129 ms, 64 MiB 737 vs 625 ms on 2x2 hosts.)

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
from ..reduction import Kind, Reduction, divide_, wire_plan
from ..topology import Topology
from .base import DeviceCommunicatorBase, even_sizes
from .gloo import GlooCommunicator

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
# The dtypes torch's ProcessGroupGloo all-reduces, and the ops it has on them.
_GLOO_FLOAT = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_GLOO_INTEGER = {torch.int8, torch.uint8, torch.int32, torch.int64}
_GLOO_FLOAT_OPS = {Kind.SUM, Kind.PRODUCT, Kind.MIN, Kind.MAX}
_GLOO_INTEGER_OPS = _GLOO_FLOAT_OPS | {Kind.BAND, Kind.BOR, Kind.BXOR}

Op = TypeVar("Op", bound=Callable)


def _gloo_plan(dtype: torch.dtype, kind: Kind, ranks: int):
    """How gloo's own all-reduce of ``ranks`` carries ``kind`` on ``dtype``
    (a ``WirePlan``), or None where it cannot. float16 and bfloat16 sums of
    three or more ranks stay off gloo's ring, which rounds at every step:
    the package accumulates them in float32."""
    plan = wire_plan(dtype, kind)
    if plan is None:
        return None
    if plan.dtype in (torch.float16, torch.bfloat16) and ranks > 2:
        return None
    if plan.dtype in _GLOO_FLOAT and plan.kind in _GLOO_FLOAT_OPS:
        return plan
    if plan.dtype in _GLOO_INTEGER and plan.kind in _GLOO_INTEGER_OPS:
        return plan
    return None


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
            # local rank i gets its host's partial of slice i, reduces it on
            # rail i, and the host's ranks swap the finished slices
            sizes = even_sizes(tensor.numel(), len(self.topology.local_ranks))
            part = tensor.new_empty(sizes[self.topology.local_rank])
            self.local.reduce_scatterv_into(part, tensor, sizes, inner)
            with self._across_hosts():
                self._rail_all_reduce_(part, outer)
            self.local.all_gatherv_into(tensor, part, sizes)
            if reduction.kind == Kind.AVG:
                divide_(tensor, self.world_size)
            return
        self.local.reduce_(tensor, 0, inner)
        if self.leaders is not None:
            with self._across_hosts():
                self.leaders.all_reduce_(tensor, outer)
        self.local.broadcast_(tensor, 0)
        if reduction.kind == Kind.AVG:
            divide_(tensor, self.world_size)

    def _rail_all_reduce_(self, part: torch.Tensor, reduction: Reduction) -> None:
        """All-reduce ``part`` over this rank's rail: gloo's own ring on the
        typed tensor where gloo has the (dtype, op), else gloo's bytes."""
        rail = self.rail
        if part.numel() == 0:
            return
        plan = _gloo_plan(part.dtype, reduction.kind, len(self.topology.hosts))
        if plan is None:
            rail.all_reduce_(part, reduction)
            return
        opts = rail._opts(c10d.AllreduceOptions, reduceOp=getattr(c10d.ReduceOp, plan.kind.name))
        rail._wait(rail.cpu_group.allreduce([plan.apply(part)], opts))

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
        topo = self.topology
        hosts, per_host = len(topo.hosts), len(topo.local_ranks)
        inner, outer = self._stages(reduction)
        permuted = input_
        if self._rail_rows is not None:
            permuted = input_.view(self.world_size, block).index_select(0, self._rail_rows).view(-1)
        part = input_.new_empty(hosts * block)
        self.local.reduce_scatterv_into(part, permuted, [hosts * block] * per_host, inner)
        # gloo's own typed reduce-scatter measured slower than its all-reduce
        # (16 MiB over loopback: 32 vs 12 ms); the rail's all-to-all of bytes
        # carries the (H-1)/H of the slice a ring would, and any dtype and op
        with self._across_hosts():
            self.rail.reduce_scatterv_into(output, part, [block] * hosts, outer)
        if reduction.kind == Kind.AVG:
            divide_(output, self.world_size)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        result = tensor.clone()
        self.all_reduce_(result, reduction)
        if self.rank_in_group == dst:
            tensor.copy_(result)

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

    @_two_level
    def all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: list[int]) -> None:
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

    def destroy(self) -> None:
        for part in self._parts():
            part.destroy()
