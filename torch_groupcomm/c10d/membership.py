"""Who is in a group that ``dist._reconfigure`` forms anew (torch's
fault-tolerance API, torch 2.14.1+): each process's handle, and the member list a
reconfigure is given.

A handle names one process in one generation of the group:
``groupcomm:<global rank>:<rank>:<generation>:<pid>@<host>``. The global
rank is the process's rank in the group when the group was made, kept
across generations (the re-formed group's ``global_ranks``); the rank and
the generation (the uuid of the reconfigure that formed it, -1 before
any) change with each reconfigure, so a handle from an earlier generation
is never taken for the current one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import NamedTuple

from .._registry import BACKEND_NAME


class Member(NamedTuple):
    """One process of the group, as its handle describes it."""

    global_rank: int
    rank: int
    generation: int
    process: str  # pid@host

    @classmethod
    def this_process(cls, global_rank: int, rank: int, generation: int) -> Member:
        """The calling process, at ``rank`` of the group's ``generation``."""
        return cls(global_rank, rank, generation, f"{os.getpid()}@{socket.gethostname()}")

    @property
    def handle(self) -> str:
        """The string the peers exchange (``parse`` reads it back)."""
        return f"{BACKEND_NAME}:{self.global_rank}:{self.rank}:{self.generation}:{self.process}"

    @classmethod
    def parse(cls, handle: str) -> Member:
        """The member ``handle`` names; ValueError if it is not a groupcomm handle."""
        fields = handle.split(":", 4) if isinstance(handle, str) else []
        try:
            if len(fields) != 5 or fields[0] != BACKEND_NAME or "@" not in fields[4]:
                raise ValueError
            return cls(int(fields[1]), int(fields[2]), int(fields[3]), fields[4])
        except ValueError:
            raise ValueError(
                f"groupcomm: reconfigure got {handle!r}, which is not a groupcomm reconfigure handle "
                f"(torch.distributed._get_reconfigure_handle of a groupcomm group gives one)"
            ) from None


def members(handles: Sequence[str], ordered: bool) -> list[str]:
    """The handles of the group to form, in rank order: as given when
    ``ordered`` (a list), sorted otherwise (a set: every member sorts the
    same strings alike). ValueError for an empty list, a malformed handle, or
    two handles of the same process."""
    chosen = list(handles) if ordered else sorted(handles)
    if not chosen:
        raise ValueError("groupcomm: reconfigure needs at least one handle")
    processes = {}
    for handle in chosen:
        process = Member.parse(handle).process
        if process in processes:
            raise ValueError(
                f"groupcomm: reconfigure got two handles of one process: {processes[process]!r} and {handle!r}"
            )
        processes[process] = handle
    return chosen
