"""The coordinator's collectives as torch custom ops, ``torch.ops.groupcomm.*``.

Dynamo cannot pass a coordinator into an op, so each op names its group by
the coordinator's ``unique_name``; a custom op may not both mutate and
return, so each is out of place (as vLLM's ``torch.ops.vllm.all_reduce``)::

    all_reduce(Tensor input, str group_name) -> Tensor
    all_gather(Tensor input, int dim, str group_name) -> Tensor
    all_gatherv(Tensor input, int dim, int[]? sizes, str group_name) -> Tensor
    reduce_scatter(Tensor input, int dim, str group_name) -> Tensor
    reduce_scatterv(Tensor input, int dim, int[]? sizes, str group_name) -> Tensor
    broadcast(Tensor input, int src, str group_name) -> Tensor

One in-place form, ``all_reduce_(Tensor(a!) input, str group_name)``, is
not the coordinator's to call: Inductor's reinplacing pass puts it in a
compiled graph in all_reduce's place where the input is an intermediate
that nothing reads afterwards (as it does for torch's own functional
``all_reduce``), so a compiled model reduces its activations where they lie.

The schemas and kernels live in C++ (``csrc/ops/``): a CPU call on a group
published here (its CPU communicator has a shared-memory engine) runs from
torch's dispatcher straight into that engine, in order with the group's
queued c10d work, without Python. Every other call comes back to
:func:`_python_path`, the coordinator's Python path. This module adds what
tracing needs (the fake implementations: output shapes from the input and
the group's size) and what the C++ side is told once per group.
"""

from __future__ import annotations

import sys

import torch

from ._native import _C
from ._registry import coordinator_named

__all__ = ["ALL_GATHER", "ALL_GATHERV", "ALL_REDUCE", "BROADCAST", "REDUCE_SCATTER", "REDUCE_SCATTERV"]

ALL_REDUCE = torch.ops.groupcomm.all_reduce.default
ALL_REDUCE_IN_PLACE = torch.ops.groupcomm.all_reduce_.default
ALL_GATHER = torch.ops.groupcomm.all_gather.default
ALL_GATHERV = torch.ops.groupcomm.all_gatherv.default
REDUCE_SCATTER = torch.ops.groupcomm.reduce_scatter.default
REDUCE_SCATTERV = torch.ops.groupcomm.reduce_scatterv.default
BROADCAST = torch.ops.groupcomm.broadcast.default

# A collective runs on every rank or on none: a compiled graph must keep each
# call even where its result goes unused (a broadcast's on its source rank),
# or the ranks would no longer pair their calls.
for _op in (ALL_REDUCE, ALL_REDUCE_IN_PLACE, ALL_GATHER, ALL_GATHERV, REDUCE_SCATTER, REDUCE_SCATTERV, BROADCAST):
    torch.fx.node.has_side_effect(_op)


def publish(unique_name: str, engine: object | None, queue: object) -> None:
    """The ops run group ``unique_name``'s CPU calls on ``engine`` (a
    ``_C.ShmGroup``; None: on the Python path), in ``queue``'s order."""
    if engine is None:
        _C.withdraw_ops_group(unique_name, queue)
    else:
        _C.publish_ops_group(unique_name, engine, queue)


def withdraw(unique_name: str, queue: object) -> None:
    """Group ``unique_name`` (if still the one of ``queue``) goes back to the Python path."""
    _C.withdraw_ops_group(unique_name, queue)


def _python_path(op: str, group_name: str, input_: torch.Tensor, *args) -> torch.Tensor:
    """Run a call the C++ kernel did not on the coordinator's Python path;
    the result is a new contiguous tensor, as the fake implementations say."""
    out = coordinator_named(group_name).python_path(op, input_, *args)
    if not out.is_contiguous() or _aliases(out, input_):
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_C.set_ops_python_path(_python_path)


# -- fake implementations: the output's shape, for tracing --------------------------------


def _rows_dim(input_: torch.Tensor, dim: int) -> tuple[list, int]:
    """The input's shape (a scalar as one row) and ``dim`` counted from the front."""
    shape = list(input_.shape) or [1]
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"groupcomm: dim {dim} is out of range for a tensor of shape {tuple(input_.shape)}")
    return shape, dim % len(shape)


def _even_rows(rows, world: int, rank: int):
    return rows // world + (1 if rank < rows % world else 0)


@torch.library.register_fake("groupcomm::all_reduce")
def _all_reduce_fake(input_: torch.Tensor, group_name: str) -> torch.Tensor:
    _offer_in_place_to_inductor()
    return input_.new_empty(input_.shape)


@torch.library.register_fake("groupcomm::all_reduce_")
def _all_reduce_in_place_fake(input_: torch.Tensor, group_name: str) -> torch.Tensor:
    return input_


def _offer_in_place_to_inductor() -> None:
    """Tell Inductor's reinplacing pass that all_reduce_ may stand in for
    all_reduce. Done while a graph is traced, once Inductor is loaded (a
    compile loads it before its passes run): importing it here would cost
    every user of the package seconds. The table is private to Inductor; a
    torch without it keeps the out-of-place op, still correct."""
    reinplace = sys.modules.get("torch._inductor.fx_passes.reinplace")
    table = getattr(reinplace, "inplaceable_ops", None)
    if table is None or ALL_REDUCE in table or not hasattr(reinplace, "InplaceableOp"):
        return
    table[ALL_REDUCE] = reinplace.InplaceableOp(ALL_REDUCE_IN_PLACE, 0)


@torch.library.register_fake("groupcomm::all_gather")
def _all_gather_fake(input_: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape, dim = _rows_dim(input_, dim)
    shape[dim] = shape[dim] * coordinator_named(group_name).world_size
    return input_.new_empty(shape)


@torch.library.register_fake("groupcomm::all_gatherv")
def _all_gatherv_fake(input_: torch.Tensor, dim: int, sizes: list[int] | None, group_name: str) -> torch.Tensor:
    shape, dim = _rows_dim(input_, dim)
    shape[dim] = sum(sizes) if sizes is not None else shape[dim] * coordinator_named(group_name).world_size
    return input_.new_empty(shape)


@torch.library.register_fake("groupcomm::reduce_scatter")
def _reduce_scatter_fake(input_: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape, dim = _rows_dim(input_, dim)
    shape[dim] = shape[dim] // coordinator_named(group_name).world_size
    return input_.new_empty(shape)


@torch.library.register_fake("groupcomm::reduce_scatterv")
def _reduce_scatterv_fake(input_: torch.Tensor, dim: int, sizes: list[int] | None, group_name: str) -> torch.Tensor:
    shape, dim = _rows_dim(input_, dim)
    coordinator = coordinator_named(group_name)
    rank = coordinator.rank_in_group
    shape[dim] = sizes[rank] if sizes is not None else _even_rows(shape[dim], coordinator.world_size, rank)
    return input_.new_empty(shape)


@torch.library.register_fake("groupcomm::broadcast")
def _broadcast_fake(input_: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    return input_.new_empty(input_.shape)
