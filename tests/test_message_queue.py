"""MessageQueue: one writer broadcasting objects to readers through a
shared-memory ring (same host) or TCP (other hosts), checked in-process and
on real spawned ranks: values, multi-chunk messages, ring wrap-around,
single-reader queues, idle readers that use no CPU, timeouts, a dead writer,
and nothing left in /dev/shm."""

from __future__ import annotations

import os
import pickle
import signal
import stat
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from _harness import run_ranks, shm_segments


def mq_segments() -> list[str]:
    # only our own kind: other suites' segments are not this file's business
    return [n for n in shm_segments() if n.startswith("groupcomm-mq-")]


def payload(i: int) -> Any:
    kinds = [
        i,
        {"step": i, "ids": list(range(i % 7)), "name": f"req-{i}", "nested": {"x": i * 0.5}},
        ("tuple", i, None),
        b"\x00" * (i % 5),
        f"text {i}" * (i % 3),
    ]
    return kinds[i % len(kinds)]


def big_payloads() -> list[Any]:
    # sizes around and far beyond a 4096-byte chunk
    rnd = bytes(range(256))
    return [
        os.urandom(0),
        bytes(4096 - 64),
        rnd * 16,  # 4096 B: pickled it needs a second chunk
        rnd * 100,
        {"blob": rnd * 4096, "tail": list(range(1000))},  # 1 MiB and then some
        rnd * 3,
    ]


# ---------------------------------------------------------------------------------------------
# In-process: the ring itself, and queues whose readers are threads


def test_ring_segment_is_private_and_checks_its_layout() -> None:
    from torch_groupcomm import _C

    name = "/groupcomm-mq-test-" + os.urandom(8).hex()
    writer = _C.ShmRing(name=name, create=True, n_chunks=3, chunk_bytes=1000, n_readers=2, timeout_ms=1000)
    try:
        assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600
        assert writer.chunk_bytes == 1024  # rounded up to a cache line
        assert writer.mapped_bytes >= 3 * 1024 + 4096
        assert writer.attached_readers == 0
        r0 = _C.ShmRing(name=name, create=False, n_chunks=3, chunk_bytes=1000, n_readers=2, reader_index=0)
        with pytest.raises(RuntimeError, match="attached twice"):
            _C.ShmRing(name=name, create=False, n_chunks=3, chunk_bytes=1000, n_readers=2, reader_index=0)
        with pytest.raises(RuntimeError, match="unexpected size|another ring layout"):
            _C.ShmRing(name=name, create=False, n_chunks=4, chunk_bytes=1000, n_readers=2, reader_index=1)
        with pytest.raises(ValueError, match="reader index"):
            _C.ShmRing(name=name, create=False, n_chunks=3, chunk_bytes=1000, n_readers=2, reader_index=2)
        r1 = _C.ShmRing(name=name, create=False, n_chunks=3, chunk_bytes=1000, n_readers=2, reader_index=1)
        assert writer.attached_readers == 2
        writer.unlink()
        assert not os.path.exists("/dev/shm" + name)

        for msg in [b"", b"a", bytes(1024), bytes(1025)]:
            writer.write(msg)
            assert r0.read() == msg
            assert r1.read() == msg
        # three chunks in flight at most: the fourth waits for the slow reader
        for _ in range(3):
            writer.write(b"x")
        assert [r0.read() for _ in range(3)] == [b"x"] * 3
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out"):
            writer.write(b"y", timeout_ms=300)
        assert 0.25 < time.monotonic() - start < 2
        assert [r1.read() for _ in range(3)] == [b"x"] * 3
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out"):
            r0.read(timeout_ms=300)
        assert 0.25 < time.monotonic() - start < 2
        writer.write(b"after a timeout", timeout_ms=300)
        assert r0.read(0) == r1.read(0) == b"after a timeout"

        # a message three times the whole ring streams through it
        big = os.urandom(3 * 3 * 1024 + 17)
        got = [None, None]

        def read(i: int, ring) -> None:
            got[i] = ring.read(5000)

        threads = [threading.Thread(target=read, args=(i, r)) for i, r in enumerate([r0, r1])]
        for t in threads:
            t.start()
        writer.write(big, timeout_ms=5000)
        for t in threads:
            t.join()
        assert got == [big, big]

        # Ctrl-C reaches a waiting reader, and the ring stays usable (the read
        # is bounded so that a lost signal fails the test instead of hanging it).
        # A run started in the background of a non-interactive shell inherits
        # SIGINT ignored, and Python then installs no handler: install it here.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                r0.read(30000)
            timer.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        writer.write(b"after ctrl-c")
        assert r0.read() == r1.read() == b"after ctrl-c"

        del writer  # a reader waiting on a closed writer is told so
        with pytest.raises(RuntimeError, match="writer closed"):
            r0.read(5000)
    finally:
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)


