"""GROUPCOMM_DEBUG=1: before each collective the ranks compare what they were
asked to do (op, reduce op, dtypes, shapes, root, splits) and, where calls
differ, every rank raises a GroupCommError naming the mismatching ranks and
each rank's call, instead of hanging or silently mixing up data. Installed on
the group's frontend (a CheckedFrontend instead of a C10dFrontend) when its
group is created; costs nothing when off."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch

from ..communicators.base import DeviceCommunicatorBase
from ..errors import GroupCommError
from ..reduction import Kind, Reduction
from .frontend import C10dFrontend

Tensors = list[torch.Tensor]
_MAX = Reduction(Kind.MAX)
_SUM = Reduction(Kind.SUM)


class _Call:
    """What one rank was asked to do, as the ranks compare it.

    ``key`` must be equal on every rank of a well-formed call, so it leaves out
    what legitimately differs between ranks (the root's gather list, a rank's
    share of an uneven all-gather); ``detail`` adds that for the message.
    All-to-all sizes differ per rank by nature: ``sends[j]``/``recvs[j]`` are
    the elements this rank sends to / expects from rank ``j``, checked pairwise.
    """

    __slots__ = ("key", "detail", "sends", "recvs", "refused")

    def __init__(
        self, key: str, detail: str = "", sends: list[int] | None = None, recvs: list[int] | None = None
    ) -> None:
        self.key = key
        self.detail = detail
        self.sends = sends
        self.recvs = recvs
        self.refused = ""

    def text(self) -> str:
        text = f"{self.key} {self.detail}" if self.detail else self.key
        return f"{text} (refused there: {self.refused})" if self.refused else text

    def digest(self) -> int:
        key = f"{self.key}\0refused" if self.refused else self.key
        return _int64(key)

    def balance(self, rank: int) -> int:
        """This rank's term of a sum over all ranks that is 0 exactly when every
        rank sends each peer as many elements as that peer expects from it
        (but for a 63-bit hash collision)."""
        if self.refused or self.sends is None or self.recvs is None:
            return 0
        total = sum(_int64(f"{rank}>{peer}:{n}") for peer, n in enumerate(self.sends))
        total -= sum(_int64(f"{peer}>{rank}:{n}") for peer, n in enumerate(self.recvs))
        return _signed(total)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "text": self.text(),
            "refused": bool(self.refused),
            "sends": self.sends,
            "recvs": self.recvs,
        }


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _int64(text: str) -> int:
    """A 63-bit hash of ``text``, the same in every process (unlike ``hash``);
    non-negative, so that its negation is an int64 too."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _t(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    text = f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"
    if t.layout != torch.strided:
        text += f" {str(t.layout).replace('torch.', '')}"
    return text if t.device.type == "cpu" else f"{text} on {t.device}"


def _ts(tensors: Sequence[Any]) -> str:
    return ", ".join(_t(t) for t in tensors)


def _kind(reduce_op: Any) -> str:
    try:
        return Reduction.parse(reduce_op).kind.name
    except (TypeError, ValueError):
        return repr(reduce_op)


