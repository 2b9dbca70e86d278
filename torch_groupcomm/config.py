"""Settings read from ``GROUPCOMM_*`` environment variables (documented in the
README), checked once when a group's communicator is built."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

CPU_COMMUNICATORS = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class Config:
    """What a coordinator needs to know from the environment."""

    cpu_communicator: str = "auto"
    shm_chunk_bytes: int = 1 << 20
    spin_us: int = 20
    host_id: Optional[str] = None


def _int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"groupcomm: {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"groupcomm: {name}={value} must be at least {minimum}")
    return value


def load() -> Config:
    """Read the current environment."""
    communicator = os.environ.get("GROUPCOMM_CPU_COMMUNICATOR", "auto").strip().lower() or "auto"
    if communicator not in CPU_COMMUNICATORS:
        raise ValueError(
            f"groupcomm: GROUPCOMM_CPU_COMMUNICATOR={communicator!r}, expected one of {CPU_COMMUNICATORS}"
        )
    return Config(
        cpu_communicator=communicator,
        shm_chunk_bytes=_int("GROUPCOMM_SHM_CHUNK_BYTES", Config.shm_chunk_bytes, 4096),
        spin_us=_int("GROUPCOMM_SPIN_US", Config.spin_us, 0),
        host_id=os.environ.get("GROUPCOMM_HOST_ID") or None,
    )
