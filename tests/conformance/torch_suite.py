"""torch's own backend acceptance suite (``DistributedTest._DistTestBase`` from
``torch/testing/_internal/distributed/distributed_test.py``), run on a backend
of our choosing.

The suite decides its skips from the environment variable ``BACKEND`` when it
is imported, so under the name ``groupcomm`` every case marked "gloo only"
would skip. This module imports it as ``BACKEND=gloo`` (the cases run, and
behave, exactly as they do for gloo on this machine) and then creates each
case's process group on ``GROUPCOMM_SUITE_BACKEND`` (``groupcomm`` unless told
otherwise; ``gloo`` gives the baseline). ``WORLD_SIZE`` must be set before
import, as the suite also reads it there.

Run through tests/test_torch_suite.py, or by hand, e.g.::

    BACKEND=gloo WORLD_SIZE=3 python -m pytest tests/conformance/torch_suite.py -k test_all_gather_coalesced
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

os.environ.setdefault("BACKEND", "gloo")
if os.environ["BACKEND"] != "gloo":
    raise RuntimeError(
        "torch_suite: import with BACKEND=gloo; pick the backend under test with GROUPCOMM_SUITE_BACKEND"
    )
os.environ.setdefault("WORLD_SIZE", "2")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.distributed import distributed_test as suite  # noqa: E402

BACKEND_UNDER_TEST = os.environ.get("GROUPCOMM_SUITE_BACKEND", "groupcomm")
if BACKEND_UNDER_TEST == "groupcomm":
    import torch_groupcomm  # noqa: F401


class TorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    """Every case of torch's suite, each on freshly forked ranks.

    torch's harness spawns them: each rank then imports torch, the suite and
    groupcomm again, ~5 s a case on two cores. This process has imported all
    three and made no group, so forking it starts a case's ranks at once (a
    case ~1 s), as torch's own CI once ran this suite for gloo
    (``TestDistBackendWithFork``)."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:
        # TestDistBackend._run with the group made on the backend under test.
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        seconds = suite.CUSTOM_PG_TIMEOUT.get(test_name, suite.default_pg_timeout)
        dist.init_process_group(
            BACKEND_UNDER_TEST,
            init_method=self.init_method,
            world_size=int(self.world_size),
            rank=rank,
            timeout=timedelta(seconds=seconds),
        )
        self._barrier()  # every rank is set up before a case that skips at once exits
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)
