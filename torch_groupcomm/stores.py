"""Reads from a group's c10d store that wait no longer than the group's
timeout: a store's own timeout is the one ``init_process_group`` gave it
(up to 30 minutes), not that of the group being set up."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from torch._C import _distributed_c10d as c10d


def get_within(store: c10d.Store, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
    """The values of ``keys`` once all are set; DistStoreError after ``timeout``."""
    store.wait(list(keys), timeout)
    return store.multi_get(list(keys))
