"""Names of our POSIX shared-memory segments, and their removal after a
failed setup.

Every segment gets an unguessable name that the ranks agree on before it
exists, so that whichever rank survives a crash during setup can remove it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable


def segment_name(kind: str) -> str:
    """A fresh name for a segment of ``kind`` (128 random bits)."""
    return f"/groupcomm-{kind}{secrets.token_hex(16)}"


def remove_segments(names: Iterable[str | None]) -> None:
    """Remove segments a failed setup may have left; a name that was never
    created, or is already gone, is fine."""
    for name in names:
        if name:
            try:
                os.unlink(f"/dev/shm{name}")
            except OSError:
                pass
