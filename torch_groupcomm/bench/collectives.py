"""Collectives: groupcomm against gloo (CPU) or nccl (CUDA), side by side in the same processes.

For every world size it starts that many ranks on 127.0.0.1, each holding a
``groupcomm`` default group and a baseline group over the same ranks (gloo
for ``--device cpu``; nccl for ``--device cuda``, one GPU per rank). For every
op and message size the two backends are timed in alternating rounds of at
least 20 ms each; the table shows rank 0's median time per op (each round of
a rooted op, broadcast, reduce, gather, scatter or broadcast_object, is timed
at its slowest rank: the root can return while its last bytes are on their
way), algorithm and
bus bandwidth (nccl-tests conventions) and the speedup of groupcomm over the
baseline. With ``--async`` every op that has an asynchronous form gets a second
row, ``<op> async``: the call with ``async_op=True`` and its ``wait()``,
timed in the same rounds as the synchronous call. Each
``--peer`` adds another call to the synchronous rows, timed in the same
rounds. On all_reduce rows: ``deepspeed`` (CPU, DeepSpeed installed) its
shared-memory all-reduce, ``deepspeed.comm.inference_all_reduce``, SUM over
the whole world, what its CPU inference uses, and the op that call runs
(``deepspeed op``, ``torch.ops.deepspeed.inference_all_reduce_``); ``coordinator``
``GroupCoordinator.all_reduce`` on the groupcomm group, the out-of-place
custom op ``torch.ops.groupcomm.all_reduce`` that compiled models call;
``fake`` torch's no-op backend, which moves nothing: what a
``dist.all_reduce`` call costs before any backend does anything. On every
row: ``twin``, the op on a second gloo group. The two gloo groups run the
same algorithm, so their ratio is how far a cell moves with nothing changed.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from . import steal
from .ranks import fake_group, spawn

COALESCED = 4  # tensors in one all_gather_coalesced / reduce_scatter_coalesced call


# The link bound. Across hosts an op cannot finish before the busiest host's
# link has carried, in one direction, the bytes that must cross it whatever
# the algorithm; ``link(N, host_of)`` gives those bytes for the whole buffer
# N as the bench sizes it (nccl-tests: all_gather's N is the gathered output,
# reduce_scatter's and all_to_all's the input of one rank) and ``host_of[r]``,
# rank r's host; with hosts H, L_h ranks on host h and world W. Ranks of one
# host are free to combine their data first, so all_reduce moves 2(H-1)/H*N
# (a reduce-scatter and an all-gather among H hosts, each holding the whole
# buffer); all_gather max_h N(W-L_h)/W, what host h must receive from the
# other hosts' ranks; reduce_scatter is all_gather run backwards: for the
# N*L_g/W bytes of host g's outputs, h's ranks hold contributions that,
# summed on h first, are N*L_g/W bytes only h can send, so h must send
# sum_{g!=h} N*L_g/W = N(W-L_h)/W (counting what h receives, one partial
# sum per other host, (H-1)N*L_h/W, bounds only direct exchange: a relay
# such as a ring sums on the way; both agree when the hosts have equal
# ranks); broadcast and reduce N (the root's host sends or receives all of
# it); gather and scatter what the root's host receives or
# sends for the other hosts' ranks, N(W-L_root)/W; all_to_all max_h
# L_h*N(W-L_h)/W (each rank's N/W for every rank on another host);
# send_recv N per rank whose partner (rank ^ 1) sits on another host, for
# the host with most of them; barrier none. A single host has a bound of 0.


def _hosts(host_of: Sequence[int]) -> list[int]:
    """Ranks per host."""
    counts: dict[int, int] = {}
    for h in host_of:
        counts[h] = counts.get(h, 0) + 1
    return list(counts.values())


def _link_all_reduce(n: float, host_of: Sequence[int]) -> float:
    hosts = len(_hosts(host_of))
    return 2 * (hosts - 1) / hosts * n


def _link_gathered(n: float, host_of: Sequence[int]) -> float:
    """all_gather and, sent instead of received, reduce_scatter."""
    world = len(host_of)
    return max(n * (world - local) / world for local in _hosts(host_of)) if len(_hosts(host_of)) > 1 else 0.0


def _link_root(n: float, host_of: Sequence[int]) -> float:
    """broadcast, reduce (and broadcast_object): the whole buffer leaves or reaches the root's host."""
    return n if len(_hosts(host_of)) > 1 else 0.0


