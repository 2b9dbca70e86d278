"""A ctypes binding of NCCL's C API (``libnccl.so.2``).

Why ctypes and not a C++ extension:

* the library is chosen at run time, so the process uses one NCCL: the one
  already loaded (by torch, say), the one named in ``GROUPCOMM_NCCL_LIBRARY``,
  an ``nvidia-nccl-cu12``/``-cu13`` wheel's, or the system's (see :func:`find_library`);
* building needs no CUDA or NCCL headers, and no NCCL at all;
* a ``ctypes.CDLL`` call releases the GIL while NCCL runs, so a blocking call
  (communicator setup, a group end) does not stall other Python threads;
* importing this module loads nothing: it imports on machines without a GPU or
  without NCCL, and only :class:`NcclLibrary` / :func:`library` open the library.

Pointers, CUDA streams and communicators cross this API as plain integers
(``tensor.data_ptr()``, ``torch.cuda.current_stream().cuda_stream``) or
``ctypes.c_void_p``; enums as ints (:class:`DataType`, :class:`RedOp`).
Enum values follow ``nccl.h`` of NCCL 2.32 (stable since NCCL 2.x).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import importlib.util
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any, Callable, Union

import torch

__all__ = [
    "DataType",
    "NcclError",
    "NcclLibrary",
    "NcclUniqueId",
    "RedOp",
    "ScalarResidence",
    "find_library",
    "library",
    "mapped_library",
    "nccl_dtype",
]

ENV_VAR = "GROUPCOMM_NCCL_LIBRARY"
SONAME = "libnccl.so.2"
UNIQUE_ID_BYTES = 128
_SUCCESS = 0

# A communicator handle (ncclComm_t) as returned by comm_init_rank, or its address.
Comm = Union[ctypes.c_void_p, int, None]


class RedOp(enum.IntEnum):
    """The built-in ``ncclRedOp_t`` values."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


class DataType(enum.IntEnum):
    """``ncclDataType_t`` values."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8_E4M3 = 10
    FLOAT8_E5M2 = 11


class ScalarResidence(enum.IntEnum):
    """``ncclScalarResidence_t``: where the scalar of a PreMulSum op lives."""

    DEVICE = 0  # device memory, read while the collective runs
    HOST_IMMEDIATE = 1  # host memory, read before ncclRedOpCreatePreMulSum returns


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes; ncclCommInitRank takes it by value."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class NcclError(RuntimeError):
    """An NCCL call returned a result other than ncclSuccess.

    ``code`` is the ``ncclResult_t``, ``function`` the C function that failed;
    the message carries NCCL's text for the code and its last-error detail."""

    def __init__(self, function: str, code: int, error_string: str, last_error: str = "") -> None:
        self.code: int = int(code)
        self.function: str = function
        self.error_string: str = error_string
        self.last_error: str = last_error
        detail = f": {last_error}" if last_error else ""
        super().__init__(f"groupcomm: NCCL {function} failed: {error_string} (ncclResult {code}){detail}")


# ----------------------------------------------------------------------------
# Finding the library


def _from_env() -> str | None:
    """The path in GROUPCOMM_NCCL_LIBRARY; an explicit choice, so a wrong path is an error."""
    path = os.environ.get(ENV_VAR, "")
    if not path:
        return None
    if not os.path.exists(path):
        raise FileNotFoundError(f"groupcomm: {ENV_VAR}={path!r} names no file")
    return path


def _scan_maps(lines: Iterable[str], prefix: str = "libnccl.so") -> str | None:
    """The first mapped file whose name starts with ``prefix`` in /proc/<pid>/maps lines."""
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].rstrip("\n")
        if not path.startswith("/") or path.endswith(" (deleted)"):
            continue
        if os.path.basename(path).startswith(prefix):
            return path
    return None


def mapped_library(prefix: str) -> str | None:
    """The path of a library this process has mapped whose file name starts
    with ``prefix`` (``"libnccl.so"``, ``"libcudart.so"``), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return _scan_maps(maps.readlines(), prefix)
    except OSError:  # not Linux
        return None


def _from_process() -> str | None:
    """An NCCL already mapped into this process: loading a second one would
    give two NCCLs (two sets of globals, communicators that cannot mix)."""
    return mapped_library("libnccl.so")


def _wheel_dirs() -> list[str]:
    """Directories that may hold the ``nvidia`` namespace package, in search order."""
    dirs: list[str] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(os.path.dirname(p) for p in spec.submodule_search_locations)
    dirs.extend(p or os.getcwd() for p in sys.path if isinstance(p, str))
    return dirs


def _from_wheel() -> str | None:
    """An nvidia-nccl-cu12 or -cu13 wheel's library (``nvidia/nccl/lib/libnccl.so.2``)."""
    seen = set()
    for base in _wheel_dirs():
        if base in seen:
            continue
        seen.add(base)
        candidate = os.path.join(base, "nvidia", "nccl", "lib", SONAME)
        if os.path.isfile(candidate):
            return candidate
    return None


