"""groupcomm on CUDA tensors: every collective, reduce op and dtype against
plain torch math, async work and stream ordering, CUDA graph capture (c10d and
coordinator API), DDP and FSDP2 training, and groupcomm serving both devices.

Ranks run one per GPU (NCCL cannot put two ranks on one GPU): a single-GPU
world, and a world of min(GPUs, 4) ranks when two or more GPUs are visible.
Most groups are "cpu:gloo,cuda:groupcomm", the headline use. Every check runs
the same op sequence on every rank; a wrong value is recorded, not raised, so
the ranks stay in step and one run reports every mismatch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import GROUP_TIMEOUT, frontend_calls, run_ranks
from _reference import COMPLEX, DTYPES, FLOATS, expected, make_input, meaningful

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more CUDA GPUs ({GPUS} visible)")
# one rank per GPU; "multi" is min(GPUs, 4) ranks
WORLDS = [pytest.param(1, id="1gpu"), pytest.param(max(2, min(GPUS, 4)), id="multi", marks=needs_two_gpus)]

MIXED = "cpu:gloo,cuda:groupcomm"
TIMEOUT_S = float(os.environ.get("GROUPCOMM_TEST_TIMEOUT", "300"))  # a hang fails within this
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of milliseconds of GPU time
HALF = (torch.float16, torch.bfloat16)

R = dist.ReduceOp
OP_NAMES = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
# torch's all_reduce refuses these on complex tensors itself (ValueError) before
# a backend sees them; it hands the other complex all_reduces over as real pairs
TORCH_COMPLEX_DENY = {"MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"}
PREMUL_FLOAT = 2.5  # exact in every floating dtype, as are its products with small integers
PREMUL_TENSOR = 0.5


# -- launcher ------------------------------------------------------------------------


def _cuda_rank(rank: int, world: int, backend: str, checks: list) -> list:
    """Inside a spawned rank: pick this rank's GPU before the group exists,
    form the group, run ``checks`` in order and return their failures."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=GROUP_TIMEOUT,
    )
    failures: list = []
    for check in checks:
        check(rank, world, failures)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return failures


def _launch(world: int, checks: list, backend: str = MIXED, timeout: float = TIMEOUT_S) -> None:
    """Run ``checks`` on ``world`` ranks (one GPU each); fail with every
    rank's recorded mismatches, or with the traceback of a rank that raised."""
    assert world <= GPUS, f"{world} ranks need {world} GPUs, {GPUS} visible"
    # backend None: the harness spawns and reports; _cuda_rank forms the group
    # itself, after torch.cuda.set_device.
    results = run_ranks(_cuda_rank, world, None, args=(backend, checks), timeout=timeout)
    failures = [f"rank {rank}: {f}" for rank, fs in enumerate(results) for f in fs]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:200])


# -- helpers -------------------------------------------------------------------------


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _assert_close(actual: torch.Tensor, want: torch.Tensor, what: str, half_atol: float = 1e-2) -> None:
    """Exact for integers and bool, a dtype-appropriate tolerance for floats.
    ``actual`` is read on the current stream, after whatever it waited for."""
    actual = actual.detach().cpu()
    want = want.detach().cpu()
    assert actual.dtype == want.dtype, f"{what}: dtype {actual.dtype} != {want.dtype}"
    assert actual.shape == want.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(want.shape)}"
    if actual.dtype in HALF:
        torch.testing.assert_close(actual, want, rtol=1e-2, atol=half_atol, msg=lambda m: f"{what}: {m}")
    elif actual.is_floating_point() or actual.is_complex():
        torch.testing.assert_close(actual, want, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, want), f"{what}: {actual.flatten()[:16].tolist()} != {want.flatten()[:16].tolist()}"


def _expect(failures: list, actual: torch.Tensor, want: torch.Tensor, what: str, half_atol: float = 1e-2) -> None:
    try:
        _assert_close(actual, want, what, half_atol)
    except AssertionError as exc:
        failures.append(str(exc))