def _link_root_share(n: float, host_of: Sequence[int]) -> float:
    """gather and scatter to or from rank 0: the other hosts' ranks' pieces."""
    world = len(host_of)
    return n * sum(1 for h in host_of if h != host_of[0]) / world


def _link_all_to_all(n: float, host_of: Sequence[int]) -> float:
    world = len(host_of)
    return max(local * n * (world - local) / world for local in _hosts(host_of))


def _link_send_recv(n: float, host_of: Sequence[int]) -> float:
    world = len(host_of)
    crossing: dict[int, int] = {}
    for r in range(world):
        if (r ^ 1) < world and host_of[r ^ 1] != host_of[r]:
            crossing[host_of[r]] = crossing.get(host_of[r], 0) + 1
    return n * max(crossing.values(), default=0)


@dataclass(frozen=True)
class OpShape:
    """How the bench sizes and reports an op. ``bus``: bus bandwidth over
    algorithm bandwidth at world n, as nccl-tests defines it; ``link``: the
    bytes the busiest host's link carries one way (see above; None: no
    bound); ``split``: the whole buffer is world-size pieces; ``has_async``:
    the call takes ``async_op`` (send_recv always waits on posted work);
    ``rooted``: one rank's data goes to or comes from the others, so the
    root may return while its last bytes are still on their way: each round
    is timed at its slowest rank."""

    bus: Callable[[int], float]
    link: Callable[[float, Sequence[int]], float] | None
    split: bool = True
    has_async: bool = True
    rooted: bool = False


def _ring(n: int) -> float:
    return (n - 1) / n


OPS: dict[str, OpShape] = {
    "all_reduce": OpShape(lambda n: 2 * (n - 1) / n, _link_all_reduce, split=False),
    "broadcast": OpShape(lambda n: 1.0, _link_root, split=False, rooted=True),
    "reduce": OpShape(lambda n: 1.0, _link_root, split=False, rooted=True),
    "all_gather": OpShape(_ring, _link_gathered),
    "reduce_scatter": OpShape(_ring, _link_gathered),
    "all_to_all": OpShape(_ring, _link_all_to_all),
    "gather": OpShape(_ring, _link_root_share, rooted=True),
    "scatter": OpShape(_ring, _link_root_share, rooted=True),
    "send_recv": OpShape(lambda n: 1.0, _link_send_recv, split=False, has_async=False),
    "barrier": OpShape(lambda n: 0.0, None, split=False),
    "broadcast_object": OpShape(lambda n: 1.0, _link_root, split=False, has_async=False, rooted=True),
    "all_gather_coalesced": OpShape(_ring, _link_gathered),
    "reduce_scatter_coalesced": OpShape(_ring, _link_gathered),
    "all_gather_list": OpShape(_ring, _link_gathered),
    "reduce_scatter_list": OpShape(_ring, _link_gathered),
    "all_to_all_list": OpShape(_ring, _link_all_to_all),
    "all_to_all_uneven": OpShape(_ring, _link_all_to_all),
}


def link_bytes(op: str, nbytes: float, host_of: Sequence[int]) -> float | None:
    """The bytes ``op`` on an ``nbytes`` buffer must move over the busiest
    host's link one way, ranks on hosts ``host_of``; None where it has no bound."""
    link = OPS[op].link
    return None if link is None else link(nbytes, host_of)