def _elements(tensor: torch.Tensor, splits: Sequence[int], world: int) -> list[int]:
    """Elements per peer of an all-to-all side (the frontend checks the splits)."""
    if not splits:
        return [tensor.numel() // world] * world
    rows = tensor.shape[0] if tensor.dim() else 1
    row = tensor.numel() // rows if rows else 0
    return [int(s) * row for s in splits]


def _describe_allgather(outputs, inputs, *_, **__) -> _Call:
    # a rank's input is its own entry of the output lists (uneven sizes allowed)
    return _Call("allgather " + " | ".join(f"into [{_ts(outs)}]" for outs in outputs), f"from {_ts(inputs)}")


def _describe_into_tensor(op: str):
    def describe(outputs, inputs, *_, **__) -> _Call:
        pairs = zip(outputs, inputs) if isinstance(outputs, (list, tuple)) else [(outputs, inputs)]
        return _Call(f"{op} " + " | ".join(f"{_t(i)} -> {_t(o)}" for o, i in pairs))

    return describe


def _describe_reduce_scatter(outputs, inputs, reduce_op, *_, **__) -> _Call:
    # a rank's output is its own entry of the input lists (uneven sizes allowed)
    return _Call(
        f"reduce_scatter {_kind(reduce_op)} " + " | ".join(f"from [{_ts(ins)}]" for ins in inputs),
        f"into {_ts(outputs)}",
    )


def _describe_reduce_scatter_tensor(op: str):
    def describe(outputs, inputs, reduce_op, *_, **__) -> _Call:
        pairs = zip(outputs, inputs) if isinstance(outputs, (list, tuple)) else [(outputs, inputs)]
        return _Call(f"{op} {_kind(reduce_op)} " + " | ".join(f"{_t(i)} -> {_t(o)}" for o, i in pairs))

    return describe


def _describe_gather(outputs, inputs, root, *_, **__) -> _Call:
    return _Call(
        f"gather root {root} {_ts(inputs)}", f"into [{_ts([t for ts in outputs for t in ts])}]" if outputs else ""
    )


def _describe_scatter(outputs, inputs, root, *_, **__) -> _Call:
    return _Call(
        f"scatter root {root} {_ts(outputs)}", f"from [{_ts([t for ts in inputs for t in ts])}]" if inputs else ""
    )


def _describers(world: int) -> dict[str, Callable[..., _Call]]:
    """For each collective of the frontend: its arguments -> the rank's ``_Call``."""

    def alltoall_base(output, input_, output_splits, input_splits, *_, **__) -> _Call:
        return _Call(
            f"alltoall_base {str(input_.dtype).replace('torch.', '')}",
            f"input {list(input_.shape)} splits {list(input_splits) or 'even'}, "
            f"output {list(output.shape)} splits {list(output_splits) or 'even'}",
            sends=_elements(input_, input_splits, world),
            recvs=_elements(output, output_splits, world),
        )

    def alltoall(outputs, inputs, *_, **__) -> _Call:
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in list(inputs) + list(outputs)})
        return _Call(
            f"alltoall {', '.join(dtypes)}",
            f"inputs [{_ts(inputs)}], outputs [{_ts(outputs)}]",
            sends=[t.numel() for t in inputs],
            recvs=[t.numel() for t in outputs],
        )

    return {
        "broadcast": lambda tensors, root, *_, **__: _Call(f"broadcast root {root} {_ts(tensors)}"),
        "allreduce": lambda tensors, op, *_, **__: _Call(f"allreduce {_kind(op)} {_ts(tensors)}"),
        "allreduce_coalesced": lambda tensors, op, *_, **__: _Call(f"allreduce_coalesced {_kind(op)} {_ts(tensors)}"),
        "reduce": lambda tensors, op, root, *_, **__: _Call(f"reduce {_kind(op)} root {root} {_ts(tensors)}"),
        "allgather": _describe_allgather,
        "allgather_coalesced": _describe_allgather,
        "_allgather_base": _describe_into_tensor("_allgather_base"),
        "allgather_into_tensor_coalesced": _describe_into_tensor("allgather_into_tensor_coalesced"),
        "gather": _describe_gather,
        "scatter": _describe_scatter,
        "reduce_scatter": _describe_reduce_scatter,
        "_reduce_scatter_base": _describe_reduce_scatter_tensor("_reduce_scatter_base"),
        "reduce_scatter_tensor_coalesced": _describe_reduce_scatter_tensor("reduce_scatter_tensor_coalesced"),
        "alltoall_base": alltoall_base,
        "alltoall": alltoall,
        "barrier": lambda *_, **__: _Call("barrier"),
    }