def _expect_true(failures: list, ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


def _expect_raises(failures: list, fn, exc_types: tuple, what: str, *fragments: str) -> None:
    """``fn`` (called the same way on every rank) must raise one of
    ``exc_types`` whose message holds every fragment."""
    names = "/".join(t.__name__ for t in exc_types)
    try:
        fn()
    except exc_types as exc:
        missing = [f for f in fragments if f not in str(exc)]
        if missing:
            failures.append(f"{what}: {type(exc).__name__} {str(exc)!r} does not mention {missing}")
        return
    except Exception as exc:  # noqa: BLE001 - recorded: the caller checks the group is still in step
        failures.append(f"{what}: expected {names}, got {type(exc).__name__}: {exc}")
        return
    failures.append(f"{what}: expected {names}, nothing raised")


def _in_step(rank: int, world: int, failures: list, what: str) -> None:
    """A CUDA all_reduce still works and gives the right sum."""
    t = torch.full((7,), float(rank), device=_dev())
    dist.all_reduce(t)
    _expect(failures, t, torch.full((7,), float(sum(range(world)))), f"group in step after {what}")


# -- 1. reductions: every reducing collective x reduce op x dtype ---------------------------

_INT_RANGES = {  # sums of up to 4 ranks stay inside the dtype
    torch.int8: (-30, 30),
    torch.uint8: (0, 60),
    torch.int16: (-3000, 3000),
    torch.int32: (-(2**20), 2**20),
    torch.int64: (-(2**40), 2**40),
}


def _reduction_input(rank: int, dtype: torch.dtype, n: int, op: str, seed: int) -> torch.Tensor:
    """Deterministic per-rank data (on the CPU) that ``op`` cannot overflow:
    PRODUCT sees magnitudes 1 and 2 only; floats are small integers, so sums
    and products are exact even in float16/bfloat16."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 31 * n + OP_NAMES.index(op))
    if dtype == torch.bool:
        p_true = 0.8 if op in ("PRODUCT", "MIN", "BAND") else 0.3
        return torch.rand(n, generator=g) < p_true
    if dtype in COMPLEX:
        if op == "PRODUCT":
            re = torch.randint(-1, 3, (n,), generator=g).double()
            im = torch.randint(-1, 2, (n,), generator=g).double()
        else:
            re = torch.randint(-3, 4, (n,), generator=g).double()
            im = torch.randint(-3, 4, (n,), generator=g).double()
        return torch.complex(re, im).to(dtype)
    if op == "PRODUCT":
        magnitude = torch.randint(1, 3, (n,), generator=g)
        if dtype == torch.uint8:
            return magnitude.to(dtype)
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return (magnitude * sign).to(dtype)
    if dtype in FLOATS:
        return torch.randint(-4, 5, (n,), generator=g).to(dtype)
    low, high = _INT_RANGES[dtype]
    return torch.randint(low, high + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def _want(op: str, xs: list, factor: float) -> torch.Tensor:
    """``op`` over the ranks' inputs in plain torch math (bool: SUM/MAX are
    logical or, PRODUCT/MIN logical and; integer AVG truncates toward zero)."""
    if op != "PREMUL_SUM":
        return expected(op, xs)
    wide = torch.complex128 if xs[0].dtype in COMPLEX else torch.float64
    return sum(factor * x.to(wide) for x in xs).to(xs[0].dtype)


def _variants() -> list:
    """(label, op name, premul factor, whether the factor is a CUDA tensor)."""
    out = [(name, name, None, False) for name in OP_NAMES if name != "PREMUL_SUM"]
    out.append((f"PREMUL_SUM({PREMUL_FLOAT})", "PREMUL_SUM", PREMUL_FLOAT, False))
    out.append((f"PREMUL_SUM(cuda tensor {PREMUL_TENSOR})", "PREMUL_SUM", PREMUL_TENSOR, True))
    return out


def _torch_op(op: str, factor, tensor_factor: bool, dtype: torch.dtype):
    if op != "PREMUL_SUM":
        return getattr(R, op)
    if not tensor_factor:
        return dist._make_nccl_premul_sum(factor)
    # a scalar on the GPU, of the input's real dtype (what NCCL reads it as)
    fdtype = dtype.to_real() if (dtype.is_floating_point or dtype.is_complex) else torch.float32
    return dist._make_nccl_premul_sum(torch.tensor(factor, dtype=fdtype, device=_dev()))


def _reduction_cases(rank: int, world: int, dev: torch.device, op: str, factor, tensor_factor: bool, dtype):
    """name -> case; a case runs the collective and returns (actual, want)."""
    chunk = 5

    def inputs(n: int, seed: int) -> list:
        return [_reduction_input(r, dtype, n, op, seed) for r in range(world)]

    def reduce_op():
        return _torch_op(op, factor, tensor_factor, dtype)

    def all_reduce(n: int):
        xs = inputs(n, seed=n)
        t = xs[rank].to(dev, copy=True)
        dist.all_reduce(t, op=reduce_op())
        return t, _want(op, xs, factor)

    def reduce(root: int):
        xs = inputs(37, seed=100 + root)
        t = xs[rank].to(dev, copy=True)
        dist.reduce(t, dst=root, op=reduce_op())
        # the root holds the result; the other ranks' tensors are left alone
        return t, _want(op, xs, factor) if rank == root else xs[rank]

    def reduce_scatter_list():
        xs = inputs(chunk * world, seed=200)
        out = torch.empty(chunk, dtype=dtype, device=dev)
        dist.reduce_scatter(out, list(xs[rank].to(dev, copy=True).split(chunk)), op=reduce_op())
        return out, _want(op, xs, factor)[rank * chunk : (rank + 1) * chunk]

    def reduce_scatter_tensor():
        xs = inputs(chunk * world, seed=300)
        out = torch.empty(chunk, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, xs[rank].to(dev, copy=True), op=reduce_op())
        return out, _want(op, xs, factor)[rank * chunk : (rank + 1) * chunk]

    cases = {f"all_reduce n={n}": (lambda n=n: all_reduce(n)) for n in (1, 37, 4099)}
    cases.update({f"reduce root={root}": (lambda root=root: reduce(root)) for root in range(world)})
    cases["reduce_scatter list"] = reduce_scatter_list
    cases["reduce_scatter_tensor"] = reduce_scatter_tensor
    return cases


def check_reduction_matrix(rank: int, world: int, failures: list) -> None:
    dev = _dev()
    for dtype in DTYPES:
        for label, op, factor, tensor_factor in _variants():
            cases = _reduction_cases(rank, world, dev, op, factor, tensor_factor, dtype)
            for name, case in cases.items():
                what = f"{name} {label} {dtype}"
                if dtype in COMPLEX and op in TORCH_COMPLEX_DENY and name.startswith("all_reduce"):
                    # torch's own check, before the backend: ValueError naming the op
                    _expect_raises(failures, case, (TypeError, ValueError), what, op)
                elif not meaningful(op, dtype):
                    _expect_raises(failures, case, (TypeError,), what, op, str(dtype))
                else:
                    actual, want = case()
                    # float16/bfloat16 AVG over a world that is not a power of two
                    # rounds 1/world and each partial sum in the dtype
                    half_atol = 6e-2 if op == "AVG" else 1e-2
                    _expect(failures, actual, want, what, half_atol)
    _in_step(rank, world, failures, "the reduction matrix")


# -- 8. errors -------------------------------------------------------------------------


def check_errors(rank: int, world: int, failures: list) -> None:
    dev = _dev()
    _expect_raises(
        failures,
        lambda: dist.all_reduce(torch.ones(3, device=dev), op=R.BXOR),
        (TypeError,),
        "BXOR on float32 CUDA",
        "BXOR",
        "torch.float32",
    )
    _expect_raises(
        failures,
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool, device=dev), op=R.AVG),
        (TypeError,),
        "AVG on bool CUDA",
        "AVG",
        "torch.bool",
    )
    _expect_raises(
        failures,
        lambda: dist.all_gather_into_tensor(torch.empty(world * 2 + 1, device=dev), torch.ones(2, device=dev)),
        (ValueError,),
        "all_gather_into_tensor output of the wrong size",
        str(world * 2 + 1),
    )
    _expect_raises(
        failures,
        lambda: dist.reduce_scatter_tensor(torch.empty(2, device=dev), torch.ones(world * 2 + 1, device=dev)),
        (ValueError,),
        "reduce_scatter_tensor input of the wrong size",
        str(world * 2 + 1),
    )
    _in_step(rank, world, failures, "refused calls")


# -- 1. data movement ----------------------------------------------------------------------


def check_data_movement(rank: int, world: int, failures: list) -> None:
    dev = _dev()
    for dtype in DTYPES:
        tag = str(dtype)
        for n in (1, 1000):
            xs = [make_input(r, dtype, n) for r in range(world)]
            for root in range(world):
                t = xs[rank].to(dev, copy=True)
                dist.broadcast(t, src=root)
                _expect(failures, t, xs[root], f"broadcast root={root} n={n} {tag}")
            outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(outs, xs[rank].to(dev, copy=True))
            for r in range(world):
                _expect(failures, outs[r], xs[r], f"all_gather list [{r}] n={n} {tag}")
            out = torch.empty(world * n, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, xs[rank].to(dev, copy=True))
            _expect(failures, out, torch.cat(xs), f"all_gather_into_tensor n={n} {tag}")
            for root in range(world):
                gathered = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
                dist.gather(xs[rank].to(dev, copy=True), gathered, dst=root)
                if rank == root:
                    for r in range(world):
                        _expect(failures, gathered[r], xs[r], f"gather root={root} [{r}] n={n} {tag}")
            for root in range(world):
                pieces = [make_input(50 + root, dtype, n, seed=r) for r in range(world)]
                out = torch.empty(n, dtype=dtype, device=dev)
                dist.scatter(out, [p.to(dev, copy=True) for p in pieces] if rank == root else None, src=root)
                _expect(failures, out, pieces[rank], f"scatter root={root} n={n} {tag}")
        # all_gather with a different size on every rank
        sizes = [r + 2 for r in range(world)]
        xs = [make_input(r, dtype, sizes[r], seed=1) for r in range(world)]
        outs = [torch.empty(s, dtype=dtype, device=dev) for s in sizes]
        dist.all_gather(outs, xs[rank].to(dev, copy=True))
        for r in range(world):
            _expect(failures, outs[r], xs[r], f"all_gather uneven [{r}] {tag}")
        # all_to_all_single, even then uneven splits (rows of 3 columns)
        rows = 2 * world
        mats = [make_input(r, dtype, rows * 3, seed=3).view(rows, 3) for r in range(world)]
        out = torch.empty(rows, 3, dtype=dtype, device=dev)
        dist.all_to_all_single(out, mats[rank].to(dev, copy=True))
        want = torch.cat([mats[r][2 * rank : 2 * rank + 2] for r in range(world)])
        _expect(failures, out, want, f"all_to_all_single even {tag}")

        def split(src: int, dst: int) -> int:  # rows rank src sends to rank dst (0 included)
            return (src + 2 * dst) % 3

        in_splits = [split(rank, d) for d in range(world)]
        out_splits = [split(s, rank) for s in range(world)]
        mats = [
            make_input(r, dtype, sum(split(r, d) for d in range(world)) * 3, seed=4).view(-1, 3) for r in range(world)
        ]
        out = torch.empty(sum(out_splits), 3, dtype=dtype, device=dev)
        dist.all_to_all_single(out, mats[rank].to(dev, copy=True), out_splits, in_splits)
        want = torch.cat([mats[s].split([split(s, d) for d in range(world)])[rank] for s in range(world)])
        _expect(failures, out, want, f"all_to_all_single uneven {tag}")
        # all_to_all, list form, a different size for every pair
        ins = [make_input(rank, dtype, rank + d + 1, seed=d).to(dev, copy=True) for d in range(world)]
        outs = [torch.empty(s + rank + 1, dtype=dtype, device=dev) for s in range(world)]
        dist.all_to_all(outs, ins)
        for s in range(world):
            _expect(failures, outs[s], make_input(s, dtype, s + rank + 1, seed=rank), f"all_to_all list [{s}] {tag}")
    # reduce_scatter, list form, with a different size for every rank
    sizes = [r + 1 for r in range(world)]
    offsets = [sum(sizes[:r]) for r in range(world)]
    for dtype in (torch.float32, torch.int64):
        xs = [make_input(r, dtype, sum(sizes), seed=5) for r in range(world)]
        out = torch.empty(sizes[rank], dtype=dtype, device=dev)
        dist.reduce_scatter(out, list(xs[rank].to(dev, copy=True).split(sizes)))
        want = expected("SUM", xs)[offsets[rank] : offsets[rank] + sizes[rank]]
        _expect(failures, out, want, f"reduce_scatter uneven {dtype}")
    # a large message both ways
    big = make_input(rank, torch.float32, 1 << 22, seed=6)
    t = big.to(dev, copy=True)
    dist.all_reduce(t)
    _expect(
        failures,
        t,
        expected("SUM", [make_input(r, torch.float32, 1 << 22, seed=6) for r in range(world)]),
        "all_reduce 4M float32",
    )
    out = torch.empty(world << 22, device=dev)
    dist.all_gather_into_tensor(out, big.to(dev, copy=True))
    _expect(
        failures,
        out,
        torch.cat([make_input(r, torch.float32, 1 << 22, seed=6) for r in range(world)]),
        "all_gather_into_tensor 4M float32",
    )
    # the CPU side of the mixed group (gloo here) works beside the CUDA side
    c = torch.full((3,), float(rank))
    dist.all_reduce(c)
    _expect(failures, c, torch.full((3,), float(sum(range(world)))), "CPU all_reduce beside CUDA")


def check_layouts(rank: int, world: int, failures: list) -> None:
    """Non-contiguous and zero-element CUDA tensors."""
    dev = _dev()
    base = torch.arange(12.0).view(3, 4)
    t = (base + rank).to(dev, copy=True).t()
    assert not t.is_contiguous()
    dist.all_reduce(t)
    _expect(failures, t, (base * world + sum(range(world))).t(), "all_reduce non-contiguous")
    t = (base + rank).to(dev, copy=True).t()
    dist.broadcast(t, src=world - 1)
    _expect(failures, t, (base + world - 1).t(), "broadcast non-contiguous")
    t = (torch.arange(12, dtype=torch.int64).view(3, 4) * (rank + 1)).to(dev, copy=True).t()
    dist.all_reduce(t, op=R.MAX)
    _expect(
        failures, t, (torch.arange(12, dtype=torch.int64).view(3, 4) * world).t(), "all_reduce MAX non-contiguous int64"
    )
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        empty = torch.empty(0, dtype=dtype, device=dev)
        dist.all_reduce(empty)
        _expect(failures, empty, torch.empty(0, dtype=dtype), f"all_reduce zero elements {dtype}")
        outs = [torch.empty(0, dtype=dtype, device=dev) for _ in range(world)]
        dist.all_gather(outs, torch.empty(0, dtype=dtype, device=dev))
        for o in outs:
            _expect(failures, o, torch.empty(0, dtype=dtype), f"all_gather list zero elements {dtype}")
        out = torch.empty(0, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, torch.empty(0, dtype=dtype, device=dev))
        _expect(failures, out, torch.empty(0, dtype=dtype), f"all_gather_into_tensor zero elements {dtype}")
        empty = torch.empty(0, dtype=dtype, device=dev)
        dist.broadcast(empty, src=0)
        _expect(failures, empty, torch.empty(0, dtype=dtype), f"broadcast zero elements {dtype}")
    _in_step(rank, world, failures, "zero-element tensors")


def check_p2p_and_barrier(rank: int, world: int, failures: list) -> None:
    dev = _dev()
    dist.barrier()  # the default device's barrier
    dist.barrier(device_ids=[dev.index])  # the CUDA backend's barrier
    if world == 1:
        return
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # a ring: even ranks send first, odd ranks receive first
    for dtype in DTYPES:
        payload = make_input(rank, dtype, 257, seed=7).to(dev, copy=True)
        got = torch.empty(257, dtype=dtype, device=dev)
        if rank % 2 == 0:
            dist.send(payload, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(payload, nxt)
        _expect(failures, got, make_input(prv, dtype, 257, seed=7), f"send/recv ring {dtype}")
    # the same ring with isend/irecv, waited for afterwards, and a large message
    outgoing = make_input(rank, torch.float32, 1 << 20, seed=8).to(dev, copy=True)
    got = torch.empty(1 << 20, device=dev)
    if rank % 2 == 0:
        works = [dist.isend(outgoing, nxt), dist.irecv(got, prv)]
    else:
        works = [dist.irecv(got, prv), dist.isend(outgoing, nxt)]
    for w in works:
        w.wait()
    _expect(failures, got, make_input(prv, torch.float32, 1 << 20, seed=8), "isend/irecv ring 1M float32")
    dist.barrier(device_ids=[dev.index])
    _in_step(rank, world, failures, "send/recv")


# -- 2. async work -------------------------------------------------------------------


def check_async(rank: int, world: int, failures: list) -> None:
    dev = _dev()
    tensors = [torch.full((1000,), float(i + rank), device=dev) for i in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        want = torch.full((1000,), float(i * world + sum(range(world))))
        _expect(failures, t, want, f"async all_reduce {i}")
        value = w.get_future().wait()
        if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], torch.Tensor)):
            failures.append(f"async all_reduce {i}: future value is {value!r}, expected a list of one tensor")
            continue
        _expect_true(failures, value[0].device == dev, f"future value on {value[0].device}, expected {dev}")
        _expect(failures, value[0], want, f"async all_reduce {i} future value")
    # a callback on the future sees the reduced tensor (DDP's comm hooks do this)
    fut = dist.all_reduce(torch.ones(3, device=dev), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    _expect(failures, fut.wait(), torch.full((3,), 2.0 * world), "future then")
    # async ops of other kinds, in flight together
    out = torch.empty(world * 4, device=dev)
    src = torch.full((4,), float(rank), device=dev)
    b = torch.full((5,), float(rank), dtype=torch.int64, device=dev)
    w1 = dist.all_gather_into_tensor(out, src, async_op=True)
    w2 = dist.broadcast(b, src=world - 1, async_op=True)
    w3 = dist.barrier(async_op=True)
    for w in (w1, w2, w3):
        w.wait()
    _expect(failures, out, torch.arange(world).float().repeat_interleave(4), "async all_gather_into_tensor")
    _expect(failures, b, torch.full((5,), world - 1, dtype=torch.int64), "async broadcast")


# -- 3. stream ordering ----------------------------------------------------------------


def check_stream_order(rank: int, world: int, failures: list) -> None:
    """The op waits for earlier work on the issuing stream; ``work.wait()``
    orders the caller's current stream after the op; ``work.synchronize()``
    also blocks the host. No timing is asserted: a missing dependency shows
    up as a stale value read by a kernel queued behind a long sleep."""
    dev = _dev()
    n = 1 << 20
    want = torch.full((n,), float(world * (world + 1) // 2))  # sum of rank + 1
    # a) issued on the current stream behind a long kernel
    t = torch.zeros(n, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(rank + 1)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    snapshot = t.clone()  # queued on the current stream right after wait()
    torch.cuda.synchronize()
    _expect(failures, snapshot, want, "current stream: read queued after work.wait()")
    _expect(failures, t, want, "current stream: all_reduce after a long kernel")
    # b) issued on a side stream; waited for on the default stream
    side = torch.cuda.Stream()
    t = torch.zeros(n, device=dev)
    side.wait_stream(torch.cuda.current_stream())  # t's zeros are written first
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(rank + 1)
        work = dist.all_reduce(t, async_op=True)
    work.wait()  # the current (default) stream now waits for the op
    snapshot = t.clone()
    torch.cuda.synchronize()
    _expect(failures, snapshot, want, "side stream: read on the default stream after work.wait()")
    # c) work.synchronize(): the host may read the result at once; the
    # backend also blocks the host (csrc/work.h), so even a stream with no
    # dependency on the op sees it
    t = torch.zeros(n, device=dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(rank + 1)
        work = dist.all_reduce(t, async_op=True)
    work.synchronize()
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        snapshot = t.clone()  # a stream with no dependency on the op
    reader.synchronize()
    _expect(failures, snapshot, want, "work.synchronize(): read on an unrelated stream")
    _expect(failures, t, want, "work.synchronize(): read on the host")
    # d) a synchronous op behind a long kernel, read on the host at once
    t = torch.zeros(n, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(rank + 1)
    dist.all_reduce(t)
    _expect(failures, t, want, "sync all_reduce behind a long kernel")
    torch.cuda.synchronize()


# -- 4. CUDA graphs ---------------------------------------------------------------------


def check_graphs(rank: int, world: int, failures: list) -> None:
    from torch_groupcomm import get_coordinator

    dev = _dev()
    total = sum(range(world))
    # c10d all_reduce captured into a graph, replayed on new inputs
    static = torch.full((4096,), float(rank), device=dev)
    doubled = torch.empty_like(static)
    dist.all_reduce(static)  # warm-up outside capture: the CUDA communicator exists
    torch.cuda.synchronize()
    _expect(failures, static, torch.full((4096,), float(total)), "graph warm-up all_reduce")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(static)
        doubled.copy_(static * 2)  # a kernel of its own, so the graph is never empty
    for k in (1, 2, 5):
        static.fill_(float(rank + k))
        graph.replay()
        torch.cuda.synchronize()
        want = float(total + world * k)
        _expect(failures, static, torch.full((4096,), want), f"graph replay k={k}")
        _expect(failures, doubled, torch.full((4096,), 2 * want), f"graph replay k={k} (kernel after it)")
    # the coordinator API: all_reduce captured inside graph_capture()
    coord = get_coordinator(dist.group.WORLD)
    x = torch.full((1024,), float(rank), device=dev)
    warm = coord.all_reduce(x)  # outside capture
    torch.cuda.synchronize()
    _expect(failures, warm, torch.full((1024,), float(total)), "coordinator all_reduce warm-up")
    result = torch.empty_like(x)
    graph2 = torch.cuda.CUDAGraph()
    # (a coordinator built by c10d has device cpu, so ctx.stream is None and
    # torch.cuda.graph captures on its own side stream)
    with coord.graph_capture() as ctx:
        with torch.cuda.graph(graph2, stream=ctx.stream):
            y = coord.all_reduce(x)
            result.copy_(y)
    for k in (1, 3):
        x.fill_(float(rank + k))
        graph2.replay()
        torch.cuda.synchronize()
        want = float(total + world * k)
        _expect(failures, result, torch.full((1024,), want), f"coordinator graph replay k={k}")
        _expect(failures, y, torch.full((1024,), want), f"coordinator graph replay k={k} (captured output)")
    # eager ops still work after capture
    _in_step(rank, world, failures, "graph capture")


# -- 5./6. training ------------------------------------------------------------------------

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model: nn.Module, rank: int, dev: torch.device) -> list:
    opt = _optimizer(model)
    losses = []
    for x, y in _batches(rank):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _reference(world: int):
    """One process, on the CPU: every rank's batch per step, the gradient
    averaged over ranks (what DDP and FSDP2 compute). Returns the per-step
    loss of each rank's batch and the final parameters."""
    model = _model()
    opt = _optimizer(model)
    data = [_batches(r) for r in range(world)]
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = [nn.functional.mse_loss(model(data[r][step][0]), data[r][step][1]) for r in range(world)]
        torch.stack(per_rank).mean().backward()
        opt.step()
        losses.append([loss.item() for loss in per_rank])
    return losses, [p.detach().clone() for p in model.parameters()]