def parse_bytes(text: str) -> int:
    """'8', '64K', '16M', '1G' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB").rstrip("B") if text.upper().endswith(("IB", "B")) else text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _timed(issue: Callable[[bool], object], async_op: bool) -> Callable[[], object]:
    """The call a round repeats: ``issue(False)``, or ``issue(True).wait()``."""
    if async_op:
        return lambda: issue(True).wait()
    return lambda: issue(False)


def _deepspeed_all_reduces(numel: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """DeepSpeed's CPU all-reduce of ``numel`` elements (SUM, the whole
    world): its API call, and the op that call ends in where its kernels
    take the dtype (``deepspeed op``, the floor of any call into it)."""
    import deepspeed.comm.comm

    t = torch.ones(numel, dtype=dtype)
    calls = {"deepspeed": lambda: deepspeed.comm.inference_all_reduce(t)}
    raw = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
    # its kernels: float32 from AVX2 (level 1), 16-bit floats from AVX-512 BW (2)
    level = getattr(deepspeed.comm.comm.cdb, "shm_vector_kernel_level", 0)
    if raw is not None and level >= (1 if dtype == torch.float32 else 2):
        calls["deepspeed op"] = lambda: raw(t)
    return calls


def _coordinator_all_reduce(numel: int, dtype: torch.dtype) -> Callable[[], object]:
    """The coordinator's out-of-place all-reduce (the custom op) of ``numel``
    elements over the groupcomm world."""
    import torch.distributed as dist

    from torch_groupcomm import get_coordinator

    all_reduce = get_coordinator(dist.group.WORLD).all_reduce
    t = torch.ones(numel, dtype=dtype)
    return lambda: all_reduce(t)


def start_deepspeed(world: int) -> None:
    """DeepSpeed's communication layer over the already initialised world: its
    CPU accelerator, and the local size its shared-memory op needs (without
    LOCAL_SIZE its first call crashes). The first all-reduce compiles its C++
    op (about a minute)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    try:
        import deepspeed
    except ImportError:
        raise SystemExit(
            "--peer deepspeed needs DeepSpeed: pip install --no-build-isolation --no-deps deepspeed==0.19.8 && "
            "pip install einops hjson msgpack ninja packaging psutil py-cpuinfo pydantic tqdm"
        ) from None
    deepspeed.init_distributed("gloo")


