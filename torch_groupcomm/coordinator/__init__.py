"""The coordinator layer: one ``GroupCoordinator`` per group decides which
communicator carries each call (once per group and device) and offers vLLM's
``GroupCoordinator`` API to code that drives groups directly.

Build one with ``GroupCoordinator(group_ranks, ...)``, get the one behind a
c10d group with ``torch_groupcomm.get_coordinator(group)``, or one over a
:class:`~torch_groupcomm.stateless.StatelessProcessGroup`. Its calls are
synchronous and run in order with the group's queued c10d ops.

- ``group.py``: the class, how a coordinator is formed and how it ends;
- ``routing.py``: which communicator serves each device;
- ``collectives.py``: tensor collectives (custom ops), send/recv, barriers;
- ``object_exchange.py``: objects, tensor dicts, the message queue;
- ``ranks.py``, ``model_hooks.py``: ranks; graph capture and a model's hooks.
"""

from .group import CPU_GROUP_PREFIX, GroupCoordinator
from .model_hooks import GraphCaptureContext

__all__ = ["CPU_GROUP_PREFIX", "GraphCaptureContext", "GroupCoordinator"]