def _gathered_params(params, failures: list, what: str) -> list:
    """Full parameters (CUDA), and a check that every rank holds the same ones."""
    world = dist.get_world_size()
    full = []
    for i, p in enumerate(params):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        copies = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(copies, p.contiguous())
        _expect_true(
            failures, all(torch.equal(c, copies[0]) for c in copies), f"{what}: ranks hold different parameter {i}"
        )
        full.append(p.detach().clone())
    return full


def _compare_with_reference(rank: int, world: int, losses: list, params: list, failures: list, what: str) -> None:
    ref_losses, ref_params = _reference(world)
    try:
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor([step[rank] for step in ref_losses]),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m: f"{what} losses: {m}",
        )
    except AssertionError as exc:
        failures.append(str(exc))
    for i, (p, ref) in enumerate(zip(params, ref_params)):
        try:
            torch.testing.assert_close(
                p.cpu(), ref, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"{what} parameter {i}: {m}"
            )
        except AssertionError as exc:
            failures.append(str(exc))


def check_ddp(rank: int, world: int, failures: list) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_float32_matmul_precision("highest")  # no TF32: compared with the CPU
    dev = _dev()
    ddp = DDP(_model().to(dev), device_ids=[dev.index], bucket_cap_mb=0.001)  # several buckets in flight
    losses = _train(ddp, rank, dev)
    params = _gathered_params(ddp.module.parameters(), failures, "DDP")
    _compare_with_reference(rank, world, losses, params, failures, "DDP")
    # a no_sync window followed by a synchronised backward: same gradients everywhere
    ones = torch.ones(2, 16, device=dev) * (rank + 1)
    with ddp.no_sync():
        nn.functional.mse_loss(ddp(ones), torch.zeros(2, 4, device=dev)).backward()
    nn.functional.mse_loss(ddp(ones), torch.zeros(2, 4, device=dev)).backward()
    for i, p in enumerate(ddp.module.parameters()):
        copies = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(copies, p.grad)
        _expect_true(failures, all(torch.equal(c, copies[0]) for c in copies), f"DDP no_sync: gradient {i} differs")


