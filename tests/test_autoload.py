"""torch's backend autoload: a script that never imports torch_groupcomm still
gets the backend, and `import torch` stays cheap."""

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
    results = run_ranks(check_without_import, 2, env={"GROUPCOMM_TEST_NO_IMPORT": "1"})
    assert results == ["groupcomm", "groupcomm"]


def _python(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_torch_registers_lazily() -> None:
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "heavy = [m for m in ('torch_groupcomm._C', 'torch_groupcomm.coordinator') if m in sys.modules]\n"
        "print(dist.is_backend_available('groupcomm'), heavy)\n"
    )
    assert _python(code) == "True []"
    assert _python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0") == "False []"
