"""StatelessProcessGroup: a group of processes formed without torch.distributed's global state.

``torch.distributed.init_process_group`` forms one world per process. Once a
trainer's processes and an inference fleet's processes have each formed their
own, a group spanning both (to sync weights, say) cannot be made with it. A
:class:`StatelessProcessGroup` is formed over a ``TCPStore`` of its own instead,
by any processes, whatever groups they already belong to.

The store carries objects (``send_obj``, ``broadcast_obj``, ``all_gather_obj``)
and barriers: the control plane, fine for metadata, slow for bulk data. For
tensors, :meth:`StatelessProcessGroup.coordinator` builds a
:class:`~torch_groupcomm.coordinator.GroupCoordinator` over the same ranks,
which carries them through shared memory when all ranks share a host and
through gloo otherwise.

The API follows vLLM's ``vllm.distributed.utils.StatelessProcessGroup``.
Differences: point-to-point keys name both the sender and the receiver, so two
ranks sending to one never collide; a received point-to-point object is
deleted from the store at once (it has a single reader); barriers clean up
their own keys; sending to oneself is allowed.
"""

from __future__ import annotations

import pickle
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch._C import _distributed_c10d as c10d
from torch.distributed import TCPStore

from .checks import check_rank
from .coordinator import GroupCoordinator

# Store keys of the object plane and of barriers; the coordinator's keys live
# under "groupcomm/stateless/", so the two never meet.
_P2P_KEY = "obj/p2p/{src}->{dst}/{seq}"
_BCAST_KEY = "obj/bcast/{src}/{seq}"
_BARRIER_KEY = "barrier/{seq}/{phase}/{rank}"
_BARRIER_PHASES = ("arrived", "confirmed", "departed")

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.02


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"groupcomm: {name} must be an int, got {value!r}")
    return value