def test_full_dev_shm_fails_cleanly() -> None:
    from torch_groupcomm import _C

    fs = os.statvfs("/dev/shm")
    too_big = 2 * fs.f_blocks * fs.f_frsize  # more than /dev/shm can ever hold
    name = "/groupcomm-mq-test-" + os.urandom(8).hex()
    with pytest.raises(RuntimeError, match="cannot reserve .* bytes of shared memory"):
        _C.ShmRing(name=name, create=True, n_chunks=2, chunk_bytes=too_big // 2, n_readers=1)
    assert not os.path.exists("/dev/shm" + name)


def test_queue_with_threads_as_local_and_remote_readers() -> None:
    from torch_groupcomm import CommTimeoutError, MessageQueue
    from torch_groupcomm.message_queue import Handle

    # ranks 1 and 2 share the writer's host, rank 3 reads over TCP
    writer = MessageQueue(3, 2, [1, 2], max_chunk_bytes=4096, max_chunks=4, connect_ip="127.0.0.1")
    handle = writer.export_handle()
    assert isinstance(handle, Handle) and handle.remote_addr[0] == "127.0.0.1"
    handle = pickle.loads(pickle.dumps(handle))
    readers = [MessageQueue.create_from_handle(handle, rank) for rank in (1, 2, 3)]
    assert [r.is_local_reader for r in readers] == [True, True, False]
    assert readers[2].is_remote_reader and writer.is_writer
    assert mq_segments() != []  # not yet unlinked: the writer has not seen every reader
    writer.wait_until_ready(timeout=10)
    for r in readers:
        r.wait_until_ready(timeout=10)
    assert mq_segments() == []

    messages = [payload(i) for i in range(60)] + big_payloads()
    results: list[list[Any]] = [[], [], []]

    def consume(i: int) -> None:
        for _ in messages:
            results[i].append(readers[i].dequeue(timeout=30))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for m in messages:
        writer.enqueue(m, timeout=30)
    for t in threads:
        t.join()
    assert results == [messages] * 3

    for r in readers:
        with pytest.raises(CommTimeoutError, match="timed out"):
            r.dequeue(timeout=0.2)
    writer.broadcast_object({"still": "working"})
    assert [r.broadcast_object() for r in readers] == [{"still": "working"}] * 3
    with pytest.raises(ValueError):
        readers[0].enqueue(1)
    with pytest.raises(ValueError):
        writer.dequeue()

    writer.close()
    with pytest.raises(Exception, match="closed"):
        readers[0].dequeue(timeout=5)
    with pytest.raises(Exception, match="closed"):
        readers[2].dequeue(timeout=5)
    for r in readers:
        r.close()
    assert mq_segments() == []


# ---------------------------------------------------------------------------------------------
# Real ranks


class _DuckGroup:
    """What a StatelessProcessGroup offers, served by torch.distributed."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        objects = [obj]
        dist.broadcast_object_list(objects, src=src)
        return objects[0]

    def all_gather_obj(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()


def _broadcast_loop(mq, rank: int, writer: int, n: int) -> None:
    for i in range(n):
        got = mq.broadcast_object(payload(i) if rank == writer else None)
        assert got == payload(i), (i, got)


def _big_objects(mq, rank: int, writer: int) -> None:
    expected = big_payloads()
    if rank == writer:
        for obj in expected:
            mq.enqueue(obj)
    else:
        for i, obj in enumerate(expected):
            got = mq.dequeue(timeout=60)
            assert got == obj, f"big object {i} differs"


def check_world(rank: int, world: int) -> dict:
    from torch_groupcomm import CommTimeoutError, MessageQueue

    pg = dist.group.WORLD
    mq = MessageQueue.create_from_process_group(pg, 1 << 16, 6)
    dist.barrier()
    assert mq_segments() == [], mq_segments()
    assert mq.is_writer == (rank == 0) and mq.is_local_reader == (rank != 0)
    _broadcast_loop(mq, rank, 0, 200)
    # many messages in a row: the writer runs up to 6 ahead, then waits, the ring wraps
    if rank == 0:
        for i in range(300):
            mq.enqueue(("burst", i))
    else:
        assert [mq.dequeue(timeout=60) for _ in range(300)] == [("burst", i) for i in range(300)]

    # nobody writes: a reader's wait times out, and the queue works afterwards
    if rank != 0:
        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match="timed out"):
            mq.dequeue(timeout=0.5)
        assert 0.4 < time.monotonic() - start < 3
    dist.barrier()
    assert mq.broadcast_object({"after": "timeout"} if rank == 0 else None) == {"after": "timeout"}

    # a short lean loop, reported for information
    dist.barrier()
    obj = {"step": 1, "ids": [1, 2, 3], "data": b"x" * 64}
    start = time.perf_counter()
    for _ in range(2000):
        mq.broadcast_object(obj if rank == 0 else None)
    per_message_us = (time.perf_counter() - start) / 2000 * 1e6
    mq.close()

    # multi-chunk objects, written by the last rank of a torch sub-group
    if world > 2:
        sub = dist.new_group(list(range(1, world)))
        if rank >= 1:
            with MessageQueue.create_from_process_group(sub, 4096, 4, writer_rank=world - 2) as big:
                _big_objects(big, rank, world - 1)
                _broadcast_loop(big, rank, world - 1, 20)
    else:
        with MessageQueue.create_from_process_group(pg, 4096, 4, writer_rank=world - 1) as big:
            _big_objects(big, rank, world - 1)

    # the duck-typed group interface, not blocking: the first use finishes joining
    duck = MessageQueue.create_from_process_group(_DuckGroup(), 1 << 12, 3, writer_rank=1, blocking=False)
    _broadcast_loop(duck, rank, 1, 30)
    duck.close()

    # single-reader queues: every rank writes, the reader rank reads all
    reader = world - 1
    mine, readers = MessageQueue.create_from_process_group_single_reader(pg, 4096, 4, reader_rank=reader)
    assert mine.is_writer
    assert len(readers) == (world if rank == reader else 0)
    for i in range(20):  # the reader rank reads its own queue too, so it must keep up
        mine.enqueue((rank, i, payload(i)))
        if rank == reader:
            for src, q in enumerate(readers):
                assert q.dequeue(timeout=60) == (src, i, payload(i))
    dist.barrier()
    mine.close()
    for q in readers:
        q.close()
    dist.barrier()
    assert mq_segments() == [], mq_segments()
    return {"per_message_us": per_message_us}


@pytest.mark.parametrize("world", [2, 4])
def test_broadcast_on_one_host(world: int) -> None:
    results = run_ranks(check_world, world, backend="gloo")
    print(f"world {world}: broadcast_object {results[0]['per_message_us']:.1f} us/message")
    assert mq_segments() == []


def check_other_host(rank: int, world: int) -> str:
    from torch_groupcomm import CommTimeoutError, MessageQueue

    pg = dist.group.WORLD
    mq = MessageQueue.create_from_process_group(pg, 4096, 4)
    assert mq.is_writer == (rank == 0)
    assert mq.is_local_reader == (rank == 1)
    assert mq.is_remote_reader == (rank == 2)
    dist.barrier()
    assert mq_segments() == []
    _broadcast_loop(mq, rank, 0, 100)
    _big_objects(mq, rank, 0)
    if rank != 0:
        with pytest.raises(CommTimeoutError, match="timed out"):
            mq.dequeue(timeout=0.3)
    dist.barrier()
    # an idle TCP reader sleeps in recv
    if rank == 0:
        time.sleep(2)
        mq.enqueue("late")
    else:
        cpu = time.process_time()
        assert mq.dequeue() == "late"
        assert time.process_time() - cpu < 0.2

    # the reader on the other host, every other rank writing to it
    mine, readers = MessageQueue.create_from_process_group_single_reader(pg, 4096, 4, reader_rank=2, blocking=True)
    assert mine.is_writer and len(readers) == (3 if rank == 2 else 0)
    if rank == 2:
        assert [q.is_remote_reader for q in readers] == [True, True, False]
    for i in range(10):
        mine.enqueue((rank, payload(i)))
        if rank == 2:
            assert [q.dequeue(timeout=60) for q in readers] == [(src, payload(i)) for src in range(3)]
    dist.barrier()
    for q in [mq, mine, *readers]:
        q.close()
    return "ok"


def test_reader_on_another_host_reads_over_tcp() -> None:
    results = run_ranks(check_other_host, 3, backend="gloo", env={"GROUPCOMM_HOST_ID": ["a", "a", "b"]})
    assert results == ["ok"] * 3
    assert mq_segments() == []


def check_idle_and_dead_writer(rank: int, world: int) -> Any:
    from torch_groupcomm import CommTimeoutError, GroupCommError, MessageQueue

    mq = MessageQueue.create_from_process_group(dist.group.WORLD, 4096, 3)
    # the writer fills the ring; one more message times out until the reader catches up
    if rank == 0:
        for i in range(3):
            mq.enqueue(i)
        with pytest.raises(CommTimeoutError, match="timed out"):
            mq.enqueue(3, timeout=0.3)
    dist.barrier()
    if rank == 1:
        assert [mq.dequeue(timeout=10) for _ in range(3)] == [0, 1, 2]
    dist.barrier()

    # an idle reader: five seconds of waiting cost well under 10% of a core
    if rank == 0:
        time.sleep(5)
        mq.enqueue("wake up")
    else:
        cpu, wall = time.process_time(), time.monotonic()
        assert mq.dequeue() == "wake up"
        waited, used = time.monotonic() - wall, time.process_time() - cpu
        assert waited > 4, waited
        assert used < 0.5, f"idle reader used {used:.3f} s of CPU in {waited:.1f} s"

    # the writer dies: the waiting reader is told so within seconds
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(GroupCommError, match=r"writer process \d+ exited"):
        mq.dequeue()
    return {"raised_after_s": time.monotonic() - start, "used": used}


def test_idle_reader_sleeps_and_dead_writer_is_reported() -> None:
    results = run_ranks(check_idle_and_dead_writer, 2, backend="gloo", may_die=[0])
    print(
        f"idle reader: {results[1]['used']:.3f} s CPU in 5 s; dead writer reported after "
        f"{results[1]['raised_after_s']:.2f} s"
    )
    assert results[0] is None
    assert results[1]["raised_after_s"] < 5, results[1]
    assert mq_segments() == []


def test_remote_readers_listen_on_loopback_and_reject_forged_messages() -> None:
    from torch_groupcomm import GroupCommError, MessageQueue
    from torch_groupcomm.message_socket import _LENGTH, _MAC_BYTES, _mac

    writer = MessageQueue(1, 0)  # one reader, on "another host"
    assert writer.handle.remote_addr[0] == "127.0.0.1"  # no host given: loopback only
    reader = MessageQueue.create_from_handle(writer.export_handle(), 1)
    ready = threading.Thread(target=writer.wait_until_ready, kwargs={"timeout": 10})
    ready.start()
    reader.wait_until_ready(timeout=10)
    ready.join()
    writer.enqueue({"genuine": True})
    assert reader.dequeue(timeout=10) == {"genuine": True}
    # a frame whose tag was not made with the queue's secret is never unpickled
    forged = pickle.dumps({"forged": True})
    bad_tag = _mac(b"not the secret", forged)
    writer._remote._socks[0].sendall(_LENGTH.pack(_MAC_BYTES + len(forged)) + bad_tag + forged)
    with pytest.raises(GroupCommError, match="failed authentication"):
        reader.dequeue(timeout=10)
    reader.close()
    writer.close()