def check_fsdp2(rank: int, world: int, failures: list) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.set_float32_matmul_precision("highest")
    dev = _dev()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    model = _model().to(dev)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _train(model, rank, dev)
    params = _gathered_params(model.parameters(), failures, "FSDP2")
    _compare_with_reference(rank, world, losses, params, failures, "FSDP2")


# -- 7. groupcomm for both devices ------------------------------------------------------------


def check_groupcomm_both_devices(rank: int, world: int, failures: list) -> None:
    from torch_groupcomm import get_coordinator

    dev = _dev()
    total = float(sum(range(world)))
    cpu = torch.full((100,), float(rank))
    gpu = torch.full((100,), float(rank), device=dev)
    dist.all_reduce(cpu)
    dist.all_reduce(gpu)
    _expect(failures, cpu, torch.full((100,), total), "groupcomm CPU all_reduce")
    _expect(failures, gpu, torch.full((100,), total), "groupcomm CUDA all_reduce")
    _expect_true(failures, cpu.device.type == "cpu", "CPU all_reduce moved its tensor")
    coord = get_coordinator()
    cpu_comm = coord.communicator_for(torch.device("cpu"))
    gpu_comm = coord.communicator_for(dev)
    _expect_true(failures, cpu_comm is not gpu_comm, f"CPU and CUDA share the communicator {cpu_comm.name}")
    # interleaved async ops on both devices, completed in any order
    a = torch.full((1000,), float(rank + 1), device=dev)
    b = torch.full((1000,), float(rank + 1))
    out_gpu = torch.empty(world * 3, dtype=torch.int64, device=dev)
    out_cpu = torch.empty(world * 3, dtype=torch.int64)
    works = [
        dist.all_reduce(a, op=R.MAX, async_op=True),
        dist.all_reduce(b, op=R.PRODUCT, async_op=True),
        dist.all_gather_into_tensor(out_gpu, torch.full((3,), rank, dtype=torch.int64, device=dev), async_op=True),
        dist.all_gather_into_tensor(out_cpu, torch.full((3,), rank, dtype=torch.int64), async_op=True),
    ]
    for w in reversed(works):
        w.wait()
    product = 1.0
    for r in range(world):
        product *= r + 1
    _expect(failures, a, torch.full((1000,), float(world)), "groupcomm CUDA async MAX")
    _expect(failures, b, torch.full((1000,), product), "groupcomm CPU async PRODUCT")
    gathered = torch.arange(world, dtype=torch.int64).repeat_interleave(3)
    _expect(failures, out_gpu, gathered, "groupcomm CUDA async all_gather_into_tensor")
    _expect(failures, out_cpu, gathered, "groupcomm CPU async all_gather_into_tensor")
    for device in (torch.device("cpu"), dev):
        t = torch.full((4,), float(rank), device=device)
        dist.broadcast(t, src=world - 1)
        _expect(failures, t, torch.full((4,), float(world - 1)), f"groupcomm broadcast on {device.type}")
    dist.barrier()
    dist.barrier(device_ids=[dev.index])
    _in_step(rank, world, failures, "mixed-device ops")


