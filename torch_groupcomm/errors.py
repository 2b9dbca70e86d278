"""Exceptions raised by torch_groupcomm.

Argument errors use Python's own ``TypeError``/``ValueError`` (torch's
convention); failures of the communication itself use the classes below so
callers can tell a broken group from a bad call.
"""


class GroupCommError(RuntimeError):
    """A collective could not complete (peer gone, transport failure)."""


class CommTimeoutError(GroupCommError, TimeoutError):
    """A collective did not complete within the group's timeout."""


def unsupported(op: str, communicator: str) -> NotImplementedError:
    """The uniform error for an op a communicator does not implement."""
    return NotImplementedError(f"groupcomm: {op} is not supported by the {communicator} communicator")