def _from_system() -> str | None:
    """An NCCL the dynamic loader finds by itself (ldconfig cache, LD_LIBRARY_PATH)."""
    try:
        found = ctypes.util.find_library("nccl")
    except Exception:  # noqa: BLE001 - its helper tools may be missing or broken
        found = None
    if found:
        return found
    try:
        ctypes.CDLL(SONAME)
    except OSError:
        return None
    return SONAME


_WAYS: tuple[tuple[str, str], ...] = (
    ("env", "_from_env"),
    ("process", "_from_process"),
    ("wheel", "_from_wheel"),
    ("system", "_from_system"),
)


def find_library() -> tuple[str, str]:
    """Which NCCL to load: ``(path or soname, how)``.

    Tried in order, first hit wins: ``"env"`` (GROUPCOMM_NCCL_LIBRARY),
    ``"process"`` (an NCCL this process already loaded, so only one is in use),
    ``"wheel"`` (an nvidia-nccl-cu12/-cu13 wheel), ``"system"`` (the dynamic loader's
    search path). Raises FileNotFoundError when none yields a library."""
    module = sys.modules[__name__]
    for how, name in _WAYS:
        # looked up at call time, so each step can be replaced on its own
        path = getattr(module, name)()
        if path:
            return path, how
    raise FileNotFoundError(
        "groupcomm: no NCCL library found. Looked in: "
        f"(1) ${ENV_VAR} (unset), "
        "(2) the libraries already loaded in this process, "
        f"(3) an nvidia-nccl-cu12 or -cu13 wheel (nvidia/nccl/lib/{SONAME} on sys.path), "
        f"(4) the system loader path (ldconfig, LD_LIBRARY_PATH) for {SONAME}. "
        f"Fix: `pip install nvidia-nccl-cu13` (CUDA 13; nvidia-nccl-cu12 for CUDA 12), "
        f"or set {ENV_VAR} to the path of {SONAME}."
    )


# ----------------------------------------------------------------------------
# The library

_int_p = ctypes.POINTER(ctypes.c_int)
_void_pp = ctypes.POINTER(ctypes.c_void_p)
_ptr, _size, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int

# name -> (restype, argtypes, required). Every function returns ncclResult_t
# unless its restype says otherwise; the optional ones appeared in later NCCLs.
_SIGNATURES: dict[str, tuple[Any, list[Any], bool]] = {
    "ncclGetVersion": (_int, [_int_p], True),
    "ncclGetUniqueId": (_int, [ctypes.POINTER(NcclUniqueId)], True),
    "ncclCommInitRank": (_int, [_void_pp, _int, NcclUniqueId, _int], True),
    "ncclCommDestroy": (_int, [_ptr], True),
    "ncclCommAbort": (_int, [_ptr], True),
    "ncclCommGetAsyncError": (_int, [_ptr, _int_p], True),
    "ncclCommCount": (_int, [_ptr, _int_p], True),
    "ncclCommUserRank": (_int, [_ptr, _int_p], True),
    "ncclGetErrorString": (ctypes.c_char_p, [_int], True),
    "ncclGetLastError": (ctypes.c_char_p, [_ptr], False),
    "ncclAllReduce": (_int, [_ptr, _ptr, _size, _int, _int, _ptr, _ptr], True),
    "ncclBroadcast": (_int, [_ptr, _ptr, _size, _int, _int, _ptr, _ptr], True),
    "ncclReduce": (_int, [_ptr, _ptr, _size, _int, _int, _int, _ptr, _ptr], True),
    "ncclAllGather": (_int, [_ptr, _ptr, _size, _int, _ptr, _ptr], True),
    "ncclReduceScatter": (_int, [_ptr, _ptr, _size, _int, _int, _ptr, _ptr], True),
    "ncclSend": (_int, [_ptr, _size, _int, _int, _ptr, _ptr], False),
    "ncclRecv": (_int, [_ptr, _size, _int, _int, _ptr, _ptr], False),
    "ncclGroupStart": (_int, [], True),
    "ncclGroupEnd": (_int, [], True),
    "ncclRedOpCreatePreMulSum": (_int, [_int_p, _ptr, _int, _int, _ptr], False),
    "ncclRedOpDestroy": (_int, [_int, _ptr], False),
}


