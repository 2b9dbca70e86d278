"""The coordinator's collectives as torch custom ops (``torch.ops.groupcomm.*``)
on real ranks: values against plain torch math (fp32, bf16, odd shapes, every
dim, ragged sizes), the shared-memory path running without Python, the
Python path on gloo groups, order with queued c10d work, argument errors,
and ``torch.compile(fullgraph=True)`` of a tensor-parallel block (static and
dynamic shapes) giving the eager values without a graph break."""

from __future__ import annotations

import tempfile

import pytest
import torch
from _harness import run_ranks

TIMEOUT_S = 120
COMPILE_TIMEOUT_S = 600


def _value(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Small integers: exact in bf16, and so are their sums over a few ranks."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) * 7 + rank * 3) % 23 - 11).reshape(shape).to(dtype)


def _resized(shape: tuple, dim: int, n: int) -> tuple:
    """``shape`` with ``n`` along ``dim``."""
    resized = list(shape)
    resized[dim] = n
    return tuple(resized)


def _check_values(g) -> None:
    """Every op against torch math on the gathered inputs."""
    me, world = g.rank_in_group, g.world_size
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(7,), (1,), (3, 5), (2, 3, 4), (40000,), (3, 70001)]:
            x = _value(me, shape, dtype)
            total = sum(_value(r, shape, dtype).double() for r in range(world)).to(dtype)
            got = g.all_reduce(x)
            assert got.dtype == dtype and torch.equal(got, total), (dtype, shape)
            assert torch.equal(x, _value(me, shape, dtype)), "all_reduce must be out of place"
            assert torch.equal(g.all_reduce(x.t() if x.dim() == 2 else x), total.t() if x.dim() == 2 else total)
            for dim in range(-len(shape), len(shape)):
                everyone = [_value(r, shape, dtype) for r in range(world)]
                gathered = g.all_gather(x, dim)
                assert gathered.is_contiguous() and torch.equal(gathered, torch.cat(everyone, dim)), (shape, dim)
                if shape[dim] % world == 0:
                    assert torch.equal(g.reduce_scatter(x, dim), total.chunk(world, dim)[me]), (shape, dim)
                rows = [shape[dim] + r for r in range(world)]
                theirs = [_value(r, _resized(shape, dim, rows[r]), dtype) for r in range(world)]
                assert torch.equal(g.all_gatherv(theirs[me], dim, rows), torch.cat(theirs, dim)), (shape, dim)
                split = [shape[dim] - (world - 1)] + [1] * (world - 1) if shape[dim] >= world else None
                if split is not None:
                    assert torch.equal(g.reduce_scatterv(x, dim, split), total.split(split, dim)[me]), (shape, dim)
                uneven = total.tensor_split(world, dim)[me]
                assert torch.equal(g.reduce_scatterv(x, dim), uneven), (shape, dim)
        for src in range(world):
            b = _value(me, (3, 5), dtype).t()  # not contiguous: filled in place
            assert g.broadcast(b, src) is b and torch.equal(b, _value(src, (3, 5), dtype).t())
            out = torch.ops.groupcomm.broadcast(_value(me, (4,), dtype), src, g.unique_name)
            assert torch.equal(out, _value(src, (4,), dtype))
    # dtypes the kernels take through the Python path's wire plan, or as bytes
    z = torch.complex(_value(me, (5,)), _value(me + 1, (5,)))
    assert torch.equal(g.all_reduce(z), sum(torch.complex(_value(r, (5,)), _value(r + 1, (5,))) for r in range(world)))
    n = _value(me, (6,), torch.int64)
    assert torch.equal(g.all_reduce(n), sum(_value(r, (6,), torch.int64) for r in range(world)))
    flags = torch.tensor([me % 2 == 0, True])
    assert torch.equal(g.all_gather(flags, 0), torch.cat([torch.tensor([r % 2 == 0, True]) for r in range(world)]))