# -- 8. the C++ path ---------------------------------------------------------------------------

NATIVE_OPS = [
    "allreduce",
    "broadcast",
    "reduce",
    "_allgather_base",
    "_reduce_scatter_base",
    "alltoall_base",
    "allgather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
]


DENSE_PAIR = (torch.float32, torch.bfloat16)  # a coalesced call's tensors may differ in dtype


def check_native_path(rank: int, world: int, failures: list) -> None:
    """Once the group's first CUDA op (run by Python) made the NCCL
    communicator and side stream, the plain collectives on dense tensors are
    enqueued by the bridge's C++ path and never reach the Python frontend;
    what it leaves to Python (PREMUL_SUM, bitwise ops, bool, strided
    tensors) still does, with the same results. The coalesced forms torch
    issues for a ``_coalescing_manager`` block run there too."""
    from torch_groupcomm import get_coordinator
    from torch_groupcomm._native import _C

    dev = _dev()
    n = 1000
    dist.all_reduce(torch.ones(1, device=dev))
    path = get_coordinator(dist.group.WORLD).communicator_for(dev).native_path()
    _expect_true(failures, isinstance(path, _C.NcclPath), f"the CUDA communicator has no C++ path: {path!r}")
    with frontend_calls(NATIVE_OPS) as entered:
        for async_op in (False, True):

            def done(work) -> None:
                if async_op:
                    work.wait()

            tag = "async " if async_op else ""
            for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64):
                t = torch.full((n,), rank + 1, dtype=dtype, device=dev)
                done(dist.all_reduce(t, async_op=async_op))
                want = torch.full((n,), world * (world + 1) // 2, dtype=dtype)
                _expect(failures, t, want, f"C++ path {tag}all_reduce SUM {dtype}")
            t = torch.full((n,), float(rank + 1), device=dev)
            done(dist.all_reduce(t, op=R.AVG, async_op=async_op))
            _expect(failures, t, torch.full((n,), (world + 1) / 2), f"C++ path {tag}all_reduce AVG")
            t = torch.full((n,), rank, dtype=torch.int32, device=dev)
            done(dist.broadcast(t, src=world - 1, async_op=async_op))
            _expect(failures, t, torch.full((n,), world - 1, dtype=torch.int32), f"C++ path {tag}broadcast")
            t = torch.full((n,), float(rank + 1), dtype=torch.float64, device=dev)
            done(dist.reduce(t, dst=0, op=R.MAX, async_op=async_op))
            if rank == 0:
                _expect(failures, t, torch.full((n,), float(world), dtype=torch.float64), f"C++ path {tag}reduce MAX")
            out = torch.empty(world * n, dtype=torch.float16, device=dev)
            done(
                dist.all_gather_into_tensor(
                    out, torch.full((n,), rank, dtype=torch.float16, device=dev), async_op=async_op
                )
            )
            gathered = torch.arange(world, dtype=torch.float16).repeat_interleave(n)
            _expect(failures, out, gathered, f"C++ path {tag}all_gather_into_tensor")
            out = torch.empty(n, device=dev)
            done(
                dist.reduce_scatter_tensor(
                    out, torch.arange(world * n, dtype=torch.float32, device=dev) + rank, op=R.MIN, async_op=async_op
                )
            )
            want = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)
            _expect(failures, out, want, f"C++ path {tag}reduce_scatter_tensor MIN")
            # all_to_all_single: rank r sends rows [p * 3, p * 3 + 3) to peer p (even), or p + 1 rows (splits)
            src = (torch.arange(world * 3 * 2, device=dev) + 100 * rank).view(world * 3, 2)
            out = torch.empty_like(src)
            done(dist.all_to_all_single(out, src, async_op=async_op))
            want = torch.cat([torch.arange(rank * 6, rank * 6 + 6) + 100 * p for p in range(world)]).view(-1, 2)
            _expect(failures, out, want, f"C++ path {tag}all_to_all_single")
            sizes = [p + 1 for p in range(world)]
            src = torch.cat([torch.full((p + 1,), float(rank * world + p)) for p in range(world)]).to(dev)
            out = torch.empty(world * (rank + 1), device=dev)
            done(dist.all_to_all_single(out, src, [rank + 1] * world, sizes, async_op=async_op))
            want = torch.cat([torch.full((rank + 1,), float(p * world + rank)) for p in range(world)])
            _expect(failures, out, want, f"C++ path {tag}all_to_all_single with split sizes")
            # the coalesced forms torch issues for a _coalescing_manager block: one NCCL group each
            outs = [torch.empty(world * (n + i), dtype=dtype, device=dev) for i, dtype in enumerate(DENSE_PAIR)]
            with dist._coalescing_manager(async_ops=async_op) as cm:
                for i, (out, dtype) in enumerate(zip(outs, DENSE_PAIR)):
                    dist.all_gather_into_tensor(out, torch.full((n + i,), rank + i, dtype=dtype, device=dev))
            if async_op:
                cm.wait()
            for i, (out, dtype) in enumerate(zip(outs, DENSE_PAIR)):
                want = (torch.arange(world) + i).to(dtype).repeat_interleave(n + i)
                _expect(failures, out, want, f"C++ path {tag}coalesced all_gather_into_tensor {dtype}")
            outs = [torch.empty(n + i, dtype=dtype, device=dev) for i, dtype in enumerate(DENSE_PAIR)]
            with dist._coalescing_manager(async_ops=async_op) as cm:
                for i, (out, dtype) in enumerate(zip(outs, DENSE_PAIR)):
                    whole = (torch.arange(world * (n + i), device=dev) % 7 + rank).to(dtype)
                    dist.reduce_scatter_tensor(out, whole, op=R.MAX)
            if async_op:
                cm.wait()
            for i, (out, dtype) in enumerate(zip(outs, DENSE_PAIR)):
                want = (torch.arange(rank * (n + i), (rank + 1) * (n + i)) % 7 + world - 1).to(dtype)
                _expect(failures, out, want, f"C++ path {tag}coalesced reduce_scatter_tensor MAX {dtype}")
        native = list(entered)
        t = torch.full((n,), rank + 1, dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=R.BOR)
        _expect(failures, t, _expected_bor(world, n), "Python path all_reduce BOR")
        t = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        _expect(failures, t, torch.full((n,), float(world * (world + 1))), "Python path all_reduce PREMUL_SUM")
        t = torch.ones(n, dtype=torch.bool, device=dev)
        dist.all_reduce(t)
        _expect(failures, t, torch.ones(n, dtype=torch.bool), "Python path all_reduce of bool")
        t = torch.full((2, n), float(rank), device=dev).t()
        dist.broadcast(t, src=0)
        _expect(failures, t, torch.zeros(n, 2), "Python path broadcast of a strided tensor")
        outs = [torch.empty(n, dtype=torch.int32, device=dev) for _ in range(2)]
        with dist._coalescing_manager():
            for out in outs:
                dist.reduce_scatter_tensor(
                    out, torch.full((world * n,), rank + 1, dtype=torch.int32, device=dev), op=R.BOR
                )
        for out in outs:
            _expect(failures, out, _expected_bor(world, n), "Python path coalesced reduce_scatter_tensor BOR")
    _expect_true(failures, native == [], f"the C++ path's ops reached the Python frontend: {native}")
    python = entered[len(native) :]
    _expect_true(
        failures,
        python == ["allreduce", "allreduce", "allreduce", "broadcast", "reduce_scatter_tensor_coalesced"],
        f"the ops the C++ path leaves to Python reached the frontend as {python}",
    )
    _in_step(rank, world, failures, "C++ path")


