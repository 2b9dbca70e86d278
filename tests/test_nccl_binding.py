"""The ctypes NCCL binding against the real libnccl of an nvidia-nccl-cu12 or
-cu13 wheel, on a machine without a GPU: finding the library each way, version,
unique ids, error reporting, dtypes, and a lazy import.

Checks that need a process with no NCCL loaded or another environment, and
calls that leave NCCL threads behind (unique ids) or may hang (communicator
init), run in a fresh interpreter with a timeout; the rest load NCCL here."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from torch_groupcomm.communicators import nccl

ENV = nccl.ENV_VAR
SUBPROCESS_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def wheel_path() -> str:
    path = nccl._from_wheel()
    if path is None:
        pytest.skip("no nvidia-nccl wheel is installed (pip install nvidia-nccl-cu13, or -cu12)")
    return path


@pytest.fixture(scope="module")
def lib(wheel_path: str) -> nccl.NcclLibrary:
    return nccl.NcclLibrary(wheel_path)


def _nccl_wheel_version() -> str:
    """The version of whichever NCCL wheel is installed (torch 2.14+ CUDA builds bring -cu13)."""
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise AssertionError("an NCCL library was found under nvidia/nccl but no nvidia-nccl wheel is installed")


def _run(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter without GROUPCOMM_NCCL_LIBRARY (unless
    given); it prints one JSON object as its last line, returned here."""
    full_env = {k: v for k, v in os.environ.items() if k != ENV}
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert out.returncode == 0, f"rc={out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------
# finding the library


def test_env_names_the_library(monkeypatch: pytest.MonkeyPatch, wheel_path: str) -> None:
    monkeypatch.setenv(ENV, wheel_path)
    assert nccl.find_library() == (wheel_path, "env")
    loaded = nccl.NcclLibrary()
    assert (loaded.path, loaded.how) == (wheel_path, "env")


def test_env_missing_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = str(tmp_path / "no" / "libnccl.so.2")
    monkeypatch.setenv(ENV, missing)
    with pytest.raises(FileNotFoundError) as info:
        nccl.find_library()
    assert ENV in str(info.value) and missing in str(info.value)


def test_env_empty_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "")
    assert nccl._from_env() is None
    monkeypatch.delenv(ENV)
    assert nccl._from_env() is None


def test_wheel_finds_the_library(wheel_path: str) -> None:
    assert os.path.isfile(wheel_path)
    assert wheel_path.endswith(os.path.join("nvidia", "nccl", "lib", "libnccl.so.2"))


def test_fresh_process_uses_wheel_then_loaded_library(wheel_path: str) -> None:
    code = (
        "import ctypes, json\n"
        "from torch_groupcomm.communicators import nccl\n"
        "before = nccl._from_process()\n"
        "first = nccl.find_library()\n"
        f"ctypes.CDLL({wheel_path!r})\n"
        "print(json.dumps({'before': before, 'first': first, 'after': nccl.find_library()}))\n"
    )
    got = _run(code)
    if got["before"] is None:
        assert got["first"] == [wheel_path, "wheel"]
        expected = os.path.realpath(wheel_path)
    else:  # this torch build loaded an NCCL itself: that one is the one to use
        assert got["first"] == [got["before"], "process"]
        expected = os.path.realpath(got["before"])
    path, how = got["after"]
    assert how == "process"
    assert os.path.realpath(path) == expected


