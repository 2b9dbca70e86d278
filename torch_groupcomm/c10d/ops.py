"""The op contract: every call the C++ bridge (``csrc/bridge/backend.cpp``)
makes on the frontend, declared once.

A row says which ``c10d::Backend`` method it serves, the frontend method it
calls with which positional arguments, what comes back, and the communicator
primitive that does the work. ``tests/test_op_contract.py`` holds the bridge,
the frontend, the debug check and the communicators to these rows, so adding
an op is one row here, its primitive, and the code each of them names.

Arguments, as the bridge passes them:

- ``tensors``/``outputs``/``inputs``/``output``/``input_``: c10d's own
  tensors and tensor lists, in c10d's layout;
- ``reduce_op``: a ReduceOp as ``(RedOpType value, premul factor or None)``;
- ``root``/``dst``/``src``: a rank of the group; ``tag``: send/recv's tag;
  ``ranks``: ranks of the group; ``store``: a c10d Store; ``name``: a group's name;
- ``handles``: reconfigure handles (``membership.py``), ``ordered`` whether
  their order gives the ranks, ``uuid`` the reconfigure's;
- ``async_op``: whether the caller asked for ``async_op=True`` (a
  synchronous call may run on the caller's thread);
- ``timeout_ms``: the op's timeout (c10d's ``opts.timeout``), -1 for the
  group's; ``set_timeout``'s is the group's new one.
"""

from __future__ import annotations

from typing import NamedTuple

# What the frontend answers (the bridge makes a c10d Work of it).
RESULT = "the output tensors, or a torch Future of them"
RESULT_AND_SOURCE = "(the output tensors or a Future of them, the sender's rank)"
NOTHING = "None"
NATIVE_PLAN = (
    "(C++ engine, op queue, whether send/recv use the engine) the bridge may run ops on; False: none; None: ask again"
)
CUDA_PLAN = "the NCCL communicator's C++ path (_C.NcclPath); False: none; None: ask again"
GLOO_PLAN = "the gloo communicator's C++ path (_C.GlooPath); False: none; None: ask again"


class Op(NamedTuple):
    """One op of the contract."""

    cxx: str  # the c10d::Backend method the bridge overrides
    name: str  # the frontend method it calls
    params: tuple[str, ...]  # that method's positional parameters, in order
    returns: str
    op_type: str | None  # the c10d::OpType of its Work (None: it makes no Work)
    primitive: str | None  # the DeviceCommunicatorBase method doing the work
    collective: bool = True  # every rank takes part (compared under GROUPCOMM_DEBUG)