def _make_op(
    name: str, numel: int, dtype: torch.dtype, rank: int, world: int, group, coordinator=None, async_op: bool = False
):
    """Buffers and a zero-argument call for one op; ``numel`` is the total size.
    ``broadcast_object`` sends a small dict holding that many bytes: through the
    ``coordinator``'s message queue when one is given, else with torch's
    ``broadcast_object_list`` over ``group``. ``async_op``: issue, then wait."""
    import torch.distributed as dist

    # torch 2.13 renamed the tensor forms (the old names warn)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    if name == "broadcast_object":
        obj = {"step": 1, "ids": [1, 2, 3], "data": b"x" * (numel * torch.empty(0, dtype=dtype).element_size())}
        if coordinator is not None:
            return lambda: coordinator.broadcast_object(obj if rank == 0 else None)
        return lambda: dist.broadcast_object_list([obj if rank == 0 else None], src=0, group=group)

    per = max(numel // world, 1)
    if name == "all_reduce":
        t = torch.ones(numel, dtype=dtype)
        return _timed(lambda a: dist.all_reduce(t, group=group, async_op=a), async_op)
    if name == "broadcast":
        t = torch.ones(numel, dtype=dtype)
        return _timed(lambda a: dist.broadcast(t, src=0, group=group, async_op=a), async_op)
    if name == "reduce":
        t = torch.ones(numel, dtype=dtype)
        return _timed(lambda a: dist.reduce(t, dst=0, group=group, async_op=a), async_op)
    if name == "all_gather":
        out, inp = torch.empty(per * world, dtype=dtype), torch.ones(per, dtype=dtype)
        return _timed(lambda a: all_gather_single(out, inp, group=group, async_op=a), async_op)
    if name == "reduce_scatter":
        out, inp = torch.empty(per, dtype=dtype), torch.ones(per * world, dtype=dtype)
        return _timed(lambda a: reduce_scatter_single(out, inp, group=group, async_op=a), async_op)
    if name == "all_to_all":
        out, inp = torch.empty(per * world, dtype=dtype), torch.ones(per * world, dtype=dtype)
        return _timed(lambda a: dist.all_to_all_single(out, inp, group=group, async_op=a), async_op)
    if name == "all_gather_list":  # the list forms: one tensor per rank
        outs, inp = [torch.empty(per, dtype=dtype) for _ in range(world)], torch.ones(per, dtype=dtype)
        return _timed(lambda a: dist.all_gather(outs, inp, group=group, async_op=a), async_op)
    if name == "reduce_scatter_list":
        out, ins = torch.empty(per, dtype=dtype), [torch.ones(per, dtype=dtype) for _ in range(world)]
        return _timed(lambda a: dist.reduce_scatter(out, ins, group=group, async_op=a), async_op)
    if name == "all_to_all_list":
        outs, ins = (
            [torch.empty(per, dtype=dtype) for _ in range(world)],
            [torch.ones(per, dtype=dtype) for _ in range(world)],
        )
        return _timed(lambda a: dist.all_to_all(outs, ins, group=group, async_op=a), async_op)
    if name == "all_to_all_uneven":  # all_to_all_single with split sizes (MoE's token exchange), here all equal
        out, inp = torch.empty(per * world, dtype=dtype), torch.ones(per * world, dtype=dtype)
        splits = [per] * world
        return _timed(lambda a: dist.all_to_all_single(out, inp, splits, splits, group=group, async_op=a), async_op)
    if name == "gather":
        inp = torch.ones(per, dtype=dtype)
        outs = [torch.empty(per, dtype=dtype) for _ in range(world)] if rank == 0 else None
        return _timed(lambda a: dist.gather(inp, outs, dst=0, group=group, async_op=a), async_op)
    if name == "scatter":
        out = torch.empty(per, dtype=dtype)
        ins = [torch.ones(per, dtype=dtype) for _ in range(world)] if rank == 0 else None
        return _timed(lambda a: dist.scatter(out, ins, src=0, group=group, async_op=a), async_op)
    if name == "send_recv":
        # ranks 2k and 2k+1 swap buffers (an odd last rank sits out)
        peer = dist.get_global_rank(group, rank ^ 1) if (rank ^ 1) < world else None
        out, inp = torch.ones(numel, dtype=dtype), torch.empty(numel, dtype=dtype)

        def swap():
            if peer is None:
                return
            for work in (dist.isend(out, peer, group=group), dist.irecv(inp, peer, group=group)):
                work.wait()

        return swap
    if name == "barrier":
        return _timed(lambda a: dist.barrier(group=group, async_op=a), async_op)
    if name in ("all_gather_coalesced", "reduce_scatter_coalesced"):
        # a _coalescing_manager block of COALESCED ops: torch issues them as one coalesced call
        part = max(per // COALESCED, 1)
        if name == "all_gather_coalesced":
            collective = all_gather_single
            pairs = [(torch.empty(part * world, dtype=dtype), torch.ones(part, dtype=dtype)) for _ in range(COALESCED)]
        else:
            collective = reduce_scatter_single
            pairs = [(torch.empty(part, dtype=dtype), torch.ones(part * world, dtype=dtype)) for _ in range(COALESCED)]

        def issue(a: bool):
            with dist._coalescing_manager(group=group, async_ops=a) as cm:
                for out, inp in pairs:
                    collective(out, inp, group=group)
            return cm

        return _timed(issue, async_op)
    raise ValueError(f"unknown op {name!r}; choose from {', '.join(OPS)}")


# A timed round lasts at least this long on rank 0: shorter ones are mostly
# noise on a small machine (scheduling, memory bandwidth shared with others).
MIN_ROUND_S = 0.02
MAX_CALLS = 5000


def _iterations(nbytes: int) -> int:
    return int(max(2, min(200, (32 << 20) // max(nbytes, 1))))


def _calls_per_round(calls: dict[str, Callable[[], object]], nbytes: int, gloo, cuda: bool) -> dict[str, int]:
    """How many calls each backend makes per timed round: enough for
    ``MIN_ROUND_S`` at the speed rank 0 measures, and at least
    ``_iterations(nbytes)``. Every rank uses rank 0's counts."""
    import torch.distributed as dist

    counts = []
    for call in calls.values():
        dist.barrier(group=gloo)
        start = time.perf_counter()
        call()
        call()
        if cuda:
            torch.cuda.synchronize()
        per_call = max((time.perf_counter() - start) / 2, 1e-7)
        counts.append(max(_iterations(nbytes), min(MAX_CALLS, math.ceil(MIN_ROUND_S / per_call))))
    agreed = torch.tensor(counts, dtype=torch.int64)
    dist.broadcast(agreed, src=dist.get_global_rank(gloo, 0), group=gloo)
    return dict(zip(calls, agreed.tolist()))


def _slowest_rank(samples: dict[str, list[float]], gloo) -> dict[str, list[float]]:
    """Each round's time at the rank that took longest (every rank calls this)."""
    import torch.distributed as dist

    times = torch.tensor(list(samples.values()), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=gloo)
    return dict(zip(samples, times.tolist()))


def _memcpy_gbps() -> float:
    src = torch.ones(64 << 20, dtype=torch.uint8, device="cpu")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() / best / 1e9


def _rank(rank: int, world: int, port: int, args: dict, conn) -> None:
    """One rank started by ``spawn`` on 127.0.0.1: the plan, its outcome through ``conn``."""
    try:
        conn.send(("ok", run_rank(rank, world, f"tcp://127.0.0.1:{port}", args, device_index=rank)))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        conn.send(("error", f"rank {rank}: {exc}\n{traceback.format_exc()}"))


def from_environment() -> bool:
    """Whether this process is one rank of a world described by the
    environment (torchrun's, or the simulated hosts' launch)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_env_rank(args: dict) -> dict | None:
    """Run the plan as the rank the environment names (env:// rendezvous);
    rank 0's results, None on the other ranks. Errors raise."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = run_rank(rank, world, "env://", args, device_index=int(os.environ.get("LOCAL_RANK", rank)))
    return result if rank == 0 else None


def run_rank(rank: int, world: int, init_method: str, args: dict, device_index: int) -> dict:
    """The whole plan on one rank; the results are rank 0's (other ranks
    return no records). ``device_index``: this rank's GPU with ``--device cuda``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import torch_groupcomm  # noqa: F401

    cuda = args["device"] == "cuda"
    base = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device_index)
        torch.set_default_device(f"cuda:{device_index}")  # every benchmark buffer lives on the GPU
    dist.init_process_group(
        "cpu:gloo,cuda:groupcomm" if cuda else "groupcomm",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    # Keeps the timed rounds in step. Neither measured group does that: a
    # group whose connections carried the barrier just before a round starts
    # it warm (2 hosts at 1 Gbit/s, 64 KiB all_to_all: gloo 0.39 ms on the
    # group that also held the barriers, 0.51-0.55 ms on others).
    gloo = dist.new_group(backend="gloo")
    # Each rank's host, by hostname, numbered in order of first rank: the link bound's layout.
    names: list = [None] * world
    dist.all_gather_object(names, socket.gethostname(), group=gloo)
    host_of = [names.index(n) for n in names]
    host_of = [sorted(set(host_of)).index(h) for h in host_of]
    groups = {"groupcomm": dist.group.WORLD, base: dist.new_group(backend="nccl" if cuda else "gloo")}
    peers = args.get("peers") or []
    if "deepspeed" in peers:
        os.environ["RANK"] = str(rank)
        start_deepspeed(world)
    if "fake" in peers:
        fake = fake_group()
        if fake is None:
            raise SystemExit(
                "--peer fake needs torch's no-op backend (torch.testing._internal.distributed.fake_pg), "
                "which this torch does not ship"
            )
    if "twin" in peers:
        twin = dist.new_group(backend="gloo")
    coordinators = {"groupcomm": None, base: None}
    if "broadcast_object" in args["ops"]:
        from torch_groupcomm.coordinator import GroupCoordinator

        coordinators["groupcomm"] = GroupCoordinator(
            [list(range(world))], rank, "groupcomm", use_message_queue_broadcaster=True, group_name="bench"
        )
    dtype = getattr(torch, args["dtype"])
    elem = torch.empty(0, dtype=dtype).element_size()
    memcpy = _memcpy_gbps() if rank == 0 else 0.0
    sizes = []
    size = max(args["min_bytes"], elem)
    while size <= args["max_bytes"]:
        sizes.append(size)
        size *= args["step"]
    plan = [(op, s) for op in args["ops"] for s in (sizes if op != "barrier" else [0])]
    records = []
    for index, (op, nbytes) in enumerate(plan):
        numel = max(nbytes // elem, 1)
        if OPS[op].split:
            numel = max(numel // world, 1) * world
        # An op's asynchronous form is timed in the same rounds as its
        # synchronous one: their ratio is then free of the VM's phases.
        modes = [False, True] if args.get("async") and OPS[op].has_async else [False]
        calls = {
            _label(name, a): _make_op(op, numel, dtype, rank, world, g, coordinators[name], a)
            for a in modes
            for name, g in groups.items()
        }
        if op == "all_reduce":
            if "coordinator" in peers:
                calls["coordinator"] = _coordinator_all_reduce(numel, dtype)
            if "deepspeed" in peers:
                calls.update(_deepspeed_all_reduces(numel, dtype))
            if "fake" in peers:
                calls["fake"] = _make_op(op, numel, dtype, rank, world, fake)
        if "twin" in peers:
            calls["twin"] = _make_op(op, numel, dtype, rank, world, twin)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():  # warm up every one
            call()
        iters = _calls_per_round(calls, numel * elem, gloo, cuda)
        ticks = steal.cpu_ticks() if rank == 0 else None
        for round_ in range(args["rounds"]):
            order = list(calls) if round_ % 2 == 0 else list(reversed(calls))
            for name in order:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(iters[name]):
                    calls[name]()
                if cuda:
                    torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - start) / iters[name] * 1e6)
        stolen = steal.share(ticks, steal.cpu_ticks()) if rank == 0 else None
        if OPS[op].rooted:
            samples = _slowest_rank(samples, gloo)
        if rank == 0:
            us = {name: statistics.median(v) for name, v in samples.items()}
            size_bytes = numel * elem if op != "barrier" else 0
            for async_op in modes:
                ours, theirs = us[_label("groupcomm", async_op)], us[_label(base, async_op)]
                records.append(
                    {
                        "world": world,
                        "op": op,
                        "async": async_op,
                        "bytes": size_bytes,
                        "dtype": args["dtype"],
                        "device": args["device"],
                        "baseline": base,
                        "groupcomm_us": ours,
                        "baseline_us": theirs,
                        "speedup": theirs / ours,
                        "groupcomm_busbw": size_bytes / ours / 1e3 * OPS[op].bus(world),
                        "baseline_busbw": size_bytes / theirs / 1e3 * OPS[op].bus(world),
                        "groupcomm_algbw": size_bytes / ours / 1e3,
                        "peers_us": {} if async_op else {p: v for p, v in us.items() if p.split()[0] in peers},
                        "hosts": _hosts(host_of),
                        "link_bytes": link_bytes(op, size_bytes, host_of),
                        "cpu_steal": stolen,
                    }
                )
            done = int(30 * (index + 1) / len(plan))
            sys.stderr.write(
                f"\r  world {world} [{'#' * done}{'.' * (30 - done)}] {index + 1}/{len(plan)} {op} {human(size_bytes):>9}"
            )
            sys.stderr.flush()
    if rank == 0:
        sys.stderr.write("\n")
    if coordinators["groupcomm"] is not None:
        coordinators["groupcomm"].destroy()
    dist.destroy_process_group()
    return {"records": records, "memcpy_gbps": memcpy}


def run_world(world: int, args: dict) -> dict:
    """Run the whole plan on ``world`` fresh ranks; return rank 0's results."""
    return spawn(_rank, world, args)


def merge_runs(runs: list[list[dict]]) -> list[dict]:
    """One record per row of several runs of the same plan (``--repeat``):
    each time the median of the runs' times, the speedup the median of the
    runs' speedups (each run's in ``run_speedups``), the CPU steal the most
    any run saw. A phase of the machine that holds all of one run's rounds
    of a row then moves that run's value, not the row's median."""
    rows: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            rows.setdefault((r["world"], r["op"], r.get("async", False), r["bytes"]), []).append(r)
    merged = []
    for same in rows.values():
        first = same[0]
        ours = statistics.median(r["groupcomm_us"] for r in same)
        theirs = statistics.median(r["baseline_us"] for r in same)
        bus = OPS[first["op"]].bus(first["world"])
        steals = [r["cpu_steal"] for r in same if r.get("cpu_steal") is not None]
        peers = {p for r in same for p in r.get("peers_us", {})}
        merged.append(
            {
                **first,
                "groupcomm_us": ours,
                "baseline_us": theirs,
                "speedup": statistics.median(r["speedup"] for r in same),
                "run_speedups": [r["speedup"] for r in same],
                "groupcomm_busbw": first["bytes"] / ours / 1e3 * bus,
                "baseline_busbw": first["bytes"] / theirs / 1e3 * bus,
                "groupcomm_algbw": first["bytes"] / ours / 1e3,
                "peers_us": {
                    p: statistics.median(r["peers_us"][p] for r in same if p in r.get("peers_us", {})) for p in peers
                },
                "cpu_steal": max(steals) if steals else None,
            }
        )
    return merged


def _label(op: str, async_op: bool) -> str:
    return f"{op} async" if async_op else op


def bound_us(record: dict, link_bytes_per_s: float | None) -> float | None:
    """The record's link bound in microseconds: its ``link_bytes`` over the
    link's rate; None without a rate, for an op with no bound, or where
    nothing crosses a link (one host)."""
    moved = record.get("link_bytes")
    if not link_bytes_per_s or not moved:
        return None
    return moved / link_bytes_per_s * 1e6


def format_table(records: list[dict], memcpy_gbps: float, link_bytes_per_s: float | None = None) -> str:
    """The table the CLI prints (and docs/benchmarks.md records); each peer's
    time (``--peer``) and groupcomm's speedup over it where it was timed.
    With ``link_bytes_per_s`` (one direction of one host's link) also each
    row's link bound (``bound_us``) and both backends' time over it."""
    base = records[0]["baseline"] if records else "gloo"
    peers = sorted({p for r in records for p in r.get("peers_us", {})})
    extra = "".join(f" {p + ' us':>13} {'vs ' + p:>13}" for p in peers)
    # the coordinator's custom op against DeepSpeed's call, as engines use either
    versus = [p for p in ("deepspeed", "deepspeed op") if "coordinator" in peers and p in peers]
    extra += "".join(f" {'coordinator vs ' + p:>26}" for p in versus)
    if link_bytes_per_s:
        extra += f" {'bound us':>10} {'groupcomm/bound':>15} {base + '/bound':>10}"
    has_steal = any(r.get("cpu_steal") is not None for r in records)
    if has_steal:
        extra += f" {'steal':>6}"
    runs = max((len(r.get("run_speedups", ())) for r in records), default=0)
    if runs > 1:
        extra += f"  {'runs':<{5 * runs}}"
    lines = [f"memcpy bandwidth (one core, 64 MiB): {memcpy_gbps:.2f} GB/s"]
    hosts = records[0].get("hosts", []) if records else []
    if link_bytes_per_s and hosts:
        lines.append(
            f"hosts: {len(hosts)} ({'+'.join(map(str, hosts))} ranks), link {link_bytes_per_s / 1e6:g} MB/s "
            "per direction; bound: the bytes the busiest host's link must carry one way / the link's rate"
        )
    elif len(hosts) > 1:
        lines.append(f"hosts: {len(hosts)} ({'+'.join(map(str, hosts))} ranks), no link rate: no bound")
    if has_steal:
        lines.append(
            "steal: the share of this machine's CPU time its hypervisor gave to other guests during the row's "
            "rounds (a row above a few % was timed on a busy host)"
        )
    if runs > 1:
        lines.append(
            f"{runs} runs, each on fresh ranks: a time is the median of the runs' medians, the speedup the median "
            "of the runs' speedups (each run's under 'runs'), the steal the most of any run"
        )
    lines += [
        "",
        f"{'world':>5} {'op':<20} {'size':>9} {'groupcomm us':>13} {base + ' us':>11} {'speedup':>8} "
        f"{'gc algbw':>9} {'gc busbw':>9} {base + ' busbw':>10} {'busbw/memcpy':>12}{extra}",
    ]
    for r in records:
        line = (
            f"{r['world']:>5} {_label(r['op'], r.get('async', False)):<20} {human(r['bytes']):>9} {r['groupcomm_us']:>13.1f} {r['baseline_us']:>11.1f} "
            f"{r['speedup']:>7.1f}x {r['groupcomm_algbw']:>9.3f} {r['groupcomm_busbw']:>9.3f} {r['baseline_busbw']:>10.3f} "
            f"{100 * r['groupcomm_busbw'] / memcpy_gbps:>11.0f}%"
        )
        for p in peers:
            us = r.get("peers_us", {}).get(p)
            line += f" {us:>13.1f} {us / r['groupcomm_us']:>12.2f}x" if us else f" {'':>13} {'':>13}"
        for p in versus:
            theirs, coord = r.get("peers_us", {}).get(p), r.get("peers_us", {}).get("coordinator")
            line += f" {theirs / coord:>25.2f}x" if theirs and coord else f" {'':>26}"
        if link_bytes_per_s:
            bound = bound_us(r, link_bytes_per_s)
            if bound:
                line += f" {bound:>10.1f} {r['groupcomm_us'] / bound:>14.2f}x {r['baseline_us'] / bound:>9.2f}x"
            else:
                line += f" {'-':>10} {'-':>15} {'-':>10}"
        if has_steal:
            share = r.get("cpu_steal")
            line += f" {100 * share:>5.0f}%" if share is not None else f" {'-':>6}"
        if runs > 1:
            line += "  " + " ".join(f"{x:.2f}" for x in r.get("run_speedups", ()))
        lines.append(line)
    return "\n".join(lines)


def format_scaling(records: list[dict]) -> str:
    """groupcomm time at each larger world size relative to world 2."""

    def key(r: dict) -> tuple:
        return r["op"], r.get("async", False), r["bytes"]

    base = {key(r): r["groupcomm_us"] for r in records if r["world"] == 2}
    rows = [r for r in records if r["world"] > 2 and key(r) in base]
    if not rows:
        return ""
    lines = ["", f"{'world':>5} {'op':<20} {'size':>9} {'time / world-2 time':>20}"]
    for r in rows:
        lines.append(
            f"{r['world']:>5} {_label(r['op'], r.get('async', False)):<20} {human(r['bytes']):>9} "
            f"{r['groupcomm_us'] / base[key(r)]:>19.2f}x"
        )
    worst = max(r["groupcomm_us"] / base[key(r)] for r in rows)
    lines.append(f"worst: {worst:.2f}x")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """Bus bandwidth against message size, both backends, one panel per op (synchronous rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    records = [r for r in records if not r.get("async", False)]
    ops = [op for op in OPS if any(r["op"] == op and r["bytes"] for r in records)]
    columns = min(len(ops), 4)
    rows_of_panels = -(-len(ops) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4 * columns, 3.5 * rows_of_panels), squeeze=False)
    for ax in axes.flat[len(ops) :]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        for world in sorted({r["world"] for r in records}):
            rows = [r for r in records if r["op"] == op and r["world"] == world and r["bytes"]]
            x = [r["bytes"] for r in rows]
            ax.plot(x, [r["groupcomm_busbw"] for r in rows], marker="o", label=f"groupcomm w{world}")
            ax.plot(
                x,
                [r["baseline_busbw"] for r in rows],
                marker="x",
                linestyle="--",
                label=f"{rows[0]['baseline'] if rows else 'baseline'} w{world}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth GB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
