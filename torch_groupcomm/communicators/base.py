"""The interface every device communicator implements.

A communicator moves data among the ranks of one group on one kind of device.
It knows nothing about c10d: it sees flat (1-D, contiguous) tensors and plain
ranks within the group. Subclasses implement the data-movement primitives; the
reductions and the uneven variants have default implementations built on them,
which a faster communicator overrides where it can do better.

The out-of-place methods (``all_reduce``, ``all_gather(dim)``, ...) follow
vLLM's ``DeviceCommunicatorBase`` so that code written against it reads the same.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Protocol

import torch

from ..errors import unsupported
from ..reduction import Kind, Reduction, reduce_stacked

# Up to this many bytes an all-reduce gathers everything and reduces locally
# (one round trip); above it, reduce-scatter + all-gather. The shared-memory
# kernels switch at the same size (kDirectReduceBytes in csrc/shm/group.cpp).
SMALL_ALL_REDUCE_BYTES = 16 << 10


class Transfer(Protocol):
    """A posted point-to-point transfer."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class DoneTransfer:
    """A transfer with nothing left to do (e.g. zero bytes)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def even_sizes(numel: int, world_size: int) -> list[int]:
    """Split ``numel`` elements into ``world_size`` near-equal parts."""
    base, extra = divmod(numel, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


def even_pieces(numel: int, count: int) -> list[tuple[int, int]]:
    """(start, stop) of ``count`` consecutive pieces of ``numel`` elements,
    sized as ``even_sizes`` sizes them."""
    bounds = [0]
    for size in even_sizes(numel, count):
        bounds.append(bounds[-1] + size)
    return list(zip(bounds[:-1], bounds[1:]))


class DeviceCommunicatorBase:
    """Collectives for one group on one device type."""

    name = "base"
    _op_timeout: timedelta | None = None

    def __init__(
        self,
        cpu_group,
        device: torch.device | None = None,
        device_group=None,
        unique_name: str = "",
        timeout: timedelta | None = None,
    ) -> None:
        self.cpu_group = cpu_group
        self.device = device if device is not None else torch.device("cpu")
        self.device_group = device_group
        self.unique_name = unique_name
        self.timeout = timeout
        self.rank_in_group = cpu_group.rank()
        self.world_size = cpu_group.size()

    # -- timeouts ----------------------------------------------------------------

    def set_timeout(self, timeout: timedelta) -> None:
        """The ops issued from now on use ``timeout`` (``dist.set_timeout``)."""
        self.timeout = timeout

    @contextlib.contextmanager
    def op_timeout(self, timeout: timedelta | None) -> Iterator[None]:
        """The ops run inside use ``timeout`` instead of the group's (c10d's
        per-op ``opts.timeout``; None: no change). A group runs one op at a time."""
        if timeout is None:
            yield
            return
        self._use_op_timeout(timeout)
        try:
            yield
        finally:
            self._use_op_timeout(None)

    def _use_op_timeout(self, timeout: timedelta | None) -> None:
        self._op_timeout = timeout

    def current_timeout(self) -> timedelta | None:
        """The timeout of the op running now."""
        return self._op_timeout if self._op_timeout is not None else self.timeout

    # -- primitives: flat tensors, equal dtypes --------------------------------

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        """Overwrite ``tensor`` on every rank with ``src``'s."""
        raise unsupported("broadcast", self.name)

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """``output`` (world * n) receives every rank's ``input_`` (n) in rank order."""
        raise unsupported("all_gather", self.name)

    def all_to_all_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_sizes: list[int],
        input_sizes: list[int],
    ) -> None:
        """Rank i's ``input_sizes[j]`` elements go to rank j, landing in order."""
        raise unsupported("all_to_all", self.name)

    def all_to_all_even_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """All-to-all of equal blocks, called alike by every rank (c10d's
        all_to_all_single without split sizes), so that a communicator may
        move it otherwise than per-rank sizes allow."""
        sizes = [input_.numel() // self.world_size] * self.world_size
        self.all_to_all_into(output, input_, sizes, sizes)

    def gather_into(self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, dst: int) -> None:
        """``dst``'s ``outputs[i]`` receives rank i's ``input_`` (None elsewhere)."""
        raise unsupported("gather", self.name)

    def gatherv_into(
        self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, sizes: list[int], dst: int
    ) -> None:
        """``gather_into`` where rank i's ``input_`` has ``sizes[i]``
        elements (every rank passes the same sizes)."""
        self.gather_into(outputs, input_, dst)

    def scatter_from(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, src: int) -> None:
        """Rank i's ``output`` receives ``src``'s ``inputs[i]`` (None elsewhere)."""
        raise unsupported("scatter", self.name)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Transfer:
        """Post a send; the handle's ``wait()`` returns once it is done."""
        raise unsupported("send", self.name)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Transfer:
        """Post a receive into ``tensor``."""
        raise unsupported("recv", self.name)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Receive from whichever rank sends first; return its rank."""
        raise unsupported("recv from any source", self.name)

    def barrier(self) -> None:
        """Return once every rank of the group has called it."""
        raise unsupported("barrier", self.name)

    # -- derived collectives ----------------------------------------------------

    def all_gatherv_into(self, output: torch.Tensor, input_: torch.Tensor, sizes: list[int]) -> None:
        """All-gather where rank i contributes ``sizes[i]`` elements."""
        if len(set(sizes)) <= 1:
            self.all_gather_into(output, input_)
            return
        width = max(sizes)
        padded = input_.new_zeros(width)
        padded[: input_.numel()].copy_(input_)
        gathered = input_.new_empty(width * self.world_size)
        self.all_gather_into(gathered, padded)
        rows = gathered.view(self.world_size, width)
        torch.cat([rows[i, :n] for i, n in enumerate(sizes)], out=output)

    def reduce_scatterv_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        sizes: list[int],
        reduction: Reduction,
    ) -> None:
        """Reduce ``input_`` (sum(sizes)) across ranks; rank i keeps slice i."""
        mine = sizes[self.rank_in_group]
        received = input_.new_empty(mine * self.world_size)
        self.all_to_all_into(received, input_, [mine] * self.world_size, sizes)
        reduce_stacked(received.view(self.world_size, mine), reduction, output)

    def all_reduce_(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        """Reduce ``tensor`` across ranks, in place, same result on every rank."""
        world = self.world_size
        numel = tensor.numel()
        if world == 1 or tensor.nbytes <= SMALL_ALL_REDUCE_BYTES:
            gathered = tensor.new_empty(numel * world)
            self.all_gather_into(gathered, tensor)
            reduce_stacked(gathered.view(world, numel), reduction, tensor)
            return
        sizes = even_sizes(numel, world)
        part = tensor.new_empty(sizes[self.rank_in_group])
        self.reduce_scatterv_into(part, tensor, sizes, reduction)
        self.all_gatherv_into(tensor, part, sizes)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        """Reduce ``tensor`` across ranks into ``dst``'s ``tensor``; others keep theirs."""
        numel = tensor.numel()
        if self.rank_in_group == dst:
            gathered = tensor.new_empty(self.world_size, numel)
            self.gather_into(list(gathered.unbind(0)), tensor, dst)
            reduce_stacked(gathered, reduction, tensor)
        else:
            self.gather_into(None, tensor, dst)

    # -- vLLM-style out-of-place API ---------------------------------------------

    def all_reduce(self, input_: torch.Tensor, op: object = Kind.SUM) -> torch.Tensor:
        """Return the sum (or ``op``) of ``input_`` over the group."""
        out = input_.contiguous().clone()
        self.all_reduce_(out.view(-1), Reduction.parse(op))
        return out.view(input_.shape)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim``."""
        return self.all_gatherv(input_, dim % max(input_.dim(), 1), None)

    def all_gatherv(self, input_: torch.Tensor, dim: int = 0, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate along ``dim`` where rank i holds ``sizes[i]`` rows."""
        world = self.world_size
        moved = input_.movedim(dim, 0).contiguous()
        rows = list(sizes) if sizes is not None else [moved.shape[0]] * world
        row_numel = math.prod(moved.shape[1:])
        out = moved.new_empty((sum(rows),) + tuple(moved.shape[1:]))
        self.all_gatherv_into(out.view(-1), moved.view(-1), [r * row_numel for r in rows])
        return out.movedim(0, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's slice along ``dim``."""
        dim = dim % max(input_.dim(), 1)
        if input_.shape[dim] % self.world_size:
            raise ValueError(
                f"groupcomm: reduce_scatter needs dim {dim} ({input_.shape[dim]}) divisible by world size {self.world_size}"
            )
        return self.reduce_scatterv(input_, dim, None)

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Sum over the group; rank i keeps ``sizes[i]`` rows along ``dim``."""
        dim = dim % max(input_.dim(), 1)
        moved = input_.movedim(dim, 0).contiguous()
        rows = list(sizes) if sizes is not None else even_sizes(moved.shape[0], self.world_size)
        if sum(rows) != moved.shape[0]:
            raise ValueError(f"groupcomm: reduce_scatterv sizes {rows} do not add up to {moved.shape[0]}")
        row_numel = math.prod(moved.shape[1:])
        out = moved.new_empty((rows[self.rank_in_group],) + tuple(moved.shape[1:]))
        self.reduce_scatterv_into(out.view(-1), moved.view(-1), [r * row_numel for r in rows], Reduction(Kind.SUM))
        return out.movedim(0, dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere."""
        dim = dim % max(input_.dim(), 1)
        flat = input_.contiguous().view(-1)
        if self.rank_in_group != dst:
            self.gather_into(None, flat, dst)
            return None
        gathered = flat.new_empty(self.world_size, flat.numel())
        self.gather_into(list(gathered.unbind(0)), flat, dst)
        return torch.cat([g.view(input_.shape) for g in gathered.unbind(0)], dim=dim)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to ``dst`` (default: the next rank), blocking."""
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        self.isend(tensor.contiguous().view(-1), dst).wait()

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a tensor of ``size``/``dtype`` from ``src`` (default: the previous rank)."""
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        out = torch.empty(size, dtype=dtype, device=self.device)
        self.irecv(out.view(-1), src).wait()
        return out

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Hook for communicators that pre-register model buffers; nothing by default."""

    def dispatch(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, *args, **kwargs):
        """Expert-parallel dispatch; identity in the base communicator."""
        return hidden_states, router_logits

    def combine(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Expert-parallel combine; identity in the base communicator."""
        return hidden_states

    def native_engine(self) -> object | None:
        """The C++ engine that may run this communicator's plain synchronous
        collectives without Python (``_C.ShmGroup``), or None."""
        return None

    def gloo_path(self, queue: object) -> object | None:
        """The C++ path that may run some of this communicator's CPU ops on
        its gloo group without Python, in ``queue``'s order
        (``_C.GlooPath``), or None."""
        return None

    def native_path(self, queue: object | None = None) -> None | bool | object:
        """The C++ path that may enqueue this device communicator's plain
        collectives without Python, in ``queue``'s order (CUDA:
        ``_C.NcclPath``); False when it has none, None while it cannot tell yet."""
        return False

    def share_storage(self, tensor: torch.Tensor) -> bool:
        """Move ``tensor``'s storage where the peers read it in place, if this
        communicator has such memory (see ``GroupCoordinator.share_storage``)."""
        return False

    def abort(self) -> None:
        """Make calls blocked in this communicator (on any thread) fail now;
        the communicator is unusable afterwards. Gloo's own waits end with
        the group's timeout or when a peer's connection drops."""

    def disconnect(self) -> None:
        """Give up on the group after this rank's op on it failed: what
        ``abort()`` does, and the peers blocked on this rank fail now rather
        than at their timeout. Called on the thread whose op failed."""
        self.abort()

    def destroy(self) -> None:
        """Release what the communicator holds (nothing by default)."""
