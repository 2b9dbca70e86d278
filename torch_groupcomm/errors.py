"""Exceptions raised by torch_groupcomm.

Argument errors use Python's own ``TypeError``/``ValueError`` (torch's
convention); failures of the communication itself use the classes below so
callers can tell a broken group from a bad call.
"""

from typing import Optional


class GroupCommError(RuntimeError):
    """A collective could not complete (peer gone, transport failure).

    The engine raises these from C++ (its ``CommFailure``, translated once in
    ``csrc/errors.cpp``); the c10d frontend re-raises them naming the op, group
    and rank, and sets ``op`` then (``None`` on a failure not yet placed).
    """

    def __init__(self, *args: object, op: Optional[str] = None) -> None:
        super().__init__(*args)
        self.op = op


class CommTimeoutError(GroupCommError, TimeoutError):
    """A collective did not complete within the group's timeout."""


def unsupported(op: str, communicator: str) -> NotImplementedError:
    """The uniform error for an op a communicator does not implement."""
    return NotImplementedError(f"groupcomm: {op} is not supported by the {communicator} communicator")