class NcclLibrary:
    """One loaded libnccl with typed entry points.

    Every method raises :class:`NcclError` when NCCL returns anything but
    ncclSuccess (ncclInProgress included: communicators here are blocking)."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            path, how = find_library()
        else:
            how = "given"
        self.path: str = path
        self.how: str = how
        # RTLD_GLOBAL: later loads of libnccl (by torch, by a plugin) bind to this one
        self._lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        self._fns: dict[str, Callable[..., Any] | None] = {}
        for name, (restype, argtypes, required) in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                if required:
                    raise OSError(f"groupcomm: {path} has no {name}; is it NCCL 2.x?") from None
                self._fns[name] = None
                continue
            fn.restype = restype
            fn.argtypes = argtypes
            self._fns[name] = fn

    def __repr__(self) -> str:
        return f"NcclLibrary(path={self.path!r}, how={self.how!r})"

    def _fn(self, name: str) -> Callable[..., Any]:
        fn = self._fns[name]
        if fn is None:
            raise NotImplementedError(f"groupcomm: the NCCL at {self.path} has no {name} (too old)")
        return fn

    def _check(self, function: str, result: int) -> None:
        """Raise NcclError unless ``result`` is ncclSuccess."""
        if result != _SUCCESS:
            raise NcclError(function, result, self.error_string(result), self.last_error())

    def address(self, name: str) -> int:
        """Where NCCL's C function ``name`` lies in this process (for the C++
        path, which calls it without ctypes); 0 for an optional one this NCCL
        lacks (see ``_SIGNATURES``)."""
        fn = self._fns[name]
        return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    def _call(self, name: str, *args: Any) -> None:
        self._check(name, self._fn(name)(*args))

    # -- library-level ---------------------------------------------------------

    def version(self) -> int:
        """NCCL_VERSION_CODE of the loaded library (e.g. 23203 for 2.32.3)."""
        code = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(code))
        return code.value

    def version_tuple(self) -> tuple[int, int, int]:
        """(major, minor, patch); the code is X*10000+Y*100+Z from 2.9 on, X*1000+Y*100+Z before."""
        code = self.version()
        if code >= 20900:
            return code // 10000, (code % 10000) // 100, code % 100
        return code // 1000, (code % 1000) // 100, code % 100

    def error_string(self, code: int) -> str:
        """NCCL's text for an ncclResult_t."""
        text = self._fn("ncclGetErrorString")(int(code))
        return text.decode("utf-8", "replace") if text else ""

    def last_error(self, comm: Comm = None) -> str:
        """NCCL's detail on the most recent failure ("" when none or unsupported)."""
        fn = self._fns["ncclGetLastError"]
        if fn is None:
            return ""
        text = fn(comm)
        return text.decode("utf-8", "replace") if text else ""

    def get_unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes) for rank 0 to hand to all ranks."""
        uid = NcclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid.internal)

    # -- communicators ---------------------------------------------------------

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        """Join communicator ``unique_id`` as ``rank`` of ``nranks`` (blocks until all join)
        on the current CUDA device."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"groupcomm: an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), bytes(unique_id), UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._call("ncclCommInitRank", ctypes.byref(comm), int(nranks), uid, int(rank))
        return comm

    def comm_destroy(self, comm: Comm) -> None:
        """Free a communicator after its work completed."""
        self._call("ncclCommDestroy", comm)

    def comm_abort(self, comm: Comm) -> None:
        """Free a communicator now, abandoning work in flight (error recovery)."""
        self._call("ncclCommAbort", comm)

    def comm_get_async_error(self, comm: Comm) -> int:
        """The ncclResult_t of asynchronous failures on ``comm`` (0 when healthy)."""
        result = ctypes.c_int()
        self._call("ncclCommGetAsyncError", comm, ctypes.byref(result))
        return result.value

    def comm_count(self, comm: Comm) -> int:
        """Number of ranks in ``comm``."""
        count = ctypes.c_int()
        self._call("ncclCommCount", comm, ctypes.byref(count))
        return count.value

    def comm_user_rank(self, comm: Comm) -> int:
        """This process's rank in ``comm``."""
        rank = ctypes.c_int()
        self._call("ncclCommUserRank", comm, ctypes.byref(rank))
        return rank.value

    # -- collectives (enqueued on ``stream``; they return before the data moved) --

    def all_reduce(
        self, send_ptr: int, recv_ptr: int, count: int, datatype: int, op: int, comm: Comm, stream: int
    ) -> None:
        """ncclAllReduce: recv = op over ranks of send (``count`` elements)."""
        self._call("ncclAllReduce", send_ptr, recv_ptr, count, datatype, op, comm, stream)

    def broadcast(
        self, send_ptr: int, recv_ptr: int, count: int, datatype: int, root: int, comm: Comm, stream: int
    ) -> None:
        """ncclBroadcast: every rank's recv = root's send."""
        self._call("ncclBroadcast", send_ptr, recv_ptr, count, datatype, root, comm, stream)

    def reduce(
        self, send_ptr: int, recv_ptr: int, count: int, datatype: int, op: int, root: int, comm: Comm, stream: int
    ) -> None:
        """ncclReduce: root's recv = op over ranks of send."""
        self._call("ncclReduce", send_ptr, recv_ptr, count, datatype, op, root, comm, stream)

    def all_gather(self, send_ptr: int, recv_ptr: int, send_count: int, datatype: int, comm: Comm, stream: int) -> None:
        """ncclAllGather: recv holds every rank's ``send_count`` elements, in rank order."""
        self._call("ncclAllGather", send_ptr, recv_ptr, send_count, datatype, comm, stream)

    def reduce_scatter(
        self, send_ptr: int, recv_ptr: int, recv_count: int, datatype: int, op: int, comm: Comm, stream: int
    ) -> None:
        """ncclReduceScatter: rank i's recv = block i of op over ranks of send."""
        self._call("ncclReduceScatter", send_ptr, recv_ptr, recv_count, datatype, op, comm, stream)

    def send(self, ptr: int, count: int, datatype: int, peer: int, comm: Comm, stream: int) -> None:
        """ncclSend to ``peer`` (pair it with the peer's recv, in a group for several)."""
        self._call("ncclSend", ptr, count, datatype, peer, comm, stream)

    def recv(self, ptr: int, count: int, datatype: int, peer: int, comm: Comm, stream: int) -> None:
        """ncclRecv from ``peer``."""
        self._call("ncclRecv", ptr, count, datatype, peer, comm, stream)

    def group_start(self) -> None:
        """Begin fusing the following calls into one launch (ncclGroupStart)."""
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        """Launch the calls since group_start (ncclGroupEnd)."""
        self._call("ncclGroupEnd")

    # -- custom reductions -------------------------------------------------------

    def red_op_create_pre_mul_sum(self, scalar_ptr: int, datatype: int, residence: int, comm: Comm) -> int:
        """A reduction op on ``comm`` that sums inputs each multiplied by the scalar at
        ``scalar_ptr`` (of ``datatype``; ``residence`` a ScalarResidence). Free it with
        red_op_destroy."""
        op = ctypes.c_int()
        self._call("ncclRedOpCreatePreMulSum", ctypes.byref(op), scalar_ptr, datatype, residence, comm)
        return op.value

    def red_op_destroy(self, op: int, comm: Comm) -> None:
        """Free an op made by red_op_create_pre_mul_sum (after the collectives using it were enqueued)."""
        self._call("ncclRedOpDestroy", int(op), comm)