@dataclass(eq=False)
class StatelessProcessGroup:
    """Rank, world size and store of a group formed outside torch.distributed.

    Build one with :meth:`create` (every member calls it with the same host,
    port and world size and its own rank). All calls are blocking; objects
    travel pickled through the store, so only exchange objects with processes
    you trust. Not thread-safe: one thread per rank drives a group. Instances
    compare by identity.
    """

    rank: int
    world_size: int
    store: c10d.Store
    data_expiration_seconds: int = 3600
    # Messages sent to / received from each peer so far: the sequence number in the next key.
    send_dst_counter: dict[int, int] = field(default_factory=dict)
    recv_src_counter: dict[int, int] = field(default_factory=dict)
    broadcast_send_counter: int = 0
    broadcast_recv_src_counter: dict[int, int] = field(default_factory=dict)
    barrier_counter: int = 0
    # (key, time.monotonic() when written) of this rank's keys, oldest first.
    entries: deque[tuple[str, float]] = field(default_factory=deque)
    _coordinator: GroupCoordinator | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size)
        if self.world_size < 1:
            raise ValueError(f"groupcomm: world_size must be at least 1, got {self.world_size}")
        _check_int("rank", self.rank)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"groupcomm: rank {self.rank} is out of range for world_size {self.world_size}")
        if self.data_expiration_seconds < 0:
            raise ValueError(f"groupcomm: data_expiration_seconds must be >= 0, got {self.data_expiration_seconds}")
        for counters in (self.send_dst_counter, self.recv_src_counter, self.broadcast_recv_src_counter):
            for r in range(self.world_size):
                counters.setdefault(r, 0)

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
    ) -> StatelessProcessGroup:
        """Form a group: rank 0 serves a ``TCPStore`` on ``host:port`` and the
        others connect to it (every rank must call this; it returns once all
        have connected, or raises after ``store_timeout`` seconds).

        A replacement for ``torch.distributed.init_process_group`` that leaves
        torch.distributed's global state alone, so the same processes can be
        in any number of such groups, and in a default group too.
        """
        if not isinstance(host, str) or not host:
            raise ValueError(f"groupcomm: host must be a non-empty str, got {host!r}")
        _check_int("port", port)
        if not 0 < port < 65536:
            raise ValueError(f"groupcomm: port must be in 1..65535, got {port}")
        _check_int("world_size", world_size)
        if world_size < 1:
            raise ValueError(f"groupcomm: world_size must be at least 1, got {world_size}")
        _check_int("rank", rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"groupcomm: rank {rank} is out of range for world_size {world_size}")
        if not store_timeout > 0:
            raise ValueError(f"groupcomm: store_timeout must be positive, got {store_timeout}")
        if data_expiration_seconds < 0:
            raise ValueError(f"groupcomm: data_expiration_seconds must be >= 0, got {data_expiration_seconds}")
        store = TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=store_timeout),
        )
        return StatelessProcessGroup(
            rank=rank, world_size=world_size, store=store, data_expiration_seconds=data_expiration_seconds
        )

    # -- helpers -------------------------------------------------------------------

    def _live_store(self) -> c10d.Store:
        if self.store is None:
            raise RuntimeError("groupcomm: this StatelessProcessGroup has been destroyed")
        return self.store

    def _check_rank(self, name: str, rank: Any) -> int:
        _check_int(name, rank)
        return check_rank(f"groupcomm: {name}", rank, self.world_size, "this group")

    def _put(self, key: str, obj: Any) -> None:
        self._live_store().set(key, pickle.dumps(obj))
        self.entries.append((key, time.monotonic()))

    def _load(self, data: bytes, key: str, src: int) -> Any:
        if not data:  # a pickle is never empty: the key was deleted between wait and read
            raise RuntimeError(
                f"groupcomm: object {key!r} expired before rank {self.rank} read it; rank {src} "
                f"deletes its objects data_expiration_seconds={self.data_expiration_seconds}s after writing them"
            )
        return pickle.loads(data)

    # -- objects -------------------------------------------------------------------

    def send_obj(self, obj: Any, dst: int) -> None:
        """Send a picklable ``obj`` to rank ``dst``, which gets it from
        ``recv_obj(src=<this rank>)``. Returns at once (the store holds it);
        ``dst`` may be this rank."""
        self._check_rank("dst", dst)
        self.expire_data()
        seq = self.send_dst_counter[dst]
        self._put(_P2P_KEY.format(src=self.rank, dst=dst, seq=seq), obj)
        self.send_dst_counter[dst] = seq + 1

    def recv_obj(self, src: int) -> Any:
        """The next object rank ``src`` sent to this rank, in send order;
        waits for it up to the store's timeout."""
        self._check_rank("src", src)
        store = self._live_store()
        seq = self.recv_src_counter[src]
        key = _P2P_KEY.format(src=src, dst=self.rank, seq=seq)
        obj = self._load(store.get(key), key, src)
        self.recv_src_counter[src] = seq + 1
        store.delete_key(key)  # this rank is its only reader
        return obj

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        """``src``'s ``obj`` on every rank (``obj`` is ignored elsewhere).

        The object stays in the store until ``src`` expires it (see
        :meth:`expire_data`): use it for occasional metadata, not in a hot loop.
        """
        self._check_rank("src", src)
        self.expire_data()
        if src == self.rank:
            self._put(_BCAST_KEY.format(src=src, seq=self.broadcast_send_counter), obj)
            self.broadcast_send_counter += 1
            return obj
        seq = self.broadcast_recv_src_counter[src]
        key = _BCAST_KEY.format(src=src, seq=seq)
        obj = self._load(self._live_store().get(key), key, src)
        self.broadcast_recv_src_counter[src] = seq + 1
        return obj

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        self.broadcast_obj(obj, src=self.rank)
        return [obj if r == self.rank else self.broadcast_obj(None, src=r) for r in range(self.world_size)]

    def expire_data(self) -> None:
        """Delete the keys this rank wrote more than ``data_expiration_seconds``
        ago, so a long-lived group does not grow its store without bound.

        A reader that has not fetched an object by then never will: the
        expiry must exceed the longest time a peer may lag behind.
        """
        if not self.entries:
            return
        store = self._live_store()
        now = time.monotonic()
        while self.entries and now - self.entries[0][1] >= self.data_expiration_seconds:
            key, _ = self.entries.popleft()
            store.delete_key(key)

    # -- barrier -------------------------------------------------------------------

    def barrier(self, timeout: float = 30.0) -> None:
        """Wait until every rank has called ``barrier``.

        Three phases through the store, each allowed ``timeout`` seconds:
        every rank announces its arrival and waits for all arrivals; every
        rank confirms it saw them and waits for all confirmations (so no
        rank's arrival key is still being looked for); then ranks other than
        0 announce their departure and leave, while rank 0, which serves the
        store, waits for every departure and deletes the barrier's keys.

        Raises RuntimeError naming the phase and the missing ranks when a
        phase times out; the group's barriers are then out of step.
        """
        if not timeout > 0:
            raise ValueError(f"groupcomm: barrier timeout must be positive, got {timeout}")
        store = self._live_store()
        seq = self.barrier_counter
        self.barrier_counter += 1
        if self.world_size == 1:
            return
        everyone = range(self.world_size)
        arrived, confirmed, departed = _BARRIER_PHASES
        store.set(_BARRIER_KEY.format(seq=seq, phase=arrived, rank=self.rank), b"1")
        self._await(store, seq, arrived, everyone, timeout)
        store.set(_BARRIER_KEY.format(seq=seq, phase=confirmed, rank=self.rank), b"1")
        self._await(store, seq, confirmed, everyone, timeout)
        if self.rank != 0:
            store.set(_BARRIER_KEY.format(seq=seq, phase=departed, rank=self.rank), b"1")
            return
        self._await(store, seq, departed, range(1, self.world_size), timeout)
        for phase in _BARRIER_PHASES:
            for r in everyone:
                store.delete_key(_BARRIER_KEY.format(seq=seq, phase=phase, rank=r))

    def _await(self, store: c10d.Store, seq: int, phase: str, ranks: range, timeout: float) -> None:
        """Poll until every rank in ``ranks`` has written its ``phase`` key of barrier ``seq``."""
        keys = [_BARRIER_KEY.format(seq=seq, phase=phase, rank=r) for r in ranks]
        deadline = time.monotonic() + timeout
        delay = _POLL_MIN_S
        while not store.check(keys):
            if time.monotonic() >= deadline:
                missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
                if missing:
                    raise RuntimeError(
                        f"groupcomm: StatelessProcessGroup barrier #{seq} timed out after {timeout}s "
                        f"in phase '{phase}' on rank {self.rank}: ranks {missing} missing"
                    )
                return
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    # -- tensors -------------------------------------------------------------------

    def coordinator(self, timeout: timedelta | None = None) -> GroupCoordinator:
        """A :class:`GroupCoordinator` over this group's ranks, for tensors
        (``all_reduce``, ``broadcast``, ``all_gather``, ``send``/``recv``, ...).

        Collective: every rank must call it, in the same order relative to the
        group's other collective calls. The first call builds it (shared memory
        when all ranks share a host, gloo or hierarchical otherwise) with
        ``timeout`` (default: the store's); later calls return the same one.
        """
        if self._coordinator is not None:
            return self._coordinator
        store = self._live_store()
        if timeout is None:
            timeout = store.timeout
        token = self.broadcast_obj(secrets.token_hex(8) if self.rank == 0 else None, src=0)
        prefixed = c10d.PrefixStore("groupcomm/stateless/", store)
        cpu_group = c10d.ProcessGroupGloo(
            c10d.PrefixStore("groupcomm/cpu_group/", prefixed), self.rank, self.world_size, timeout
        )
        coordinator = GroupCoordinator.from_cpu_group(
            cpu_group,
            prefixed,
            self.rank,
            self.world_size,
            timeout,
            group_name=f"stateless-{token}",
            global_ranks=list(range(self.world_size)),
        )
        if self.world_size > 1:
            # Build the CPU communicator now, while every rank is known to be
            # here, so that send/recv (not ordered with collectives) can use it.
            coordinator.prepare_cpu()
        self._coordinator = coordinator
        return coordinator

    def destroy(self) -> None:
        """Destroy the coordinator (if any) and drop this rank's store handle
        (on rank 0 the store server stops once nothing else holds it).

        Local, not collective: call :meth:`barrier` first so that rank 0 does
        not take the store away while peers still use it. Idempotent.
        """
        if self._coordinator is not None:
            self._coordinator.destroy()
            self._coordinator = None
        self.entries.clear()
        self.store = None  # type: ignore[assignment]
