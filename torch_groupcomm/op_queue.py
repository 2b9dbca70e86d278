"""An ordered executor: a group's ops run one at a time, in issue order.

Every rank issues a group's collectives in the same order; running them in that
order on one thread keeps the ranks matched while the caller goes on
(``async_op=True``). A synchronous op waits for the queue to drain and then runs
on the caller's thread, which saves a thread hop on the common path.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, List, Optional, Tuple, Union

import torch

Task = Callable[[], Any]


class OpQueue:
    """Runs tasks in submission order and reports each through a torch Future."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: Deque[Tuple[Task, torch.futures.Future]] = collections.deque()
        self._running = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._exec = threading.Lock()

    def submit(self, task: Task, async_op: bool = True) -> Union[torch.futures.Future, List]:
        """Run ``task`` after everything submitted before it. Asynchronously:
        return a future that gets the task's value (a list of tensors) or its
        exception. Otherwise: run it on this thread and return its value."""
        if not async_op:
            result = self.run(task)
            return result if result is not None else []
        future: torch.futures.Future = torch.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"groupcomm: group {self._name} is shut down")
            self._pending.append((task, future))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"groupcomm-{self._name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return future

    def run(self, task: Callable[..., Any], *args: Any) -> Any:
        """Run ``task(*args)`` on this thread after everything submitted before
        it; return its value."""
        self.drain()
        with self._exec:
            return task(*args)

    def idle(self) -> bool:
        """Whether nothing is queued or running."""
        with self._cond:
            return not self._pending and not self._running

    def drain(self) -> None:
        """Block until every submitted task has finished."""
        if self._thread is None:
            return  # nothing was ever queued
        with self._cond:
            self._cond.wait_for(lambda: not self._pending and not self._running)

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued tasks, then stop the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                task, future = self._pending.popleft()
                self._running = True
            with self._exec:
                _complete(future, task)
            with self._cond:
                self._running = False
                self._cond.notify_all()


def _complete(future: torch.futures.Future, task: Task) -> None:
    try:
        result = task()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
        future.set_exception(exc)
    else:
        future.set_result(result if result is not None else [])