def _check_errors(g) -> None:
    name = g.unique_name
    for call, error, fragment in [
        (lambda: g.all_gather(torch.ones(2), dim=1), ValueError, "dim 1 is out of range"),
        (lambda: torch.ops.groupcomm.all_gather(torch.ones(2), 3, name), ValueError, "dim 3 is out of range"),
        (lambda: torch.ops.groupcomm.reduce_scatter(torch.ones(3), 0, name), ValueError, "divisible"),
        (lambda: torch.ops.groupcomm.all_gatherv(torch.ones(2), 0, [2], name), ValueError, "1 sizes for 2 ranks"),
        (lambda: torch.ops.groupcomm.broadcast(torch.ones(2), 5, name), ValueError, "broadcast src 5"),
        (lambda: torch.ops.groupcomm.all_reduce(torch.ones(2), "no-such-group"), ValueError, "no-such-group"),
    ]:
        with pytest.raises(error, match=fragment):
            call()


def _native_main(rank: int, world: int) -> str:
    import torch.distributed as dist

    import torch_groupcomm
    from torch_groupcomm import custom_ops
    from torch_groupcomm._native import _C

    g = torch_groupcomm.get_coordinator(dist.group.WORLD)
    assert g.all_reduce(torch.ones(3)).tolist() == [2.0] * 3  # builds the CPU communicator
    assert g.built_communicator("cpu").name == "shm"

    # On the shared-memory group the supported calls never enter Python.
    def refuse(op, *args):
        raise AssertionError(f"{op} took the Python path")

    _C.set_ops_python_path(refuse)
    try:
        x = _value(rank, (5, 6))
        total = sum(_value(r, (5, 6)) for r in range(world))
        assert torch.equal(g.all_reduce(x), total)
        assert torch.equal(g.all_gather(x, 1), torch.cat([_value(r, (5, 6)) for r in range(world)], 1))
        assert torch.equal(g.all_gatherv(x, 0, [5] * world), torch.cat([_value(r, (5, 6)) for r in range(world)]))
        assert torch.equal(g.reduce_scatter(x, 1), total.chunk(world, 1)[rank])
        assert torch.equal(g.reduce_scatterv(x, 0), total.tensor_split(world, 0)[rank])
        assert torch.equal(g.broadcast(x.clone(), 1), _value(1, (5, 6)))
    finally:
        _C.set_ops_python_path(custom_ops._python_path)

    # ordered with the group's c10d work queued before
    for _ in range(20):
        t = torch.full((1 << 16,), float(rank + 1))
        work = dist.all_reduce(t, async_op=True)
        assert torch.equal(g.all_reduce(_value(rank, (9,))), sum(_value(r, (9,)) for r in range(world)))
        work.wait()
        assert torch.equal(t, torch.full((1 << 16,), float(sum(range(1, world + 1)))))

    # an input a queued c10d op is still writing is read after it, also where
    # the op first copies it (strided, another dim, the root's broadcast)
    summed = float(sum(range(1, world + 1)))
    reads = {
        "all_reduce": (lambda v: g.all_reduce(v), summed * world),
        "all_gather": (lambda v: g.all_gather(v, 0), summed),
        "reduce_scatter": (lambda v: g.reduce_scatter(v, 0), summed * world),
        "broadcast": (lambda v: g.broadcast(v, 0), summed),
        "broadcast of a contiguous input": (lambda v: g.broadcast(v.t(), 0), summed),
    }
    for what, (call, want) in reads.items():
        for _ in range(10):
            t = torch.full((world * 64, 1024), float(rank + 1))
            work = dist.all_reduce(t, async_op=True)
            got = call(t.t())
            work.wait()
            assert torch.equal(got, torch.full_like(got, want)), what

    # inputs the peers read in place (shared blocks, 64 KiB and more) stay as they were
    for sharers in ({0}, set(range(world))):
        big = _value(rank, (1 << 15,))
        if rank in sharers:
            g.share_storage(big)
        total = sum(_value(r, (1 << 15,)) for r in range(world))
        assert torch.equal(g.all_reduce(big), total) and torch.equal(big, _value(rank, (1 << 15,)))
        assert torch.equal(g.reduce_scatter(big, 0), total.chunk(world)[rank])
        assert torch.equal(g.all_gather(big, 0), torch.cat([_value(r, (1 << 15,)) for r in range(world)]))
        assert torch.equal(big, _value(rank, (1 << 15,)))

    # one all-reduce called in different forms on different ranks: the op
    # (its result in a shared block, this rank's own slice read from the
    # input), the op on a strided input (copied, then reduced in place), and
    # dist.all_reduce in place on a plain tensor and on one in a block
    def in_place(v: torch.Tensor, shared: bool) -> torch.Tensor:
        assert not shared or g.share_storage(v)
        dist.all_reduce(v)
        return v

    n = (1 << 18) + 5
    total = sum(_value(r, (n,)) for r in range(world))
    forms = {
        "op": lambda v: g.all_reduce(v),
        "op, strided": lambda v: g.all_reduce(torch.stack([v, v], 1)[:, 0]),
        "in place": lambda v: in_place(v, False),
        "in place, in a block": lambda v: in_place(v, True),
    }
    for mine in forms:
        for theirs in forms:
            form = mine if rank == 0 else theirs
            x = _value(rank, (n,))
            assert torch.equal(forms[form](x), total), (mine, theirs)
            assert not form.startswith("op") or torch.equal(x, _value(rank, (n,))), (mine, theirs)

    # large outputs come from a pool: a freed one is the next one's memory,
    # values right, resizable like any tensor, idle memory bounded
    x = _value(rank, (1 << 16,))
    total = sum(_value(r, (1 << 16,)) for r in range(world))
    first = g.all_reduce(x)
    where = first.data_ptr()
    del first
    again = g.all_reduce(x)
    assert again.data_ptr() == where and torch.equal(again, total)
    assert torch.equal(g.all_gather(again, 0)[: 1 << 16], total)  # its pooled input, read as any other
    again.resize_(1 << 18)
    assert torch.equal(again[: 1 << 16], total)
    del again
    # (fp32 up to 16 MiB in a shared block, past it from the segment's slots)
    for n in (1 << 16, 3 << 16, 1 << 20, 3 << 20, 4 << 20, 5 << 20, 9 << 20, 17 << 20, 33 << 20):
        assert torch.equal(g.all_reduce(torch.full((n,), float(rank))), torch.full((n,), float(sum(range(world)))))
    assert _C.output_pool_idle_bytes() <= max(256 << 20, (33 << 20) * 4)  # the cap, or the latest alone
    # an uneven length: in a shared block (bf16), streamed out of the segment (fp32 and fp64 past 16 MiB)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        n = (5 << 20) + 7
        got = g.all_reduce(_value(rank, (n,), dtype))
        assert torch.equal(got, sum(_value(r, (n,), dtype).double() for r in range(world)).to(dtype)), dtype

    _check_values(g)
    _check_errors(g)
    return "ok"