def check_batched_transfers(rank: int, world: int, failures: list) -> None:
    """batch_isend_irecv on CUDA: each rank posts its sends to every rank,
    itself included (torch's nccl backend allows its own rank in a batch),
    before its receives, so the transfers meet only if the batch launches
    them as one NCCL group. The group's first CUDA op is such a batch (it
    makes the communicator). The batch waits for the caller's stream, its
    works order the caller's stream after the transfers, non-contiguous
    tensors arrive whole, and a collective issued inside a coalescing block
    runs after the transfers issued before it."""
    dev = _dev()
    n = 1 << 20
    outgoing = [torch.empty(n, device=dev) for _ in range(world)]
    incoming = [torch.full((n,), -1.0, device=dev) for _ in range(world)]
    torch.cuda._sleep(SLEEP_CYCLES)
    for p, t in enumerate(outgoing):
        t.fill_(float(rank * 100 + p))  # queued behind the sleep: a batch that does not wait sends -1s or garbage
    ops = [dist.P2POp(dist.isend, outgoing[p], p) for p in range(world)]
    ops += [dist.P2POp(dist.irecv, incoming[p], p) for p in range(world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for p in range(world):
        _expect(failures, incoming[p], torch.full((n,), float(p * 100 + rank)), f"batch_isend_irecv from rank {p}")
    # non-contiguous tensors on both sides, and a second batch on the same communicator
    sent = torch.arange(2 * 3 * world, dtype=torch.float64, device=dev).view(2, 3 * world)[:, ::3] + rank
    got = torch.zeros(world, 2, dtype=torch.float64, device=dev).t()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, nxt), dist.P2POp(dist.irecv, got, prv)])
    for w in works:
        w.wait()
    want = torch.arange(2 * 3 * world, dtype=torch.float64).view(2, 3 * world)[:, ::3] + prv
    _expect(failures, got, want, "batch_isend_irecv of non-contiguous tensors")
    # a coalescing block: transfers, then a broadcast (launches them first), then all_reduces (one coalesced call)
    a = torch.full((n,), float(rank), device=dev)
    b = torch.empty(n, device=dev)
    c = torch.full((5,), float(rank), device=dev)
    d = [torch.full((3,), float(rank + i), device=dev) for i in range(2)]
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        dist.isend(a, nxt)
        dist.irecv(b, prv)
        dist.broadcast(c, src=world - 1)
        for t in d:
            dist.all_reduce(t)
    cm.wait()
    _expect(failures, b, torch.full((n,), float(prv)), "send/recv in a coalescing block")
    _expect(failures, c, torch.full((5,), float(world - 1)), "broadcast in a coalescing block")
    for i, t in enumerate(d):
        _expect(
            failures, t, torch.full((3,), float(sum(range(world)) + i * world)), f"all_reduce {i} in a coalescing block"
        )
    # after the batches, plain ops again (the C++ path where it applies)
    _in_step(rank, world, failures, "batched transfers")