OPS: tuple[Op, ...] = (
    Op("broadcast", "broadcast", ("tensors", "root", "async_op", "timeout_ms"), RESULT, "BROADCAST", "broadcast_"),
    Op(
        "allreduce", "allreduce", ("tensors", "reduce_op", "async_op", "timeout_ms"), RESULT, "ALLREDUCE", "all_reduce_"
    ),
    Op(
        "allreduce_coalesced",
        "allreduce_coalesced",
        ("tensors", "reduce_op", "async_op", "timeout_ms"),
        RESULT,
        "ALLREDUCE_COALESCED",
        "all_reduce_",
    ),
    Op("reduce", "reduce", ("tensors", "reduce_op", "root", "async_op", "timeout_ms"), RESULT, "REDUCE", "reduce_"),
    Op(
        "allgather",
        "allgather",
        ("outputs", "inputs", "async_op", "timeout_ms"),
        RESULT,
        "ALLGATHER",
        "all_gatherv_into",
    ),
    Op(
        "_allgather_base",
        "_allgather_base",
        ("output", "input_", "async_op", "timeout_ms"),
        RESULT,
        "_ALLGATHER_BASE",
        "all_gather_into",
    ),
    Op(
        "allgather_coalesced",
        "allgather_coalesced",
        ("output_lists", "inputs", "async_op", "timeout_ms"),
        RESULT,
        "ALLGATHER_COALESCED",
        "all_gatherv_into",
    ),
    Op(
        "allgather_into_tensor_coalesced",
        "allgather_into_tensor_coalesced",
        ("outputs", "inputs", "async_op", "timeout_ms"),
        RESULT,
        "COALESCED",
        "all_gather_into",
    ),
    Op("gather", "gather", ("outputs", "inputs", "root", "async_op", "timeout_ms"), RESULT, "GATHER", "gather_into"),
    Op(
        "scatter", "scatter", ("outputs", "inputs", "root", "async_op", "timeout_ms"), RESULT, "SCATTER", "scatter_from"
    ),
    Op(
        "reduce_scatter",
        "reduce_scatter",
        ("outputs", "inputs", "reduce_op", "async_op", "timeout_ms"),
        RESULT,
        "REDUCE_SCATTER",
        "reduce_scatterv_into",
    ),
    Op(
        "_reduce_scatter_base",
        "_reduce_scatter_base",
        ("output", "input_", "reduce_op", "async_op", "timeout_ms"),
        RESULT,
        "_REDUCE_SCATTER_BASE",
        "reduce_scatterv_into",
    ),
    Op(
        "reduce_scatter_tensor_coalesced",
        "reduce_scatter_tensor_coalesced",
        ("outputs", "inputs", "reduce_op", "async_op", "timeout_ms"),
        RESULT,
        "COALESCED",
        "reduce_scatterv_into",
    ),
    Op(
        "alltoall_base",
        "alltoall_base",
        ("output", "input_", "output_splits", "input_splits", "async_op", "timeout_ms"),
        RESULT,
        "ALLTOALL_BASE",
        "all_to_all_into",
    ),
    Op("alltoall", "alltoall", ("outputs", "inputs", "async_op", "timeout_ms"), RESULT, "ALLTOALL", "all_to_all_into"),
    Op("barrier", "barrier", ("async_op", "timeout_ms"), RESULT, "BARRIER", "barrier"),
    Op("send", "send", ("tensors", "dst", "tag"), RESULT, "SEND", "isend", collective=False),
    Op("recv", "recv", ("tensors", "src", "tag"), RESULT, "RECV", "irecv", collective=False),
    Op(
        "recvAnysource",
        "recv_anysource",
        ("tensors", "tag"),
        RESULT_AND_SOURCE,
        "RECVANYSOURCE",
        "recv_any",
        collective=False,
    ),
    # gloo's monitored barrier, run on the group's gloo cpu_group (no communicator primitive)
    Op(
        "monitoredBarrier", "monitored_barrier", ("timeout_ms", "wait_all_ranks"), NOTHING, None, None, collective=False
    ),
    # asked after each forwarded op until decided: what the bridge runs itself (csrc/bridge/native.*)
    Op("learnNativePlan", "native_plan", (), NATIVE_PLAN, None, None, collective=False),
    # likewise on gloo: the ops of a group carried by gloo that the bridge runs on it (csrc/bridge/gloo_path.*)
    Op("learnGlooPlan", "gloo_plan", (), GLOO_PLAN, None, None, collective=False),
    # likewise for CUDA: the NCCL communicator's plain collectives (csrc/bridge/nccl_path.*)
    Op("learnCudaPlan", "cuda_plan", (), CUDA_PLAN, None, None, collective=False),
    # the first op of a coalescing batch (batch_isend_irecv) that reaches Python, then the batch's end:
    # the CUDA sends and receives in between are launched as one NCCL group at the end
    Op("openBatch", "start_coalescing", (), NOTHING, None, None, collective=False),
    Op("endCoalescing", "end_coalescing", (), NOTHING, "COALESCED", None, collective=False),
    # dist.shrink_group: (new rank, new size, frontend of the survivors' group)
    Op(
        "shrink",
        "shrink",
        ("excluded", "flags", "timeout_ms"),
        "(rank, size, frontend) of the shrunk group",
        None,
        None,
        collective=False,
    ),
    # dist.split_group on a rank of the new group: (its rank, size, frontend); then the parent's timeout
    Op(
        "split",
        "split",
        ("store", "ranks", "name", "timeout_ms"),
        "(rank, size, frontend) of the split group",
        None,
        None,
        collective=False,
    ),
    # dist._get_reconfigure_handle (torch 2.14.1+): this process in this generation of the group
    Op("get_reconfigure_handle", "reconfigure_handle", (), "the handle, a str", None, None, collective=False),
    # dist._reconfigure (torch 2.14.1+): checks the handles and claims the uuid, then the bridge calls what it
    # returns to replace this generation with the group of those handles
    Op(
        "reconfigure",
        "reconfigure",
        ("handles", "ordered", "uuid", "timeout_ms"),
        "a callable giving (rank, size, frontend) of the group formed anew",
        "UNKNOWN",
        None,
        collective=False,
    ),
    Op("getBackendOptions", "current_timeout", (), "the group's timeout in ms", None, None, collective=False),
    # torch names the group (ProcessGroup::setGroupName): its coordinator is found under that name
    Op("setGroupUid", "named", ("name",), NOTHING, None, None, collective=False),
    # dist.set_timeout: the group's timeout for the ops issued from now on
    Op("setTimeout", "set_timeout", ("timeout_ms",), NOTHING, None, None, collective=False),
    Op("abort", "abort", (), NOTHING, None, None, collective=False),
    Op("shutdown", "shutdown", (), NOTHING, None, None, collective=False),
)

BY_NAME = {op.name: op for op in OPS}
COLLECTIVES = tuple(op.name for op in OPS if op.collective)