# ----------------------------------------------------------------------------
# torch dtypes


def _dtype_table() -> dict[torch.dtype, DataType]:
    names = {
        "int8": DataType.INT8,
        "uint8": DataType.UINT8,
        "bool": DataType.UINT8,  # one byte of 0/1
        "int32": DataType.INT32,
        "uint32": DataType.UINT32,
        "int64": DataType.INT64,
        "uint64": DataType.UINT64,
        "float16": DataType.FLOAT16,
        "float32": DataType.FLOAT32,
        "float64": DataType.FLOAT64,
        "bfloat16": DataType.BFLOAT16,
        "float8_e4m3fn": DataType.FLOAT8_E4M3,
        "float8_e5m2": DataType.FLOAT8_E5M2,
    }
    # an older torch may lack some of these dtypes
    return {getattr(torch, n): v for n, v in names.items() if hasattr(torch, n)}


_DTYPES = _dtype_table()


def nccl_dtype(dtype: torch.dtype) -> int:
    """The ncclDataType_t that carries ``dtype`` natively (bool as UINT8).

    Raises TypeError for others; complex tensors go through view_as_real first."""
    try:
        return int(_DTYPES[dtype])
    except KeyError:
        raise TypeError(f"groupcomm: NCCL has no datatype for {dtype}") from None


# ----------------------------------------------------------------------------
# The process-wide instance

_library: NcclLibrary | None = None
_library_lock = threading.Lock()


def library() -> NcclLibrary:
    """The process's NcclLibrary, loaded on first call (once, under a lock).

    A failure (no NCCL found) is not cached: a later call tries again."""
    global _library
    lib = _library
    if lib is None:
        with _library_lock:
            if _library is None:
                _library = NcclLibrary()
            lib = _library
    return lib
