"""One writer broadcasting Python objects to many readers, modelled on vLLM's
``shm_broadcast.MessageQueue``.

Control messages (scheduler outputs, small dicts) go out far more often than
tensors, and a collective per message costs more than the message. Here the
writer pickles an object once and copies it once into a shared-memory ring
(:class:`torch_groupcomm._C.ShmRing`) that every reader on its host reads
directly; readers on other hosts get the same bytes over a TCP connection.
Waiting readers sleep on a futex (shared memory) or in ``recv`` (TCP), so an
idle reader costs no CPU. The segment's name is removed from ``/dev/shm`` as
soon as every local reader has attached, so nothing is left behind even if a
process dies.
"""

from __future__ import annotations

import pickle
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import config as config_module
from ._native import _C
from .errors import CommTimeoutError, GroupCommError
from .message_socket import RemoteReaders, WriterConnection, default_connect_ip
from .shm_names import remove_segments, segment_name
from .topology import host_identity

__all__ = ["Handle", "MessageQueue"]

# How long wait_until_ready waits for readers to attach and connect by default.
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Handle:
    """Everything a reader needs to join a writer's queue: small and
    picklable, so it can travel through any object broadcast."""

    local_reader_ranks: tuple[int, ...]
    shm_name: str | None
    max_chunk_bytes: int
    max_chunks: int
    spin_us: int
    n_remote_reader: int
    remote_addr: tuple[str, int] | None
    token: bytes


def _ms(timeout: float | None) -> int:
    return -1 if timeout is None else max(0, int(timeout * 1000))