def test_system_loader_path(wheel_path: str) -> None:
    lib_dir = os.path.dirname(wheel_path)
    ld_path = os.pathsep.join(p for p in (lib_dir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    code = (
        "import ctypes, json\n"
        "from torch_groupcomm.communicators import nccl\n"
        "found = nccl._from_system()\n"
        "ctypes.CDLL(found)\n"
        "lib = nccl.NcclLibrary(found)\n"
        "print(json.dumps({'found': found, 'how': lib.how, 'version': lib.version()}))\n"
    )
    got = _run(code, LD_LIBRARY_PATH=ld_path)
    assert got["found"] and "nccl" in got["found"]
    assert got["how"] == "given"
    assert got["version"] >= 22000


def test_order_of_the_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    ways = {"_from_env": "e", "_from_process": "p", "_from_wheel": "w", "_from_system": "s"}
    for name, value in ways.items():
        monkeypatch.setattr(nccl, name, lambda value=value: value)
    expected = [("e", "env"), ("p", "process"), ("w", "wheel"), ("s", "system")]
    for name, want in zip(ways, expected):
        assert nccl.find_library() == want
        monkeypatch.setattr(nccl, name, lambda: None)
    with pytest.raises(FileNotFoundError) as info:
        nccl.find_library()
    message = str(info.value)
    for part in (ENV, "already loaded", "nvidia-nccl-cu12 or -cu13", "LD_LIBRARY_PATH", "pip install nvidia-nccl-cu13"):
        assert part in message


def test_maps_scan_takes_only_libnccl() -> None:
    lines = [
        "7f00-7f01 r--p 00000000 08:01 1 /opt/x/libnccl_device.so\n",
        "7f01-7f02 r--p 00000000 08:01 2 /opt/x/libnccl-net.so\n",
        "7f02-7f03 r--p 00000000 08:01 3 /opt/old/libnccl.so.2 (deleted)\n",
        "7f03-7f04 rw-p 00000000 00:00 0 \n",
        "7f04-7f05 r-xp 00000000 08:01 4                  /opt/my dir/libnccl.so.2.32.3\n",
        "7f05-7f06 r-xp 00000000 08:01 5 /opt/other/libnccl.so.2\n",
    ]
    assert nccl._scan_maps(lines) == "/opt/my dir/libnccl.so.2.32.3"
    assert nccl._scan_maps(lines[:4]) is None


# ----------------------------------------------------------------------------
# calls into the real library


def test_version_matches_the_wheel(lib: nccl.NcclLibrary) -> None:
    code = lib.version()
    major, minor, patch = lib.version_tuple()
    assert major == 2 and code >= 22000
    assert code == major * 10000 + minor * 100 + patch
    wheel_version = _nccl_wheel_version()
    assert (major, minor, patch) == tuple(int(x) for x in re.findall(r"\d+", wheel_version)[:3])


def test_error_strings(lib: nccl.NcclLibrary) -> None:
    assert lib.error_string(0) == "no error"
    assert lib.error_string(4).startswith("invalid argument")


def test_failing_call_raises_nccl_error(lib: nccl.NcclLibrary) -> None:
    # NCCL checks a NULL communicator before touching CUDA, so this fails the same with or without a GPU
    with pytest.raises(nccl.NcclError) as info:
        lib.comm_count(None)
    err = info.value
    assert (err.code, err.function) == (4, "ncclCommCount")
    assert str(err).startswith(f"groupcomm: NCCL ncclCommCount failed: {lib.error_string(4)} (ncclResult 4)")
    assert "NULL" in str(err)  # NCCL's last-error detail
    assert isinstance(err, RuntimeError)
    with pytest.raises(nccl.NcclError, match="ncclAllReduce"):
        lib.all_reduce(0, 0, 1, nccl.DataType.FLOAT32, nccl.RedOp.SUM, None, 0)


def test_bad_unique_id_length(lib: nccl.NcclLibrary) -> None:
    with pytest.raises(ValueError, match="128"):
        lib.comm_init_rank(1, b"short", 0)


@pytest.fixture(scope="module")
def fresh_calls(wheel_path: str) -> dict:
    """Unique ids and a failing ncclCommInitRank, in a fresh interpreter: each
    ncclGetUniqueId leaves a bootstrap thread and socket behind, kept out of
    the test process; and a hang or crash in init fails within the timeout."""
    code = (
        "import json\n"
        "from torch_groupcomm.communicators import nccl\n"
        f"lib = nccl.NcclLibrary({wheel_path!r})\n"
        "ids = [lib.get_unique_id(), lib.get_unique_id()]\n"
        "out = {'types': [type(i).__name__ for i in ids], 'lengths': [len(i) for i in ids],\n"
        "       'distinct': ids[0] != ids[1]}\n"
        "try:\n"
        "    # rank 5 of 1 fails on any machine (here, without a GPU: CUDA; with one: the rank)\n"
        "    lib.comm_init_rank(1, ids[0], 5)\n"
        "    out['raised'] = False\n"
        "except nccl.NcclError as e:\n"
        "    out.update(raised=True, code=e.code, function=e.function, message=str(e),\n"
        "               error_string=lib.error_string(e.code))\n"
        "print(json.dumps(out))\n"
    )
    return _run(code)


def test_unique_ids(fresh_calls: dict) -> None:
    assert fresh_calls["types"] == ["bytes", "bytes"]
    assert fresh_calls["lengths"] == [128, 128]
    assert fresh_calls["distinct"]


def test_comm_init_rank_failure_is_an_nccl_error(fresh_calls: dict) -> None:
    got = fresh_calls
    assert got["raised"], got
    assert got["function"] == "ncclCommInitRank" and got["code"] != 0
    assert "ncclCommInitRank" in got["message"]
    assert got["error_string"] and got["error_string"] in got["message"]


# ----------------------------------------------------------------------------
# constants and dtypes


def test_enums_match_nccl_h(wheel_path: str) -> None:
    header = os.path.join(os.path.dirname(os.path.dirname(wheel_path)), "include", "nccl.h")
    if not os.path.isfile(header):
        pytest.skip(f"no {header} in this wheel")
    text = open(header, encoding="utf-8").read()
    values = {name: int(value) for name, value in re.findall(r"\b(nccl\w+)\s*=\s*(\d+)\b", text)}
    # (member, C name) pairs; not a dict, since IntEnum members of equal value are equal keys
    R, D, S = nccl.RedOp, nccl.DataType, nccl.ScalarResidence
    pairs = [
        (R.SUM, "ncclSum"),
        (R.PROD, "ncclProd"),
        (R.MAX, "ncclMax"),
        (R.MIN, "ncclMin"),
        (R.AVG, "ncclAvg"),
        (D.INT8, "ncclInt8"),
        (D.UINT8, "ncclUint8"),
        (D.INT32, "ncclInt32"),
        (D.UINT32, "ncclUint32"),
        (D.INT64, "ncclInt64"),
        (D.UINT64, "ncclUint64"),
        (D.FLOAT16, "ncclFloat16"),
        (D.FLOAT32, "ncclFloat32"),
        (D.FLOAT64, "ncclFloat64"),
        (D.BFLOAT16, "ncclBfloat16"),
        (D.FLOAT8_E4M3, "ncclFloat8e4m3"),
        (D.FLOAT8_E5M2, "ncclFloat8e5m2"),
        (S.DEVICE, "ncclScalarDevice"),
        (S.HOST_IMMEDIATE, "ncclScalarHostImmediate"),
    ]
    for enum_type in (R, D, S):  # every member, in order
        assert [m for m, _ in pairs if type(m) is enum_type] == list(enum_type)
    for member, c_name in pairs:
        assert values[c_name] == int(member), (member, c_name)
    assert re.search(r"NCCL_UNIQUE_ID_BYTES\s+128\b", text)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.int8, nccl.DataType.INT8),
        (torch.uint8, nccl.DataType.UINT8),
        (torch.bool, nccl.DataType.UINT8),
        (torch.int32, nccl.DataType.INT32),
        (torch.uint32, nccl.DataType.UINT32),
        (torch.int64, nccl.DataType.INT64),
        (torch.uint64, nccl.DataType.UINT64),
        (torch.float16, nccl.DataType.FLOAT16),
        (torch.float32, nccl.DataType.FLOAT32),
        (torch.float64, nccl.DataType.FLOAT64),
        (torch.bfloat16, nccl.DataType.BFLOAT16),
        (torch.float8_e4m3fn, nccl.DataType.FLOAT8_E4M3),
        (torch.float8_e5m2, nccl.DataType.FLOAT8_E5M2),
    ],
)
def test_nccl_dtype(dtype: torch.dtype, expected: nccl.DataType) -> None:
    assert nccl.nccl_dtype(dtype) == int(expected)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int16])
