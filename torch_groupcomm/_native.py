"""The compiled extension (``torch_groupcomm._C``), loaded only under the torch
it was built against.

A C++ extension of torch is tied to the exact torch release it was compiled
with: under another one it fails with an undefined symbol, or worse, loads and
misbehaves. setup.py records the torch it compiled against in
``_build_info.py``; a mismatch is an ImportError that says how to rebuild.
"""

from __future__ import annotations

import torch

_REBUILD = "rebuild it in this environment: `pip install --no-build-isolation -e .` (or `.` for a non-editable install)"


def _load():
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:
        raise ImportError(f"torch_groupcomm was not built (no _build_info.py): {_REBUILD}") from None
    if TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"torch_groupcomm's C++ extension was built against torch {TORCH_VERSION}, but this "
            f"environment runs torch {torch.__version__}; {_REBUILD}"
        )
    try:
        from . import _C as extension
    except ImportError as exc:
        raise ImportError(f"torch_groupcomm's C++ extension does not load ({exc}); {_REBUILD}") from exc
    return extension


_C = _load()