def _expected_bor(world: int, n: int) -> torch.Tensor:
    value = 0
    for r in range(world):
        value |= r + 1
    return torch.full((n,), value, dtype=torch.int32)


def check_native_timeout(rank: int, world: int, failures: list) -> None:
    """An op the C++ path enqueued that outlives the group's timeout (it
    waits behind a long kernel on the caller's stream): the watchdog aborts
    the communicator, and the group's later ops raise, naming the timeout."""
    import time
    from datetime import timedelta

    dev = _dev()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    t = torch.ones(16, device=dev)
    dist.all_reduce(t, group=group)  # Python: the communicator and side stream
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * 160)  # several seconds of GPU time
    dist.all_reduce(t, group=group)
    raised = None
    deadline = time.monotonic() + 60
    while raised is None and time.monotonic() < deadline:
        time.sleep(0.25)
        try:
            dist.all_reduce(torch.ones(1, device=dev), group=group)
        except RuntimeError as exc:
            raised = exc
    _expect_true(
        failures,
        raised is not None and "timeout" in str(raised),
        f"a late op on the C++ path: the group's next op raised {raised!r}",
    )
    torch.cuda.synchronize()
    dist.destroy_process_group(group)


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_reductions_and_errors(world: int) -> None:
    """Every ReduceOp x dtype through all_reduce, reduce (each root),
    reduce_scatter (list) and reduce_scatter_tensor; meaningless pairs raise
    TypeError; bad sizes raise ValueError; the group stays in step."""
    _launch(world, [check_reduction_matrix, check_errors])