def test_nccl_dtype_rejects(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=re.escape(f"NCCL has no datatype for {dtype}")):
        nccl.nccl_dtype(dtype)


# ----------------------------------------------------------------------------
# loading


def test_import_is_lazy_and_library_reports_missing(tmp_path) -> None:
    missing = str(tmp_path / "libnccl.so.2")
    code = (
        "import json, torch\n"
        "def loaded():\n"
        "    return any('libnccl' in line for line in open('/proc/self/maps'))\n"
        "before = loaded()\n"
        "from torch_groupcomm.communicators import nccl\n"
        "after_import = loaded()\n"
        "try:\n"
        "    nccl.library()\n"
        "    error = None\n"
        "except FileNotFoundError as e:\n"
        "    error = str(e)\n"
        "print(json.dumps({'before': before, 'after_import': after_import, 'error': error}))\n"
    )
    got = _run(code, **{ENV: missing})
    assert got["after_import"] == got["before"]
    assert got["error"] and ENV in got["error"] and missing in got["error"]


def test_library_is_one_instance(monkeypatch: pytest.MonkeyPatch, wheel_path: str) -> None:
    monkeypatch.setattr(nccl, "_library", None)
    monkeypatch.setenv(ENV, wheel_path)
    got = []
    threads = [threading.Thread(target=lambda: got.append(nccl.library())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(x is got[0] for x in got)
    assert nccl.library() is got[0]
    assert got[0].version() >= 22000
    assert isinstance(got[0]._lib, ctypes.CDLL)


def test_cuda_communicator_imports_without_a_gpu() -> None:
    code = (
        "import json, torch\n"
        "from torch_groupcomm.communicators.cuda import CudaCommunicator\n"
        "from torch_groupcomm.communicators.base import DeviceCommunicatorBase\n"
        "print(json.dumps({'name': CudaCommunicator.name, 'gpu': torch.cuda.is_available(),\n"
        "                  'base': issubclass(CudaCommunicator, DeviceCommunicatorBase)}))\n"
    )
    got = _run(code)
    assert got["name"] == "nccl" and got["base"], got
