"""Settings read from ``GROUPCOMM_*`` environment variables (documented in the
README), checked once when a group's communicator is built."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

CPU_COMMUNICATORS = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class Config:
    """What a coordinator needs to know from the environment."""

    cpu_communicator: str = "auto"
    shm_chunk_bytes: int = 1 << 20
    shm_direct: bool = True  # GROUPCOMM_SHM_DIRECT: large messages read from the peer's memory
    spin_us: int | None = None  # None: chosen from the core count
    yield_us: int | None = None
    host_id: str | None = None
    debug: bool = False  # GROUPCOMM_DEBUG: ranks compare each collective's arguments first


def _int(name: str, default: int | None, minimum: int) -> int | None:
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


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"groupcomm: {name}={raw!r} is not a boolean; use one of {_TRUE + _FALSE}")


def load() -> Config:
    """Read the current environment."""
    communicator = os.environ.get("GROUPCOMM_CPU_COMMUNICATOR", "auto").strip().lower() or "auto"
    if communicator not in CPU_COMMUNICATORS:
        raise ValueError(f"groupcomm: GROUPCOMM_CPU_COMMUNICATOR={communicator!r}, expected one of {CPU_COMMUNICATORS}")
    return Config(
        cpu_communicator=communicator,
        shm_chunk_bytes=_int("GROUPCOMM_SHM_CHUNK_BYTES", Config.shm_chunk_bytes, 4096),
        shm_direct=_bool("GROUPCOMM_SHM_DIRECT", Config.shm_direct),
        spin_us=_int("GROUPCOMM_SPIN_US", None, 0),
        yield_us=_int("GROUPCOMM_YIELD_US", None, 0),
        host_id=os.environ.get("GROUPCOMM_HOST_ID") or None,
        debug=_bool("GROUPCOMM_DEBUG", Config.debug),
    )


class WaitPolicy(NamedTuple):
    """How a shared-memory waiter waits: busy-wait ``spin_us``, then yield the
    core for up to ``yield_us``, then sleep. On a ``crowded`` host (more ranks
    than cores) a waiting rank also moves itself off a core that holds two
    more of its group's ranks than another."""

    spin_us: int
    yield_us: int
    crowded: bool


def wait_policy(cfg: Config, local_world: int) -> WaitPolicy:
    """The wait policy for ``local_world`` ranks on this host. With a core per
    rank, waiters spin and then yield: waking a sleeper costs more than the
    wait. With more ranks than cores a waiter does not spin (it would burn the
    core the rank it waits for needs) but yields longer before sleeping, even
    when its yields find nothing else to run: a rank alone on its core then
    answers at once, where a sleeper on an idle core is slow to wake."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    crowded = local_world > cores
    spin = cfg.spin_us if cfg.spin_us is not None else (0 if crowded else 20)
    yield_ = cfg.yield_us if cfg.yield_us is not None else (2000 if crowded else 500)
    return WaitPolicy(spin, yield_, crowded)