@pytest.mark.parametrize("world", WORLDS)
def test_data_movement(world: int) -> None:
    """broadcast, all_gather (list, uneven, into tensor), gather, scatter,
    all_to_all(_single), uneven reduce_scatter, large messages, non-contiguous
    and zero-element tensors, send/recv rings, barriers; every dtype."""
    _launch(world, [check_data_movement, check_layouts, check_p2p_and_barrier])


@pytest.mark.parametrize("world", WORLDS)
def test_async_streams_and_graphs(world: int) -> None:
    """async_op work and futures, stream ordering of wait()/synchronize(),
    CUDA graph capture and replay through c10d and the coordinator API."""
    _launch(world, [check_async, check_stream_order, check_graphs])


@pytest.mark.parametrize("world", WORLDS)
def test_ddp(world: int) -> None:
    """DDP on CUDA over cpu:gloo,cuda:groupcomm trains like one process with the averaged gradient."""
    _launch(world, [check_ddp])


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2(world: int) -> None:
    """FSDP2 (fully_shard) on CUDA trains like one process with the averaged gradient."""
    _launch(world, [check_fsdp2])


@pytest.mark.parametrize("world", WORLDS)
def test_groupcomm_for_both_devices(world: int) -> None:
    """init_process_group("groupcomm"): CPU and CUDA collectives in one job."""
    _launch(world, [check_groupcomm_both_devices], backend="groupcomm")


@pytest.mark.parametrize("world", WORLDS)
def test_native_path(world: int) -> None:
    """The plain CUDA collectives run on the bridge's C++ path, with the same
    results as the Python path."""
    _launch(world, [check_native_path])


@pytest.mark.parametrize("world", WORLDS)
def test_batched_transfers(world: int) -> None:
    """batch_isend_irecv and coalescing blocks on CUDA launch their
    transfers as one NCCL group."""
    _launch(world, [check_batched_transfers])


@pytest.mark.parametrize("world", WORLDS)
def test_native_path_timeout(world: int) -> None:
    """The watchdog follows the C++ path's ops: a late one aborts the group."""
    _launch(world, [check_native_timeout])
