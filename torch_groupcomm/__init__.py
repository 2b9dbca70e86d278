"""torch_groupcomm: the ``groupcomm`` backend for torch.distributed.

``import torch_groupcomm`` (or, through torch's backend autoload, plain
``import torch``) registers the backend; then
``dist.init_process_group("groupcomm")`` or ``"cpu:gloo,cuda:groupcomm"``
routes collectives through a :class:`GroupCoordinator` per group.
"""

import torch  # noqa: F401  - first, so torch's own autoload finds this package importable

from ._autoload import register as _register
from ._registry import BACKEND_NAME, get_coordinator
from .c10d.registration import register_backend
from .errors import CommTimeoutError, GroupCommError

__all__ = [
    "BACKEND_NAME",
    "CommTimeoutError",
    "GroupCommError",
    "GroupCoordinator",
    "MessageQueue",
    "StatelessProcessGroup",
    "__version__",
    "communication",
    "get_coordinator",
    "register_backend",
]
# Loaded on first use: backend autoload imports this package during
# ``import torch``, which must stay cheap.
_LAZY = {
    "GroupCoordinator": "coordinator",
    "MessageQueue": "message_queue",
    "StatelessProcessGroup": "stateless",
}


def __getattr__(name: str):
    import importlib

    if name == "communication":  # the Bagua-style functional API, a module
        return importlib.import_module(".communication", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def _version() -> str:
    """The installed build's version (release + the torch it was compiled
    against, as in the package metadata), or the bare release before a build."""
    try:
        from ._build_info import VERSION
    except ImportError:
        from ._version import RELEASE as VERSION
    return VERSION


__version__ = _version()

_register()