class CheckedFrontend(C10dFrontend):
    """The frontend under ``GROUPCOMM_DEBUG=1``: the ranks compare every collective before running it.

    Ranks that pass different shapes, dtypes, reduce ops, roots or all-to-all
    sizes to one collective (or call different collectives) would otherwise
    hang or silently exchange garbage; here every rank raises a
    ``GroupCommError`` naming the group, the mismatching ranks and each rank's
    call, and the group stays usable.

    The check runs inside the op's queued task, so it is in op order with the
    group's other work, on the group's CPU communicator: one MAX all-reduce of
    a hash of each rank's call (two int64), plus, for all-to-all, one SUM of a
    term that is 0 when the sizes pair up. Only on a mismatch do the ranks
    gather readable descriptions. A call this rank refuses (bad arguments)
    still takes part in the check, so that its peers learn about it instead of
    waiting in the collective. Send/recv are not checked (they pair up by peer
    and tag, not by order), nor are the coordinator's own calls
    (``get_coordinator(group).all_reduce``...): mixing those with c10d
    collectives in a different order on different ranks is not caught.
    """

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        self._describe = _describers(self.world_size)
        self._local = threading.local()  # the call being issued on this thread

    def native_plan(self) -> bool:
        """Nothing runs without the check: the bridge forwards every call."""
        return False

    def gloo_plan(self) -> bool:
        """As :meth:`native_plan`, on gloo."""
        return False

    def cuda_plan(self) -> bool:
        """As :meth:`native_plan`, on CUDA."""
        return False

    # -- the collectives of ops.COLLECTIVES, each through _checked -------------------

    def broadcast(self, tensors, root, async_op, timeout_ms):
        return self._checked("broadcast", super().broadcast, tensors, root, async_op, timeout_ms)

    def allreduce(self, tensors, reduce_op, async_op, timeout_ms):
        return self._checked("allreduce", super().allreduce, tensors, reduce_op, async_op, timeout_ms)

    def allreduce_coalesced(self, tensors, reduce_op, async_op, timeout_ms):
        return self._checked(
            "allreduce_coalesced", super().allreduce_coalesced, tensors, reduce_op, async_op, timeout_ms
        )

    def reduce(self, tensors, reduce_op, root, async_op, timeout_ms):
        return self._checked("reduce", super().reduce, tensors, reduce_op, root, async_op, timeout_ms)

    def allgather(self, outputs, inputs, async_op, timeout_ms):
        return self._checked("allgather", super().allgather, outputs, inputs, async_op, timeout_ms)

    def _allgather_base(self, output, input_, async_op, timeout_ms):
        return self._checked("_allgather_base", super()._allgather_base, output, input_, async_op, timeout_ms)

    def allgather_coalesced(self, output_lists, inputs, async_op, timeout_ms):
        return self._checked(
            "allgather_coalesced", super().allgather_coalesced, output_lists, inputs, async_op, timeout_ms
        )

    def allgather_into_tensor_coalesced(self, outputs, inputs, async_op, timeout_ms, **kwargs):
        return self._checked(
            "allgather_into_tensor_coalesced",
            super().allgather_into_tensor_coalesced,
            outputs,
            inputs,
            async_op,
            timeout_ms,
            **kwargs,
        )

    def gather(self, outputs, inputs, root, async_op, timeout_ms):
        return self._checked("gather", super().gather, outputs, inputs, root, async_op, timeout_ms)

    def scatter(self, outputs, inputs, root, async_op, timeout_ms):
        return self._checked("scatter", super().scatter, outputs, inputs, root, async_op, timeout_ms)

    def reduce_scatter(self, outputs, inputs, reduce_op, async_op, timeout_ms):
        return self._checked("reduce_scatter", super().reduce_scatter, outputs, inputs, reduce_op, async_op, timeout_ms)

    def _reduce_scatter_base(self, output, input_, reduce_op, async_op, timeout_ms):
        return self._checked(
            "_reduce_scatter_base", super()._reduce_scatter_base, output, input_, reduce_op, async_op, timeout_ms
        )

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, reduce_op, async_op, timeout_ms, **kwargs):
        return self._checked(
            "reduce_scatter_tensor_coalesced",
            super().reduce_scatter_tensor_coalesced,
            outputs,
            inputs,
            reduce_op,
            async_op,
            timeout_ms,
            **kwargs,
        )

    def alltoall_base(self, output, input_, output_splits, input_splits, async_op, timeout_ms):
        return self._checked(
            "alltoall_base", super().alltoall_base, output, input_, output_splits, input_splits, async_op, timeout_ms
        )

    def alltoall(self, outputs, inputs, async_op, timeout_ms):
        return self._checked("alltoall", super().alltoall, outputs, inputs, async_op, timeout_ms)

    def barrier(self, async_op, timeout_ms):
        return self._checked("barrier", super().barrier, async_op, timeout_ms)

    # -- the check ----------------------------------------------------------------------

    def _checked(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method(*args)`` with this rank's description of the call attached,
        for ``_submit`` to check; a refused call takes part in the check too."""
        local = self._local
        if getattr(local, "call", None) is not None:
            return method(*args, **kwargs)  # one collective delegating to another
        try:
            call = self._describe[name](*args)
        except Exception as exc:  # noqa: BLE001 - the description must not fail the call
            call = _Call(f"{name} (arguments not describable: {type(exc).__name__})")
        local.call = call
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            if local.call is call:  # refused before it was queued
                local.call = None
                call.refused = f"{type(exc).__name__}: {exc}"
                self._take_part(call)
            raise
        finally:
            local.call = None

    def _submit(self, op: str, task: Callable[[], Tensors], async_op: bool, route: Any, timeout_ms: int) -> Any:
        call = getattr(self._local, "call", None) or _Call(op)
        self._local.call = None

        def checked_task() -> Tensors:
            self.verify(call)
            return task()

        return super()._submit(op, checked_task, async_op, route, timeout_ms)

    def _take_part(self, call: _Call) -> None:
        """Run a refused call's check, in op order; its outcome does not matter
        here (this rank raises its own error), only to the peers."""
        try:
            self._ops.run(lambda: self.verify(call))
        except Exception:  # noqa: BLE001 - the refusal is what this rank reports
            pass

    def verify(self, call: _Call) -> None:
        """Compare ``call`` with the other ranks' calls; raise GroupCommError on every rank if they differ."""
        comm = self.coordinator.communicator_for(torch.device("cpu"))
        # One MAX all-reduce of (digest, -digest): max == -max(-d) == min exactly
        # when every rank's digest is the same, and every rank sees the same verdict.
        digest = call.digest()
        both = torch.tensor([digest, -digest], dtype=torch.int64)
        comm.all_reduce_(both, _MAX)
        high, negated_low = both.tolist()
        agree = high == -negated_low
        if agree and call.sends is not None and not call.refused:
            # the same all-to-all everywhere: do the sizes pair up?
            balance = torch.tensor([call.balance(self.rank)], dtype=torch.int64)
            comm.all_reduce_(balance, _SUM)  # int64 sums wrap, as the balance terms do
            agree = int(balance) == 0
        if not agree:
            raise GroupCommError(self._explain(call, self._gather(comm, call)), op=call.key.split(" ", 1)[0])

    def _gather(self, comm: DeviceCommunicatorBase, call: _Call) -> list[dict[str, Any]]:
        """Every rank's call, readable (the slow path: only after a mismatch)."""
        world = self.world_size
        data = json.dumps(call.to_json()).encode()
        lengths = torch.empty(world, dtype=torch.int64)
        comm.all_gather_into(lengths, torch.tensor([len(data)], dtype=torch.int64))
        width = int(lengths.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        everyone = torch.empty(world * width, dtype=torch.uint8)
        comm.all_gather_into(everyone, mine)
        rows = everyone.view(world, width)
        return [json.loads(bytes(rows[r, : int(lengths[r])].tolist()).decode()) for r in range(world)]

    def _explain(self, call: _Call, calls: list[dict[str, Any]]) -> str:
        coordinator = self.coordinator
        world = self.world_size
        clusters: dict[str, list[int]] = {}
        for r, c in enumerate(calls):
            clusters.setdefault(c["key"] + ("\0refused" if c["refused"] else ""), []).append(r)
        if len(clusters) > 1:
            sizes = sorted((len(ranks) for ranks in clusters.values()), reverse=True)
            majority = max(clusters.values(), key=len) if sizes[0] > sizes[1] else []
            odd = [r for r in range(world) if r not in majority]
            problem = "the ranks' calls differ"
        else:  # same call everywhere, but all-to-all sizes that do not pair up
            pairs = [
                (src, dst, _nth(c["sends"], dst), _nth(calls[dst]["recvs"], src))
                for src, c in enumerate(calls)
                for dst in range(world)
                if _nth(c["sends"], dst) != _nth(calls[dst]["recvs"], src)
            ]
            odd = sorted({r for src, dst, _, _ in pairs for r in (src, dst)})
            problem = (
                "all-to-all sizes do not match: "
                + "; ".join(
                    f"rank {src} sends {n} elements to rank {dst}, which expects {m}" for src, dst, n, m in pairs[:8]
                )
                + ("; ..." if len(pairs) > 8 else "")
            )
        by_text: dict[str, list[int]] = {}
        for r, c in enumerate(calls):
            by_text.setdefault(c["text"], []).append(r)
        each = "; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in by_text.items())
        where = f"group {coordinator.unique_name!r}"
        if coordinator.ranks != list(range(world)):
            where += f" (global ranks {coordinator.ranks})"
        op = call.key.split(" ", 1)[0]
        return (
            f"groupcomm: {op} on {where} (rank {self.rank} of {world}): GROUPCOMM_DEBUG found a collective "
            f"mismatch, {problem}; mismatching: {_ranks(odd)}. Each rank's call: {each}"
        )


def _nth(sizes: list[int] | None, i: int) -> int | None:
    return sizes[i] if sizes is not None and i < len(sizes) else None


def _ranks(ranks: Sequence[int]) -> str:
    if not ranks:
        return "none identified"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
