"""Argument checks shared by every API of the package (c10d frontend,
coordinator, stateless groups, the Bagua-style functions): one wording for
one mistake."""

from __future__ import annotations

from typing import Any


def check_rank(what: str, rank: Any, world_size: int, group: str) -> int:
    """``rank`` if it is an int naming a rank of ``group`` (``world_size``
    ranks); else ValueError "<what> <rank> is not a rank of <group> (size N)"."""
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"{what} {rank!r} is not a rank of {group} (size {world_size})")
    return rank


def check_peer(what: str, rank: Any, own_rank: int, world_size: int, group: str) -> int:
    """``check_rank``, and ``rank`` is not this process's own."""
    check_rank(what, rank, world_size, group)
    if rank == own_rank:
        raise ValueError(f"{what} {rank} is this process's own rank")
    return rank
