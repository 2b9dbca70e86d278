"""torch's own backend acceptance suite (``DistributedTest._DistTestBase``) on
groupcomm: a CI subset of the cases gloo passes on this machine, at world sizes
2 and 3, and the subgroup cases (``_group``: ranks 1 and 2 of the world), which
the suite runs only from world size 8 on. Each case runs on its own ranks (forked
from the child pytest, where torch spawns them) with a FileStore rendezvous;
tests/conformance/torch_suite.py explains how the suite's gloo-only cases are
made to run on groupcomm. The whole suite against gloo is
tests/conformance/compare.py (README: "torch's backend suite")."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance"))

from known import known_differences  # noqa: E402
from outcomes import run_suite  # noqa: E402

# Every op torch hands a backend, through the suite's own cases; each passes on
# gloo at these world sizes (compare.py's baseline on torch 2.13.0 and 2.14.1).
COLLECTIVES = [
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_object_default_pg",
    "test_all_reduce_sum",
    "test_all_reduce_product",
    "test_all_reduce_max",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_sparse_all_reduce_sum",
    "test_reduce_sum",
    "test_reduce_min",
    "test_broadcast",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_complex",
    "test_scatter_object_list",
    "test_barrier",
    "test_barrier_timeout_full_group",
    "test_get_future",
    "test_destroy_group",
]
POINT_TO_POINT = [
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_send_recv_any_source",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
]
TRAINING = ["test_DistributedDataParallelCPU", "test_static_graph_api_cpu"]
MONITORED_BARRIER = ["test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup"]
SUBGROUPS = ["test_all_reduce_group_sum", "test_all_gather_group", "test_broadcast_group", "test_barrier_group"]

CI_CASES = {
    2: COLLECTIVES + POINT_TO_POINT + TRAINING + MONITORED_BARRIER,
    3: [
        "test_all_gather_coalesced_simple",
        "test_all_reduce_coalesced_sum",
        "test_sparse_all_reduce_sum",
        "test_scatter",
        "test_gather",
        "test_send_recv_any_source",
        "test_batch_isend_irecv_gloo",
        "test_monitored_barrier_gloo_rank_0_timeout",
    ],
    8: SUBGROUPS,
}


@pytest.mark.parametrize("world_size", sorted(CI_CASES))
def test_torch_suite_cases_pass_as_on_gloo(world_size: int) -> None:
    known = known_differences()
    cases = [case for case in CI_CASES[world_size] if case not in known]
    outcomes, output = run_suite("groupcomm", world_size, cases, timeout=1800)
    wrong = {case: outcomes.get(case, "missing") for case in cases if outcomes.get(case) != "passed"}
    assert not wrong, (
        f"torch {torch.__version__}, world {world_size}: cases that pass on gloo but not on groupcomm: {wrong}\n{output[-6000:]}"
    )
