"""torch's own backend acceptance suite (``DistributedTest._DistTestBase``) on
groupcomm: a CI subset of the cases gloo passes on this machine, at world sizes
2 and 3 (the ``_group`` cases need 3). Each case runs on its own spawned ranks
with a FileStore rendezvous, as torch runs it for gloo; tests/conformance/
torch_suite.py explains how the suite's gloo-only cases are made to run on
groupcomm. The whole suite against gloo is tests/conformance/compare.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance"))

from known import KNOWN_DIFFERENCES  # noqa: E402
from outcomes import run_suite  # noqa: E402

# Cases that pass on gloo at that world size (compare.py's baseline, torch
# 2.13.0 and 2.14.1), chosen to cover every op torch hands a backend.
CI_CASES = {
    2: [],
    3: [],
}


@pytest.mark.parametrize("world_size", sorted(CI_CASES))
def test_torch_suite_cases_pass_as_on_gloo(world_size: int) -> None:
    cases = CI_CASES[world_size]
    outcomes, output = run_suite("groupcomm", world_size, cases, timeout=1800)
    wrong = {case: outcomes.get(case, "missing") for case in cases if outcomes.get(case) != "passed"}
    assert not wrong, f"cases that pass on gloo but not on groupcomm at world {world_size}: {wrong}\n{output[-6000:]}"
    assert not set(cases) & set(KNOWN_DIFFERENCES), "a case listed as a known difference is in the CI subset"
