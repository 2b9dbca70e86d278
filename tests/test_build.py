"""What a user of the wrong torch sees: a build for torch A under torch B, or a
build against a torch outside the supported range, stops with a message that
names both versions and says how to fix it (never a crash at the first op)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_extension_built_for_another_torch_is_refused() -> None:
    code = (
        "import sys, types, torch\n"
        "info = types.ModuleType('torch_groupcomm._build_info')\n"
        "info.TORCH_VERSION = '2.10.0+cpu'\n"
        "sys.modules['torch_groupcomm._build_info'] = info\n"
        "try:\n"
        "    from torch_groupcomm._native import _C\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "print('torch_groupcomm._C' in sys.modules)\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    message, loaded = done.stdout.strip().splitlines()
    import torch

    assert "built against torch 2.10.0+cpu" in message
    assert f"this environment runs torch {torch.__version__}" in message
    assert "pip install --no-build-isolation" in message
    assert loaded == "False"  # refused before the library is loaded


def test_extension_built_for_this_torch_loads() -> None:
    done = _python("from torch_groupcomm._native import _C; print(hasattr(_C, 'GroupCommBackend'))")
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


def test_build_refuses_unsupported_torch() -> None:
    for version in ("2.10.0", "2.16.0"):
        code = (
            "import sys, torch\n"
            f"torch.__version__ = {version!r}\n"
            "sys.argv = ['setup.py', '--version']\n"
            "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))\n"
        )
        done = _python(code)
        assert done.returncode != 0
        assert f"torch_groupcomm supports torch 2.11 to 2.15; this environment has torch {version}" in done.stderr
