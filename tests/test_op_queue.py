"""The groups' ordered executor (``torch_groupcomm._C.OpQueue``, csrc/queue/):
tasks from Python and from several threads run one at a time in submission
order, a synchronous call runs after everything queued before it, failures
reach the future, and a closed queue refuses work. The c10d ops on it, the
bridge's native ones included, are checked on real ranks in
test_collectives.py (check_async_order_across_paths)."""

from __future__ import annotations

import threading
import time

import pytest

from torch_groupcomm._native import _C


def test_tasks_run_in_order_and_complete_their_futures() -> None:
    queue = _C.OpQueue("order")
    ran, running = [], []

    def task(i: int):
        def run():
            running.append(i)
            assert len(running) == 1, "two tasks ran at once"
            time.sleep(0.001 if i % 3 == 0 else 0)
            ran.append(i)
            running.pop()
            return [i] if i % 2 else None  # None becomes []

        return run

    futures = [queue.submit(task(i)) for i in range(30)]
    # synchronous calls run on this thread, behind everything queued before them
    assert queue.submit(lambda: ran.copy(), async_op=False) == list(range(30))
    assert queue.run(lambda a, b: (a, b, threading.current_thread() is threading.main_thread()), 1, 2) == (1, 2, True)
    assert [f.wait() for f in futures] == [[i] if i % 2 else [] for i in range(30)]
    assert queue.idle()
    queue.close()


def test_submissions_from_many_threads_keep_each_threads_order() -> None:
    queue = _C.OpQueue("threads")
    ran = []
    lock = threading.Lock()

    def submitter(t: int) -> None:
        for i in range(200):

            def record(t=t, i=i):
                with lock:
                    ran.append((t, i))

            queue.submit(record, async_op=bool(i % 4))

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    queue.drain()
    assert len(ran) == 800
    for t in range(4):
        assert [i for who, i in ran if who == t] == list(range(200)), t
    queue.close()


def test_failures_reach_the_caller() -> None:
    queue = _C.OpQueue("failures")

    def boom():
        raise ValueError("bad value")

    future = queue.submit(boom)
    with pytest.raises(ValueError, match="bad value"):
        future.wait()
    with pytest.raises(KeyError):
        queue.submit(lambda: {}["missing"], async_op=False)
    with pytest.raises(ZeroDivisionError):
        queue.run(lambda x: 1 / x, 0)
    assert queue.submit(lambda: [7]).wait() == [7], "a failure does not stop the queue"
    queue.close()
    with pytest.raises(RuntimeError, match="group failures is shut down"):
        queue.submit(lambda: None)


def test_close_lets_queued_tasks_finish() -> None:
    queue = _C.OpQueue("close")
    done = []
    futures = [queue.submit(lambda i=i: done.append(i) or [i]) for i in range(5)]
    queue.close(timeout=10.0)
    assert done == list(range(5))
    assert [f.wait() for f in futures] == [[i] for i in range(5)]


def test_close_while_a_synchronous_call_runs_returns_when_it_ends() -> None:
    """The worker leaves once the caller holding the queue lets go: close()
    does not sit out its timeout."""
    queue = _C.OpQueue("close-sync")
    queue.submit(lambda: None).wait()  # the worker exists
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(10)

    holder = threading.Thread(target=lambda: queue.run(hold))
    holder.start()
    assert entered.wait(10)
    threading.Timer(0.2, release.set).start()
    start = time.monotonic()
    queue.close(timeout=10.0)
    holder.join(10)
    assert time.monotonic() - start < 5.0
