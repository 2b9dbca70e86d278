"""The TCP side of a :class:`~torch_groupcomm.message_queue.MessageQueue`:
the writer's connections to readers on other hosts and a remote reader's
connection to the writer.

A reader opens with the queue's secret token and its rank; the writer answers
one byte once it has accepted every reader. Each message then travels as its
length, an HMAC-SHA256 tag made with the token, and the pickled bytes; a
reader checks the tag before anything is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import Callable

from .errors import CommTimeoutError, GroupCommError

_LENGTH = struct.Struct("!Q")
_HELLO_RANK = struct.Struct("!i")
_READY = b"\x01"
_MAC_BYTES = 32
# Below this size a frame goes out in one send (header and payload joined).
_JOIN_BYTES = 1 << 16


def default_connect_ip() -> str:
    """Where the writer listens for readers on other hosts: ``GROUPCOMM_MQ_IP``,
    else loopback (nothing is exposed on a network unless asked for)."""
    return os.environ.get("GROUPCOMM_MQ_IP") or "127.0.0.1"


def _mac(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        part = sock.recv(n)
        if not part:
            raise ConnectionError("connection closed")
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


class RemoteReaders:
    """The writer's side: a listener, then one connection per remote reader."""

    def __init__(self, ip: str, n_reader: int, token: bytes) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self._listener: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((ip, 0))
        self._listener.listen(n_reader)
        self.addr: tuple[str, int] = (ip, self._listener.getsockname()[1])
        self._expected = n_reader
        self._token = token
        self._socks: list[socket.socket] = []

    def accept(self, left: Callable[[], float | None]) -> None:
        """Accept every reader (``left()`` gives the seconds remaining, or raises)."""
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < self._expected:
            self._listener.settimeout(left())
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                raise CommTimeoutError(
                    f"groupcomm: MessageQueue writer timed out waiting for remote readers "
                    f"({len(by_rank)} of {self._expected} connected)"
                ) from None
            try:
                conn.settimeout(left())
                hello = _recv_exact(conn, len(self._token) + _HELLO_RANK.size)
            except (OSError, ConnectionError):
                conn.close()
                continue
            token, rank = hello[: len(self._token)], _HELLO_RANK.unpack_from(hello, len(self._token))[0]
            if not hmac.compare_digest(token, self._token) or rank in by_rank:
                conn.close()  # not one of ours
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_READY)
            conn.settimeout(None)
            by_rank[rank] = conn
        self._socks = [by_rank[r] for r in sorted(by_rank)]
        self._listener.close()
        self._listener = None

    def send(self, data: bytes, timeout: float | None) -> None:
        """Send one message to every reader; ``timeout`` bounds each send."""
        header = _LENGTH.pack(_MAC_BYTES + len(data)) + _mac(self._token, data)
        joined = header + data if len(data) < _JOIN_BYTES else None
        for sock in self._socks:
            sock.settimeout(timeout)
            try:
                if joined is not None:
                    sock.sendall(joined)
                else:
                    sock.sendall(header)
                    sock.sendall(data)
            except socket.timeout:
                raise CommTimeoutError(
                    f"groupcomm: MessageQueue send to a remote reader timed out after {timeout} s"
                ) from None
            except OSError as exc:
                raise GroupCommError(f"groupcomm: MessageQueue remote reader connection failed: {exc}") from None

    def close(self) -> None:
        for sock in [*self._socks, self._listener]:
            if sock is not None:
                sock.close()
        self._socks, self._listener = [], None


class WriterConnection:
    """A remote reader's side: one connection to the writer."""

    def __init__(self, addr: tuple[str, int], token: bytes, rank: int, connect_timeout: float) -> None:
        self._token = token
        self._rx = bytearray()  # received, not yet returned
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.create_connection(addr, timeout=connect_timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(token + _HELLO_RANK.pack(rank))
        except OSError as exc:
            self.close()
            raise GroupCommError(f"groupcomm: cannot connect to the message queue writer at {addr}: {exc}") from None

    def wait_accepted(self, seconds: float | None, what: str) -> None:
        """Wait for the writer's acceptance (``what`` names the wait in a timeout)."""
        self._sock.settimeout(seconds)
        try:
            ack = self._sock.recv(1)
        except socket.timeout:
            raise CommTimeoutError(f"groupcomm: {what}") from None
        if ack != _READY:
            raise GroupCommError("groupcomm: the message queue writer refused or dropped this reader")
        self._sock.settimeout(None)

    def recv(self, timeout: float | None) -> memoryview:
        """The next message's checked payload; bytes received before a
        timeout stay buffered for the next call."""
        message = self._frame(timeout)
        payload = memoryview(message)[_MAC_BYTES:]
        if not hmac.compare_digest(bytes(message[:_MAC_BYTES]), _mac(self._token, payload)):
            raise GroupCommError("groupcomm: MessageQueue message from the writer failed authentication; not unpickled")
        return payload

    def _frame(self, timeout: float | None) -> bytearray:
        sock, buf = self._sock, self._rx
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if len(buf) >= _LENGTH.size:
                end = _LENGTH.size + _LENGTH.unpack_from(buf)[0]
                if len(buf) >= end:
                    message = buf[_LENGTH.size : end]
                    del buf[:end]
                    return message
                need = end - len(buf)
            else:
                need = _LENGTH.size - len(buf)
            sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            try:
                part = sock.recv(max(need, _JOIN_BYTES))
            except socket.timeout:
                raise CommTimeoutError(f"groupcomm: MessageQueue read timed out after {timeout} s") from None
            except OSError as exc:
                raise GroupCommError(f"groupcomm: MessageQueue connection to the writer failed: {exc}") from None
            if not part:
                raise GroupCommError(
                    "groupcomm: MessageQueue writer closed the connection (writer gone or queue closed)"
                )
            buf += part

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
