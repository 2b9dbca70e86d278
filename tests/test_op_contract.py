"""The op contract (torch_groupcomm/c10d/ops.py) holds: every call the C++
bridge makes on the frontend is a declared op, with the declared arguments
and c10d OpType; every declared op has a frontend method taking exactly
those arguments, a communicator primitive, and, for a collective, a
GROUPCOMM_DEBUG describer and a checked method. Nothing here communicates:
the other tests run the ops."""

from __future__ import annotations

import inspect
import os
import re

from torch_groupcomm.c10d import ops
from torch_groupcomm.c10d.debug_check import CheckedFrontend, _describers
from torch_groupcomm.c10d.frontend import C10dFrontend
from torch_groupcomm.communicators.base import DeviceCommunicatorBase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRIDGE = os.path.join(ROOT, "csrc", "bridge", "backend.cpp")
HEADER = os.path.join(ROOT, "csrc", "bridge", "backend.h")


def _top_level_commas(text: str) -> int:
    depth = commas = 0
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            commas += 1
    return commas


def _bridge_calls() -> dict[str, tuple[str, int, str | None]]:
    """c10d method -> (frontend method, number of arguments, OpType) as written in backend.cpp."""
    with open(BRIDGE) as f:
        source = f.read()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"GroupCommBackend::\s*(\w+)\(", source)]
    calls = {}
    for (start, cxx), (end, _) in zip(starts, starts[1:] + [(len(source), "")]):
        body = source[start:end]
        call = re.search(r'\.attr\("(\w+)"\)\((.*?)\);', body, re.S)
        if call is None:
            continue
        args = call.group(2).strip()
        n_args = 0 if not args else _top_level_commas(args) + 1
        op_type = re.search(r"c10d::OpType::(\w+)", body)
        calls[cxx] = (call.group(1), n_args, op_type.group(1) if op_type else None)
    return calls


def _positional(function) -> tuple[str, ...]:
    params = list(inspect.signature(function).parameters.values())[1:]  # self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def test_every_bridge_call_is_declared() -> None:
    calls = _bridge_calls()
    declared = {op.cxx: op for op in ops.OPS}
    assert set(calls) == set(declared), sorted(set(calls) ^ set(declared))
    for cxx, (name, n_args, op_type) in calls.items():
        op = declared[cxx]
        assert name == op.name, (cxx, name, op.name)
        assert n_args == len(op.params), (cxx, n_args, op.params)
        assert op_type == op.op_type, (cxx, op_type, op.op_type)
    with open(HEADER) as f:
        header = f.read()
    for op in ops.OPS:
        assert re.search(rf"\b{op.cxx}\(", header), f"backend.h does not declare {op.cxx}"


def test_every_declared_op_has_a_frontend_method_and_a_primitive() -> None:
    assert len(ops.BY_NAME) == len(ops.OPS), "two rows name the same frontend method"
    for op in ops.OPS:
        method = getattr(C10dFrontend, op.name, None)
        assert callable(method), f"C10dFrontend has no {op.name}"
        assert _positional(method) == op.params, (op.name, _positional(method), op.params)
        if op.primitive is not None:
            assert callable(getattr(DeviceCommunicatorBase, op.primitive, None)), (op.name, op.primitive)
    # only lifecycle, the native plans, batching and gloo's monitored barrier run without a communicator primitive
    assert {op.name for op in ops.OPS if op.primitive is None} == {
        "monitored_barrier",
        "native_plan",
        "gloo_plan",
        "cuda_plan",
        "start_coalescing",
        "end_coalescing",
        "shrink",
        "split",
        "reconfigure_handle",
        "reconfigure",
        "current_timeout",
        "named",
        "set_timeout",
        "abort",
        "shutdown",
    }


def test_every_collective_is_checked_under_debug() -> None:
    describers = _describers(2)
    assert set(describers) == set(ops.COLLECTIVES)
    for name in ops.COLLECTIVES:
        checked = CheckedFrontend.__dict__.get(name)
        assert checked is not None, f"CheckedFrontend does not check {name}"
        assert _positional(checked) == ops.BY_NAME[name].params, name
    # (native_plan, gloo_plan and cuda_plan are answered False there: under the check nothing bypasses Python)
    unchecked = {op.name for op in ops.OPS if not op.collective} - {"native_plan", "gloo_plan", "cuda_plan"}
    assert not unchecked & set(CheckedFrontend.__dict__), "send/recv and lifecycle calls are not compared"