class MessageQueue:
    """A one-writer, many-reader queue of pickled Python objects.

    The constructor makes the writer side; readers join with
    :meth:`create_from_handle` using the writer's :meth:`export_handle`, or
    every rank of a group gets its side at once from
    :meth:`create_from_process_group`. Local readers (``local_reader_ranks``)
    read the shared-memory ring; the other ``n_reader - n_local_reader``
    readers connect over TCP. Every reader receives every message, in order.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: Sequence[int] | None = None,
        max_chunk_bytes: int = 1 << 22,
        max_chunks: int = 6,
        connect_ip: str | None = None,
        *,
        _shm_name: str | None = None,
    ) -> None:
        """Create the writer side for ``n_reader`` readers, of which
        ``n_local_reader`` share this host (``local_reader_ranks``, default
        ``range(n_local_reader)``, names them for :meth:`create_from_handle`).
        The ring holds ``max_chunks`` chunks of ``max_chunk_bytes``; longer
        messages stream through several chunks."""
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        local_reader_ranks = tuple(int(r) for r in local_reader_ranks)
        if not 0 <= n_local_reader <= n_reader or len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"groupcomm: MessageQueue with {n_reader} readers, {n_local_reader} local, "
                f"local ranks {list(local_reader_ranks)}"
            )
        if max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError(f"groupcomm: max_chunk_bytes={max_chunk_bytes}, max_chunks={max_chunks} must be positive")
        self._init_common(n_reader, n_local_reader, is_writer=True)
        n_remote = n_reader - n_local_reader
        spin_us = config_module.wait_policy(config_module.load(), n_local_reader + 1).spin_us
        shm_name = None
        if n_local_reader:
            shm_name = _shm_name or segment_name("mq-")
            try:
                self._ring = _C.ShmRing(
                    name=shm_name,
                    create=True,
                    n_chunks=max_chunks,
                    chunk_bytes=max_chunk_bytes,
                    n_readers=n_local_reader,
                    reader_index=-1,
                    spin_us=spin_us,
                    timeout_ms=-1,
                )
            except RuntimeError as exc:
                raise GroupCommError(str(exc)) from None
        token = secrets.token_bytes(16)
        if n_remote:
            self._remote = RemoteReaders(connect_ip or default_connect_ip(), n_remote, token)
        self.handle = Handle(
            local_reader_ranks=local_reader_ranks,
            shm_name=shm_name,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            spin_us=spin_us,
            n_remote_reader=n_remote,
            remote_addr=self._remote.addr if self._remote is not None else None,
            token=token,
        )

    def _init_common(self, n_reader: int, n_local_reader: int, is_writer: bool) -> None:
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_rank = -1
        self._is_writer = is_writer
        self._ring: Any | None = None
        self._remote: RemoteReaders | None = None  # writer with remote readers
        self._writer: WriterConnection | None = None  # remote reader
        self._ready = False
        self._closed = False

    @property
    def is_writer(self) -> bool:
        """Whether this side writes (else it reads)."""
        return self._is_writer

    @property
    def is_local_reader(self) -> bool:
        """Whether this side reads the shared-memory ring."""
        return not self._is_writer and self.local_reader_rank >= 0

    @property
    def is_remote_reader(self) -> bool:
        """Whether this side reads over TCP from a writer on another host."""
        return not self._is_writer and self.local_reader_rank < 0

    def export_handle(self) -> Handle:
        """The writer's :class:`Handle`, to pass to every reader."""
        if not self._is_writer:
            raise ValueError("groupcomm: only the writer side of a MessageQueue has a handle to export")
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """Join the queue of ``handle`` as reader ``rank``: through shared
        memory if ``rank`` is one of its local reader ranks, else over TCP."""
        self = MessageQueue.__new__(MessageQueue)
        n_local = len(handle.local_reader_ranks)
        self._init_common(n_local + handle.n_remote_reader, n_local, is_writer=False)
        self.handle = handle
        if rank in handle.local_reader_ranks:
            self.local_reader_rank = handle.local_reader_ranks.index(rank)
            try:
                self._ring = _C.ShmRing(
                    name=handle.shm_name,
                    create=False,
                    n_chunks=handle.max_chunks,
                    chunk_bytes=handle.max_chunk_bytes,
                    n_readers=n_local,
                    reader_index=self.local_reader_rank,
                    spin_us=handle.spin_us,
                    timeout_ms=-1,
                )
            except RuntimeError as exc:
                raise GroupCommError(str(exc)) from None
            return self
        if handle.remote_addr is None:
            raise ValueError(f"groupcomm: rank {rank} is not a local reader of this queue, which has no remote readers")
        self._writer = WriterConnection(handle.remote_addr, handle.token, rank, READY_TIMEOUT_S)
        return self

    def wait_until_ready(self, timeout: float | None = READY_TIMEOUT_S) -> None:
        """Finish joining: the writer waits until every local reader has
        attached (then removes the segment's name) and accepts every remote
        reader; a remote reader waits for the writer's acceptance. Raises
        :class:`CommTimeoutError` after ``timeout`` seconds (None: no limit).
        Called implicitly by the first enqueue or dequeue."""
        if self._closed:
            raise GroupCommError("groupcomm: MessageQueue is closed")
        if self._ready:
            return
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            if deadline is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeoutError(f"groupcomm: MessageQueue.wait_until_ready timed out after {timeout} s")
            return remaining

        if self._is_writer:
            if self._ring is not None:
                while self._ring.attached_readers < self.n_local_reader:
                    left()
                    time.sleep(0.001)
                self._ring.unlink()
            if self._remote is not None:
                self._remote.accept(left)
        elif self._writer is not None:
            self._writer.wait_accepted(left(), f"MessageQueue.wait_until_ready timed out after {timeout} s")
        self._ready = True

    def unlink(self) -> None:
        """Remove the segment's name from ``/dev/shm`` (any side may: safe once
        every local reader has attached, which :meth:`create_from_process_group`
        guarantees, or once setup failed). Idempotent."""
        if self._ring is not None:
            self._ring.unlink()

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send ``obj`` to every reader (writer only). Blocks while the ring is
        full of messages a reader has not read yet; ``timeout`` (seconds,
        None: no limit) bounds each such wait."""
        if not self._is_writer:
            raise ValueError("groupcomm: enqueue on a reader side of a MessageQueue")
        if not self._ready:
            self.wait_until_ready()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ring = self._ring
        if ring is not None:
            ring.write(data, -1 if timeout is None else _ms(timeout))  # failures arrive typed (errors.py)
        if self._remote is not None:
            self._remote.send(data, timeout)

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next object from the writer (readers only); ``timeout``
        (seconds, None: no limit) bounds the wait. A dead or closed writer
        raises :class:`GroupCommError` instead of waiting."""
        if self._is_writer:
            raise ValueError("groupcomm: dequeue on the writer side of a MessageQueue")
        if not self._ready:
            self.wait_until_ready()
        ring = self._ring
        if ring is not None:
            return pickle.loads(ring.read(-1 if timeout is None else _ms(timeout)))
        return pickle.loads(self._writer.recv(timeout))

    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer's ``obj`` on every side: the writer enqueues and returns
        it, a reader returns the next dequeued object."""
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def close(self) -> None:
        """Close the connections and drop the shared-memory mapping (the
        writer also removes the segment's name if still there). A reader
        waiting on a closed writer, or a writer waiting on a closed reader,
        gets an error. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ready = False
        for link in (self._remote, self._writer):
            if link is not None:
                link.close()
        self._remote, self._writer = None, None
        if self._ring is not None:
            if self._is_writer:
                self._ring.unlink()
            self._ring = None

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @staticmethod
    def create_from_process_group(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        blocking: bool = True,
    ) -> MessageQueue:
        """Collective over ``pg``: a queue written by ``writer_rank`` and read
        by every other rank (this rank's side is returned). Ranks on the
        writer's host (same :func:`host_identity`) read shared memory, others
        TCP. ``pg`` is a ``torch.distributed.ProcessGroup`` or any object with
        ``rank``, ``world_size``, ``broadcast_obj(obj, src)``,
        ``all_gather_obj(obj)`` and ``barrier()`` (a StatelessProcessGroup).
        With ``blocking`` every side is ready on return; otherwise the first
        enqueue/dequeue (or :meth:`wait_until_ready`) finishes joining."""
        group = _Group(pg)
        if not 0 <= writer_rank < group.world_size:
            raise ValueError(f"groupcomm: writer_rank {writer_rank} outside a group of {group.world_size}")
        # The segment's name is known to every rank before it exists, so that
        # if the writer dies during setup the others remove what it left.
        planned = segment_name("mq-") if group.rank == writer_rank else None
        gathered = group.all_gather((host_identity(config_module.load().host_id), planned))
        hosts, name = [h for h, _ in gathered], gathered[writer_rank][1]
        local = [r for r in range(group.world_size) if r != writer_rank and hosts[r] == hosts[writer_rank]]
        queue: MessageQueue | None = None
        failure: BaseException | None = None
        try:
            if group.rank == writer_rank:
                try:
                    queue = MessageQueue(
                        group.world_size - 1, len(local), local, max_chunk_bytes, max_chunks, _shm_name=name
                    )
                except Exception as exc:  # noqa: BLE001 - reported to every rank below
                    failure = exc
                group.broadcast(queue.export_handle() if queue is not None else None, writer_rank)
            else:
                handle = group.broadcast(None, writer_rank)
                if handle is not None:
                    try:
                        queue = MessageQueue.create_from_handle(handle, group.rank)
                    except Exception as exc:  # noqa: BLE001
                        failure = exc
            _settle([queue], failure, group)
        except BaseException:
            remove_segments([name])
            raise
        queue.unlink()
        group.all_gather(None)  # so the name is gone from /dev/shm when any rank returns
        if blocking:
            queue.wait_until_ready()
        return queue

    @staticmethod
    def create_from_process_group_single_reader(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
    ) -> tuple[MessageQueue, list[MessageQueue]]:
        """Collective over ``pg`` (see :meth:`create_from_process_group`):
        every rank writes a queue of its own that only ``reader_rank`` reads.
        Returns ``(this rank's writer queue, readers)``: on ``reader_rank``,
        ``readers[i]`` reads rank ``i``'s queue for every rank of ``pg`` in
        rank order, its own included (the reader rank also writes a queue that
        it reads itself); ``[]`` elsewhere."""
        group = _Group(pg)
        if not 0 <= reader_rank < group.world_size:
            raise ValueError(f"groupcomm: reader_rank {reader_rank} outside a group of {group.world_size}")
        # every segment's name is known to the reader before it exists (see above)
        gathered = group.all_gather((host_identity(config_module.load().host_id), segment_name("mq-")))
        hosts, names = [h for h, _ in gathered], [n for _, n in gathered]
        local = hosts[group.rank] == hosts[reader_rank]
        writer: MessageQueue | None = None
        failure: BaseException | None = None
        readers: list[MessageQueue] = []
        try:
            try:
                writer = MessageQueue(
                    1,
                    int(local),
                    [reader_rank] if local else [],
                    max_chunk_bytes,
                    max_chunks,
                    _shm_name=names[group.rank],
                )
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                failure = exc
            handles = group.all_gather(writer.export_handle() if writer is not None else None)
            if group.rank == reader_rank and failure is None:
                try:
                    for handle in handles:
                        if handle is None:
                            break
                        readers.append(MessageQueue.create_from_handle(handle, reader_rank))
                except Exception as exc:  # noqa: BLE001
                    failure = exc
            _settle([writer, *readers], failure, group)
        except BaseException:
            remove_segments(names if group.rank == reader_rank else [names[group.rank]])
            raise
        writer.unlink()
        group.all_gather(None)  # so the names are gone from /dev/shm when any rank returns
        if blocking:
            writer.wait_until_ready()
            for reader in readers:
                reader.wait_until_ready()
        return writer, readers


class _Group:
    """The object exchange that queue setup needs, over a ProcessGroup or
    anything shaped like a StatelessProcessGroup."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self._torch = isinstance(pg, dist.ProcessGroup)
        if self._torch:
            self.rank = dist.get_rank(pg)
            self.world_size = dist.get_world_size(pg)
        else:
            self.rank = pg.rank
            self.world_size = pg.world_size

    def broadcast(self, obj: Any, src: int) -> Any:
        if not self._torch:
            return self._pg.broadcast_obj(obj, src)
        objects = [obj]
        dist.broadcast_object_list(objects, group=self._pg, group_src=src)
        return objects[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self._torch:
            return list(self._pg.all_gather_obj(obj))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self._pg)
        return gathered


def _settle(queues: Sequence[MessageQueue | None], failure: BaseException | None, group: _Group) -> None:
    """The setup's barrier: every rank learns whether any rank failed (so none
    waits on a side that will never come), and all have attached after it."""
    try:
        reports = group.all_gather(None if failure is None else f"{type(failure).__name__}: {failure}")
    except BaseException:
        # a peer died during setup: whoever holds the name removes it
        for queue in queues:
            if queue is not None:
                queue.unlink()
                queue.close()
        raise
    if failure is None and all(report is None for report in reports) and all(q is not None for q in queues):
        return
    for queue in queues:
        if queue is not None:
            queue.close()
    if failure is not None:
        raise failure
    rank, report = next((r, m) for r, m in enumerate(reports) if m is not None)
    raise GroupCommError(f"groupcomm: MessageQueue setup failed on rank {rank}: {report}")
