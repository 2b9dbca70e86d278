"""A coordinator's tensor calls, out of place unless said: its collectives
call the custom ops ``torch.ops.groupcomm.*`` (``custom_ops.py``), so that
eager and compiled code take one route: on a shared-memory group the op runs
in C++; elsewhere it comes back to :meth:`Collectives.python_path`.
Point-to-point calls and barriers run in order with the group's queued work
too."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch._C import _distributed_c10d as c10d

from .. import custom_ops
from ..staging import Staged


class Collectives:
    """vLLM's tensor collectives, send/recv and barriers over a
    ``GroupCoordinator``'s group (a base of it)."""

    def _on_device(self, method: str, input_: torch.Tensor, *args):
        """``input_``'s communicator's ``method`` run in order (``input_``
        itself in a group of one)."""
        if self.world_size == 1:
            return input_
        comm = self.communicator_for(input_.device)
        return self._run(lambda: getattr(comm, method)(input_, *args))

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the group, as a new tensor."""
        if self.world_size == 1:
            return input_
        return custom_ops.ALL_REDUCE(input_, self.unique_name)

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim`` in rank order."""
        dim = self._check_dim(input_, dim)
        if self.world_size == 1:
            return input_
        return custom_ops.ALL_GATHER(input_, dim, self.unique_name)

    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        return self.all_gather(input_, dim)

    def all_gatherv(
        self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Concatenate along ``dim`` where rank i holds ``sizes[i]`` rows
        (equal rows when None); a list of tensors gathers each of them."""
        if isinstance(input_, (list, tuple)):
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        dim, sizes = self._check_ragged("all_gatherv", input_, dim, sizes)
        if self.world_size == 1:
            return input_
        return custom_ops.ALL_GATHERV(input_, dim, sizes, self.unique_name)

    def _check_ragged(
        self, op: str, input_: torch.Tensor, dim: int, sizes: list[int] | None
    ) -> tuple[int, list[int] | None]:
        """``dim`` and ``sizes`` of an all_gatherv or reduce_scatterv, checked
        (all_gatherv's size for this rank must be its input's rows)."""
        dim = self._check_dim(input_, dim)
        if sizes is None:
            return dim, None
        sizes = [int(n) for n in sizes]
        if len(sizes) != self.world_size:
            raise ValueError(f"groupcomm: {op} got {len(sizes)} sizes for {self.world_size} ranks")
        mine = sizes[self.rank_in_group]
        if op == "all_gatherv" and input_.dim() and mine != input_.shape[dim]:
            raise ValueError(
                f"groupcomm: all_gatherv size for rank {self.rank_in_group} is {mine}, "
                f"but the input has {input_.shape[dim]} along dim {dim}"
            )
        return dim, sizes

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group; this rank keeps its equal slice along ``dim``."""
        dim = self._check_dim(input_, dim)
        if self.world_size == 1:
            return input_
        return custom_ops.REDUCE_SCATTER(input_, dim, self.unique_name)

    def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        return self.reduce_scatter(input_, dim)

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Sum over the group; rank i keeps ``sizes[i]`` rows along ``dim``."""
        dim, sizes = self._check_ragged("reduce_scatterv", input_, dim, sizes)
        if self.world_size == 1:
            return input_
        return custom_ops.REDUCE_SCATTERV(input_, dim, sizes, self.unique_name)

    def python_path(self, op: str, input_: torch.Tensor, *args) -> torch.Tensor:
        """Run custom op ``op``'s call (``custom_ops.py``) on the group's
        communicator from Python: what the C++ kernel leaves (no
        shared-memory engine, another device, a dtype or shape it declines).
        Checks the arguments as the method of that name does."""
        if op == "broadcast":
            (src,) = args
            self._check_rank("broadcast src", src)
            out = input_.clone(memory_format=torch.contiguous_format)
            if self.world_size > 1:
                self._broadcast_in_place(out, src)
            return out
        if op == "all_reduce":
            return self._on_device("all_reduce", input_)
        if op in ("all_gather", "reduce_scatter"):
            return self._on_device(op, input_, self._check_dim(input_, args[0]))
        if op in ("all_gatherv", "reduce_scatterv"):
            return self._on_device(op, input_, *self._check_ragged(op, input_, *args))
        raise ValueError(f"groupcomm: no custom op {op!r}")

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``input_`` concatenated along ``dim`` on ``dst`` (a rank
        in the group); None on the others."""
        self._check_rank("gather dst", dst)
        dim = self._check_dim(input_, dim)
        return self._on_device("gather", input_, dst, dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``input_`` with ``src``'s (a rank in the group); returns it."""
        self._check_rank("broadcast src", src)
        if self.world_size == 1:
            return input_
        out = custom_ops.BROADCAST(input_, src, self.unique_name)
        if self.rank_in_group != src:
            input_.copy_(out)
        return input_

    def _broadcast_in_place(self, input_: torch.Tensor, src: int) -> None:
        comm = self.communicator_for(input_.device)

        def task() -> None:
            staged = Staged(input_)
            comm.broadcast_(staged.flat, src)
            staged.commit()

        self._run(task)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to ``dst`` (default: the next rank), blocking."""
        dst = self._check_peer("send dst", (self.rank_in_group + 1) % self.world_size if dst is None else dst)
        comm = self.p2p_communicator_for(tensor.device)
        self._run(lambda: comm.send(tensor, dst))

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a ``size``/``dtype`` tensor from ``src`` (default: the previous rank)."""
        src = self._check_peer("recv src", (self.rank_in_group - 1) % self.world_size if src is None else src)
        comm = self.p2p_communicator_for(self.device)
        return self._run(lambda: comm.recv(size, dtype, src))

    def barrier(self) -> None:
        """Synchronise the group's ranks on the cpu_group (never on a device)."""
        opts = c10d.BarrierOptions()
        opts.timeout = self.timeout
        self.check_formed()
        self._run(lambda: self.cpu_group.barrier(opts).wait())

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier on the cpu_group, after the group's queued
        ops: rank 0 raises naming the first rank that did not arrive within
        ``timeout`` (the group's when None), every such rank with
        ``wait_all_ranks``; the others raise when rank 0 does not release them
        in time. Works on any torch, for any coordinator."""
        self.check_formed()
        self._run(lambda: self.cpu_group.monitored_barrier(timeout or self.timeout, wait_all_ranks))
