"""Cases of torch's backend suite whose outcome on groupcomm differs from gloo's
for a reason outside this project, each with that reason (read by compare.py
and tests/test_torch_suite.py)."""

from __future__ import annotations

import torch

KNOWN_DIFFERENCES = {
    "test_get_backend": (
        "asserts dist.get_backend() equals the suite's BACKEND, which must read 'gloo' for its gloo "
        "cases to run at all; dist.get_backend() correctly says 'groupcomm'"
    ),
    "test_ddp_logging_data_cpu": (
        "asserts DDP's logged backend_name equals dist.get_backend(); DDP logs the C++ "
        "ProcessGroup::getBackendName(), which torch fixes to 'custom' for every third-party "
        "backend (BackendType::CUSTOM), so it reads 'custom' against 'groupcomm'"
    ),
}

# torch before 2.14: dist.monitored_barrier refuses any group whose backend is
# not named gloo, before it reaches the backend (groupcomm implements it: the
# group's backend object answers monitored_barrier on every torch).
_MONITORED_BARRIER_GLOO_ONLY = "torch < 2.14: dist.monitored_barrier raises for every group not named gloo"
BEFORE_TORCH_2_14 = {
    "test_monitored_barrier_gloo": _MONITORED_BARRIER_GLOO_ONLY,
    "test_monitored_barrier_gloo_subgroup": _MONITORED_BARRIER_GLOO_ONLY,
}


def known_differences() -> dict[str, str]:
    """The known differences for the torch in this environment."""
    if torch.__version__ >= (2, 14):
        return dict(KNOWN_DIFFERENCES)
    return {**KNOWN_DIFFERENCES, **BEFORE_TORCH_2_14}
