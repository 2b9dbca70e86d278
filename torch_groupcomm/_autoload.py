"""Entry point for torch's backend autoload (``torch.backends`` group).

torch calls :func:`register` at the end of ``import torch``; an exception here
would break ``import torch`` itself, so it only registers a lazy creator and
never raises.
"""

import warnings


def register() -> None:
    """Register ``groupcomm`` with torch.distributed; warn instead of raising."""
    try:
        from .c10d.registration import register_backend

        register_backend()
    except Exception as exc:  # noqa: BLE001 - must never break `import torch`
        warnings.warn(f"torch_groupcomm: backend autoload failed: {exc!r}", stacklevel=2)