def test_ops_on_shared_memory() -> None:
    assert run_ranks(_native_main, 2, timeout=TIMEOUT_S) == ["ok"] * 2


def _python_path_main(rank: int, world: int) -> str:
    import torch.distributed as dist

    import torch_groupcomm

    g = torch_groupcomm.get_coordinator(dist.group.WORLD)
    g.all_reduce(torch.ones(1))
    assert g.built_communicator("cpu").name == "gloo"
    _check_values(g)
    _check_errors(g)
    return "ok"


def test_ops_on_gloo_take_the_python_path() -> None:
    env = {"GROUPCOMM_CPU_COMMUNICATOR": "gloo"}
    assert run_ranks(_python_path_main, 2, env=env, timeout=TIMEOUT_S) == ["ok"] * 2


def _tp_block(g, dims: tuple[int, int, int], seed: int = 0):
    """A Megatron-style block sharded over coordinator ``g``: a
    column-parallel linear (gelu), a row-parallel linear whose partial sums
    are all-reduced, then a column-parallel projection all-gathered along
    its last dim. Returns the block and the unsharded reference."""
    torch.manual_seed(seed)
    d, hidden, out = dims
    w1, b1 = torch.randn(hidden, d) / d**0.5, torch.randn(hidden)
    w2, b2 = torch.randn(d, hidden) / hidden**0.5, torch.randn(d)
    w3 = torch.randn(out, d) / d**0.5
    world, me = g.world_size, g.rank_in_group
    w1s, b1s = w1.chunk(world, 0)[me], b1.chunk(world, 0)[me]
    w2s, w3s = w2.chunk(world, 1)[me], w3.chunk(world, 0)[me]

    def block(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1s, b1s))
        y = g.all_reduce(torch.nn.functional.linear(h, w2s)) + b2
        return g.all_gather(torch.nn.functional.linear(y, w3s), dim=-1) * 2

    def reference(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
        return torch.nn.functional.linear(torch.nn.functional.linear(h, w2) + b2, w3) * 2

    return block, reference


def _sequence_parallel(g):
    """reduce_scatter, all_gatherv, reduce_scatterv and broadcast in one graph."""
    world = g.world_size

    def step(x: torch.Tensor) -> torch.Tensor:
        part = g.reduce_scatter(x * 2, dim=0)
        whole = g.all_gatherv(part + 1, dim=0, sizes=[part.shape[0]] * world)
        ragged = g.reduce_scatterv(whole, dim=0)
        return g.all_gatherv(ragged, dim=0) + g.broadcast(x.clone(), src=world - 1)

    return step


def _reads_input_after(g):
    """An all-reduce whose input is read again: it must stay out of place."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return g.all_reduce(y) + y

    return step


def _compile_main(rank: int, world: int, backend: str) -> str:
    import torch._dynamo
    import torch.distributed as dist

    import torch_groupcomm

    g = torch_groupcomm.get_coordinator(dist.group.WORLD)
    block, reference = _tp_block(g, (16, 32, 24))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    eager = block(x)
    torch.testing.assert_close(eager, reference(x), rtol=1e-5, atol=1e-5)

    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    torch._dynamo.reset()

    static = torch.compile(block, fullgraph=True, backend=backend)
    if backend == "inductor":
        from torch._inductor.utils import run_and_get_code

        # the row-parallel partial sums die with the all-reduce: reduced in place
        out, code = run_and_get_code(static, x)
        assert "groupcomm.all_reduce_" in "\n".join(code), "the all-reduce was not reduced in place"
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        kept = torch.compile(_reads_input_after(g), fullgraph=True)
        out, code = run_and_get_code(kept, x)
        assert "groupcomm.all_reduce_" not in "\n".join(code), "an input read again was reduced in place"
        torch.testing.assert_close(out, _reads_input_after(g)(x))
        # the caller's tensor itself is never reduced in place
        before = x.clone()
        torch.testing.assert_close(torch.compile(g.all_reduce, fullgraph=True)(x), g.all_reduce(before))
        assert torch.equal(x, before), "a compiled all_reduce wrote into its argument"
    torch.testing.assert_close(static(x), eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static(x + 1), block(x + 1), rtol=1e-5, atol=1e-5)

    dynamic = torch.compile(block, fullgraph=True, dynamic=True, backend=backend)
    for rows in (3, 7, 12):
        y = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(dynamic(y), block(y), rtol=1e-5, atol=1e-5)

    # the in-place form Inductor substitutes, called as it is: dense and strided
    for part in (lambda r: _value(r, (6, 5)), lambda r: _value(r, (6, 10))[:, ::2]):
        t, expect = part(rank), sum(part(r) for r in range(world))
        torch.ops.groupcomm.all_reduce_(t, g.unique_name)
        torch.testing.assert_close(t, expect)

    step = _sequence_parallel(g)
    for rows in (4, 6):
        y = torch.randn(rows * world, 3, generator=torch.Generator().manual_seed(rank * 10 + rows))
        compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
        torch.testing.assert_close(compiled(y), step(y))
    return "ok"


@pytest.mark.parametrize("cpu_communicator", ["shm", "gloo"])
def test_compiled_tensor_parallel_block(cpu_communicator: str) -> None:
    # inductor on the shared-memory group; the gloo group checks the trace
    # and the Python path under aot_eager (no C++ compile of its own)
    backend = "inductor" if cpu_communicator == "shm" else "aot_eager"
    env = {"GROUPCOMM_CPU_COMMUNICATOR": cpu_communicator, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
    assert run_ranks(_compile_main, 2, args=(backend,), env=env, timeout=COMPILE_TIMEOUT_S) == ["ok"] * 2
