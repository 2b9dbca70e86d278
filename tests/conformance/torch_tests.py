"""torch's own multi-process test files (DTensor, FSDP2, ...) run on a backend
of our choosing.

Their cases live in torch's ``test/`` directory, which the wheel does not
ship: take the files from the pytorch source at the tag of the installed
torch (e.g. ``test/distributed/tensor/test_dtensor.py``,
``test/distributed/_composable/fsdp/test_fully_shard_training.py``) and name
them in ``GROUPCOMM_TORCH_TESTS`` (separated by ``:``). For every
multi-process test class of those files this module defines a subclass whose
process groups are made on ``GROUPCOMM_SUITE_BACKEND`` (``groupcomm`` unless
told otherwise; ``gloo`` gives the baseline): ``DTensorTestBase.init_pg``,
``FSDPTest._run`` and ``DistributedTestBase.backend`` are overridden. Each
case's ranks are forked from this process, which has imported torch, the
files and groupcomm and made no group (torch's harness spawns them, and each
would import all of it again).

    GROUPCOMM_TORCH_TESTS=/path/to/test_dtensor.py python -m pytest tests/conformance/torch_tests.py -k DTensorTest
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch.distributed as dist
from torch.testing._internal.common_distributed import DistributedTestBase, MultiProcessTestCase

BACKEND_UNDER_TEST = os.environ.get("GROUPCOMM_SUITE_BACKEND", "groupcomm")
if BACKEND_UNDER_TEST == "groupcomm":
    import torch_groupcomm  # noqa: F401

import torch  # noqa: E402
from torch.testing._internal.common_fsdp import FSDPTest  # noqa: E402
from torch.testing._internal.common_utils import set_rng_seed  # noqa: E402
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase  # noqa: E402


def _init_pg(self, eager_init, backend=None) -> None:
    # DTensorTestBase.init_pg accepts only backend names it knows; on the CPU
    # it would make a gloo group.
    dist.init_process_group(
        BACKEND_UNDER_TEST,
        world_size=self.world_size,
        rank=self.rank,
        init_method=f"file://{self.file_name}",
    )
    if dist.get_backend() != BACKEND_UNDER_TEST:
        raise AssertionError(f"the group runs on {dist.get_backend()}, not {BACKEND_UNDER_TEST}")


def _fsdp_run(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:
    # FSDPTest._run on the backend under test, without its exit for a machine
    # with fewer accelerators than ranks (torch 2.13-2.15 skip every CPU case there).
    self = cls(test_name)
    self.rank = rank
    self.file_name = file_name
    dist.init_process_group(
        BACKEND_UNDER_TEST, init_method=self.init_method, world_size=int(self.world_size), rank=rank
    )
    dist.barrier()
    torch._dynamo.reset()
    set_rng_seed()
    self.run_test(test_name, pipe)
    torch._dynamo.reset()
    dist.barrier()
    dist.destroy_process_group()


def _backend(self, device) -> str:
    # DistributedTestBase picks gloo for the CPU
    return BACKEND_UNDER_TEST if torch.device(device).type == "cpu" else DistributedTestBase.backend(self, device)


def _fork_processes(self) -> None:
    self._start_processes(torch.multiprocessing.get_context("fork").Process)


def _load(path: str):
    name = "torch_test_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


for _path in filter(None, os.environ.get("GROUPCOMM_TORCH_TESTS", "").split(":")):
    _module = _load(_path)
    for _name, _cls in sorted(vars(_module).items()):
        if (
            not (isinstance(_cls, type) and issubclass(_cls, MultiProcessTestCase))
            or _cls.__module__ != _module.__name__
        ):
            continue
        _body = {"__module__": __name__, "__qualname__": _name, "_spawn_processes": _fork_processes}
        if issubclass(_cls, DTensorTestBase):
            _body["init_pg"] = _init_pg
        if issubclass(_cls, DistributedTestBase):
            _body["backend"] = _backend
        if issubclass(_cls, FSDPTest):
            # spawned ranks find the method by its qualified name
            _body["_run"] = classmethod(types.FunctionType(_fsdp_run.__code__, globals(), "_run"))
            _body["_run"].__func__.__qualname__ = f"{_name}._run"
        globals()[_name] = type(_name, (_cls,), _body)


if __name__ == "__main__":
    # Runs pytest on this module with the files and the backend given here.
    import argparse
    import subprocess

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("``", "`"),
        epilog="Options not listed here go to pytest (e.g. -k DTensorTest, -x, -q).",
    )
    parser.add_argument(
        "--file",
        action="append",
        dest="files",
        metavar="PATH",
        help="a torch test file, repeatable (default: those of $GROUPCOMM_TORCH_TESTS, separated by ':')",
    )
    parser.add_argument(
        "--backend",
        default=BACKEND_UNDER_TEST,
        help="the backend the groups are made on: groupcomm or gloo for the baseline (default: %(default)s)",
    )
    args, pytest_args = parser.parse_known_args()
    env = dict(os.environ, GROUPCOMM_SUITE_BACKEND=args.backend)
    if args.files:
        env["GROUPCOMM_TORCH_TESTS"] = ":".join(os.path.abspath(f) for f in args.files)
    if not env.get("GROUPCOMM_TORCH_TESTS"):
        parser.error("no torch test files: name them, or set GROUPCOMM_TORCH_TESTS")
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", os.path.abspath(__file__), *pytest_args], env=env))
