"""Collectives for a group spanning hosts: shared memory inside each host,
gloo between one leader per host.

All-reduce, reduce, broadcast, all-gather and barrier go host-local first,
then across leaders, then back out; the other collectives travel over the
whole group's gloo ``cpu_group`` (correct for any layout of ranks over hosts).
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch

from ..reduction import Kind, Reduction, divide_
from ..topology import Topology
from .base import DeviceCommunicatorBase
from .gloo import GlooCommunicator

# How each op combines across stages: (within a host, across leaders).
_SUM = Reduction(Kind.SUM)


class HierarchicalCommunicator(GlooCommunicator):
    """Two-level collectives: ``local`` per host, ``leaders`` across hosts."""

    name = "hierarchical"

    def __init__(
        self,
        cpu_group,
        topology: Topology,
        local: DeviceCommunicatorBase,
        leaders: Optional[DeviceCommunicatorBase],
        timeout: Optional[timedelta] = None,
        unique_name: str = "",
    ) -> None:
        super().__init__(cpu_group, torch.device("cpu"), None, unique_name, timeout)
        self.topology = topology
        self.local = local
        self.leaders = leaders

    def _parts(self) -> List[DeviceCommunicatorBase]:
        return [self.local] + ([self.leaders] if self.leaders is not None else [])

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        for part in self._parts():
            part.set_timeout(timeout)

    def _use_op_timeout(self, timeout: Optional[timedelta]) -> None:
        super()._use_op_timeout(timeout)
        for part in self._parts():
            part._use_op_timeout(timeout)

    def _stages(self, reduction: Reduction):
        if reduction.kind == Kind.AVG:
            return _SUM, _SUM
        if reduction.kind == Kind.PREMUL_SUM:
            return reduction, _SUM
        return reduction, reduction

    def all_reduce_(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        inner, outer = self._stages(reduction)
        self.local.reduce_(tensor, 0, inner)
        if self.leaders is not None:
            self.leaders.all_reduce_(tensor, outer)
        self.local.broadcast_(tensor, 0)
        if reduction.kind == Kind.AVG:
            divide_(tensor, self.world_size)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        result = tensor.clone()
        self.all_reduce_(result, reduction)
        if self.rank_in_group == dst:
            tensor.copy_(result)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        topo = self.topology
        src_host = topo.host_of(src)
        if topo.host_index == src_host:
            self.local.broadcast_(tensor, topo.hosts[src_host].index(src))
        if self.leaders is not None:
            self.leaders.broadcast_(tensor, src_host)
        if topo.host_index != src_host:
            self.local.broadcast_(tensor, 0)

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        self.all_gatherv_into(output, input_, [input_.numel()] * self.world_size)

    def all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: List[int]) -> None:
        topo = self.topology
        host_sizes = [[sizes[r] for r in ranks] for ranks in topo.hosts]
        # 1. every rank of the host gets the host's block (shared memory)
        mine = host_sizes[topo.host_index]
        block = input_.new_empty(sum(mine))
        self.local.all_gatherv_into(block, input_, mine)
        # 2. leaders swap host blocks; 3. each leader hands the result to its host
        gathered = input_.new_empty(sum(sizes))
        if self.leaders is not None:
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
            output[out_at:out_at + sizes[r]].copy_(gathered[offsets[r]:offsets[r] + sizes[r]])
            out_at += sizes[r]

    def barrier(self) -> None:
        self.local.barrier()
        if self.leaders is not None:
            self.leaders.barrier()
        self.local.barrier()

    def abort(self) -> None:
        super().abort()  # the waits and posted send/recv on the whole group's cpu_group
        for part in self._parts():
            part.abort()

    def destroy(self) -> None:
        for part in self._parts():
            part.destroy()
