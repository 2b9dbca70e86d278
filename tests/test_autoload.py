"""How torch finds the backend without `import torch_groupcomm`: on torch 2.14+
through the `torch.distributed.backends` entry point, when a group asks for the
name (nothing of ours runs at `import torch`); on older torch through the
`torch.backends` autoload at `import torch`, which must stay cheap. setup.py
declares exactly one of the two, for the torch it builds against."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from _harness import run_ranks


def check_without_import(rank: int, world: int) -> str:
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    assert torch.equal(t, torch.full((2,), 2.0))
    return dist.get_backend()


def test_script_without_import_gets_groupcomm() -> None:
    # this module does not import torch_groupcomm; the harness skips it too
    results = run_ranks(check_without_import, 2, env={"GROUPCOMM_TEST_NO_IMPORT": "1"}, fresh=True)
    assert results == ["groupcomm", "groupcomm"]


def _python(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


LAZY_ENTRY_POINT = torch.__version__ >= (2, 14)


def test_one_entry_point_for_this_torch() -> None:
    from importlib.metadata import entry_points

    lazy = [e.value for e in entry_points(group="torch.distributed.backends") if e.name == "groupcomm"]
    eager = [e.value for e in entry_points(group="torch.backends") if e.value.startswith("torch_groupcomm")]
    if LAZY_ENTRY_POINT:
        assert (lazy, eager) == (["torch_groupcomm._autoload:register"], [])
    else:
        assert (lazy, eager) == ([], ["torch_groupcomm._autoload:register"])


def test_import_torch_registers_lazily() -> None:
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "imported = 'torch_groupcomm' in sys.modules\n"
        "available = dist.is_backend_available('groupcomm')\n"
        "heavy = [m for m in ('torch_groupcomm._C', 'torch_groupcomm.coordinator') if m in sys.modules]\n"
        "print(imported, available, heavy)\n"
    )
    if LAZY_ENTRY_POINT:
        # nothing at `import torch`; the name is looked up when asked for
        assert _python(code) == "False True []"
        assert _python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0") == "False True []"
    else:
        assert _python(code) == "True True []"
        assert _python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0") == "False False []"


def check_registered_once(rank: int, world: int) -> str:
    # the harness imported torch_groupcomm (registration); a second registration
    # and torch's lookup of the name (entry point or autoload) must find it
    # registered and not redo it (torch raises "already exist" on a second one)
    import torch_groupcomm

    torch_groupcomm.register_backend()
    torch_groupcomm._autoload.register()
    group = dist.new_group([0, 1], backend="groupcomm")
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), 2.0))
    return dist.get_backend(group)


def test_explicit_import_and_lookup_register_once() -> None:
    assert run_ranks(check_registered_once, 2, fresh=True) == ["groupcomm", "groupcomm"]
