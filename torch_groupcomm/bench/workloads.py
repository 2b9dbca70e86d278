"""Training step time: one model trained with DDP or FSDP2 over a ``groupcomm``
group and over a gloo group in the same processes, in alternating rounds,
beside the same step without communication.

The floor is what the step costs with no communication at all: for DDP the
``groupcomm`` model's step inside ``no_sync()`` (gradients stay local), for
FSDP2 the unsharded model trained locally. ``step - floor`` is what the
backend adds to a step (communication and everything around it). Where torch
ships its no-op ``fake`` backend, the wrapper over a ``fake`` group is timed
too (for DDP, with a comm hook that hands each bucket back at once: DDP's
reducer needs tensors the fake Work does not carry): what DDP or FSDP2 itself
costs around collectives that take no time, the best any backend can do.
The ranks of these two steps never wait for each other, so each runs at its
own pace; a step that synchronizes them runs at the slowest one's, and the
table shows the slowest rank's median for both (one vCPU of a VM can be a
few ms a step slower than the other). The backends' steps are rank 0's.

For DDP, ``comm`` is the all-reduce of DDP's own gradient buckets (their sizes
as its reducer built them) on the ``groupcomm`` group, one after another with
nothing else running: ``fake + comm`` is the step a backend with this kernel
would reach if its communication hid nowhere and waited on nothing. Where every
rank has one core and the step keeps it busy, nothing can hide it, so
``gloo / (fake + comm)`` bounds the speedup on that machine. ``hook comm``
is the same with the buffers moved where the peers read them in place, as
``shared_allreduce_hook`` moves DDP's buckets, and bounds the hooked step.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Callable

import torch
import torch.nn as nn

from ..ddp_hooks import shared_allreduce_hook
from .ranks import fake_group, join, spawn

WORKLOADS = ("ddp", "fsdp2")
MODELS = {
    "mlp": "8 Linear(1024, 1024) layers with ReLU, batch 8 (8.4 M parameters, 33.6 MB of fp32 gradients)",
    "transformer": "4 TransformerEncoderLayer(d_model 256, 4 heads, feed-forward 1024), batch 8 x 64 tokens",
}


def build_model(name: str) -> nn.Module:
    """The stated model, with the same initial weights on every rank."""
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for i in range(8):
            layers.append(nn.Linear(1024, 1024))
            if i < 7:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True, dropout=0.0)
        return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _batch(model: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    shape = (8, 1024) if model == "mlp" else (8, 64, 256)
    return torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def _stepper(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, context: Callable[[], object] = nullcontext
) -> Callable[[], None]:
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with context():
            loss = nn.functional.mse_loss(module(x), y)
            loss.backward()
        optimizer.step()

    return step


def _returned_at_once(state, bucket):  # unannotated: DDP compares the annotation as an object
    """A DDP comm hook that communicates nothing: the bucket comes back as it is."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _bucket_all_reduce(module, group, shared: bool) -> Callable[[], None]:
    """All-reduces buffers of the sizes of ``module``'s DDP buckets, as built
    after its first steps (looked up at the first call), in its parameters'
    dtype (the bench's models have one); ``shared``: moved where the peers
    read them in place and averaged, as ``shared_allreduce_hook`` does."""
    import torch.distributed as dist

    from .._registry import get_coordinator

    buffers: list[torch.Tensor] = []
    dtype = next(module.parameters()).dtype
    op = dist.ReduceOp.AVG if shared else dist.ReduceOp.SUM

    def step() -> None:
        if not buffers:
            sizes = str(module._get_ddp_logging_data()["bucket_sizes"]).split(",")
            buffers.extend(torch.zeros(int(n) // dtype.itemsize, dtype=dtype) for n in sizes)
            if shared:
                for buffer in buffers:
                    get_coordinator(group).share_storage(buffer)
        for buffer in buffers:
            dist.all_reduce(buffer, op=op, group=group)

    return step


def _steppers(workload: str, model: str, rank: int, groups: dict[str, object]) -> dict[str, Callable[[], None]]:
    """One step function per backend, plus ``floor`` (no communication) and,
    for DDP, ``comm`` and ``hook_comm`` (its buckets all-reduced alone)."""
    x, y = _batch(model, rank)
    steps: dict[str, Callable[[], None]] = {}
    if workload == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = {name: DDP(build_model(model), process_group=group) for name, group in groups.items()}
        # "hook": the groupcomm group with our comm hook, whose buckets the peers read in place
        wrapped["hook"] = DDP(build_model(model), process_group=groups["groupcomm"])
        wrapped["hook"].register_comm_hook(groups["groupcomm"], shared_allreduce_hook)
        if "fake" in wrapped:
            # the fake backend's Work carries no tensors, which DDP's reducer needs: a hook that
            # hands each bucket back at once stands in for it
            wrapped["fake"].register_comm_hook(None, _returned_at_once)
        for name, module in wrapped.items():
            steps[name] = _stepper(module, x, y)
        steps["floor"] = _stepper(wrapped["groupcomm"], x, y, wrapped["groupcomm"].no_sync)
        steps["comm"] = _bucket_all_reduce(wrapped["groupcomm"], groups["groupcomm"], shared=False)
        steps["hook_comm"] = _bucket_all_reduce(wrapped["groupcomm"], groups["groupcomm"], shared=True)
        return steps
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # "alloc": FSDP2's opt-in for backend-allocated buffers, on the groupcomm group
    for name, group in [*groups.items(), ("alloc", groups["groupcomm"])]:
        module = build_model(model)
        mesh = DeviceMesh.from_group(group, device_type="cpu")
        for layer in module if model == "mlp" else module.layers:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        for part in module.modules():  # the setting is per FSDP module
            if isinstance(part, FSDPModule):
                part.set_allocate_memory_from_process_group_for_comm(name == "alloc")
        steps[name] = _stepper(module, x, y)
    steps["floor"] = _stepper(build_model(model), x, y)
    return steps


# steps whose ranks never wait for each other: each rank's own pace, of which the table shows the slowest
UNSYNCHRONIZED = ("floor", "fake")


def measure(rank: int, world: int, sync, args: dict) -> list[dict]:
    """Time every workload of ``args`` on this rank of the initialized
    ``groupcomm`` default group, ``sync`` (a gloo group) keeping the rounds
    in step; the records are rank 0's (the slowest rank's for ``UNSYNCHRONIZED``)."""
    import torch.distributed as dist

    groups = {"groupcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    fake = fake_group()
    if fake is not None:
        groups["fake"] = fake
    results = []
    for workload in args["workloads"]:
        steps = _steppers(workload, args["model"], rank, groups)
        for step in steps.values():  # warm up: buckets, shards, allocator
            for _ in range(3):
                step()
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for round_ in range(args["rounds"]):
            order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
            for name in order:
                dist.barrier(group=sync)
                start = time.perf_counter()
                for _ in range(args["steps"]):
                    steps[name]()
                samples[name].append((time.perf_counter() - start) / args["steps"] * 1e3)
        ms = {name: statistics.median(v) for name, v in samples.items()}
        every: list[dict[str, float]] = [{} for _ in range(world)]
        dist.all_gather_object(every, ms, group=sync)
        for name in UNSYNCHRONIZED:  # a step that synchronizes the ranks runs at the slowest one's pace
            if name in ms:
                ms[name] = max(seen[name] for seen in every)
        results.append(
            {"workload": workload, "model": args["model"], "world": world, **{f"{k}_ms": v for k, v in ms.items()}}
        )
        if rank == 0:
            sys.stderr.write(f"  world {world} {workload} done\n")
    return results


def _rank(rank: int, world: int, port: int, args: dict, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        results = measure(rank, world, join(rank, world, port, timedelta(seconds=300)), args)
        dist.destroy_process_group()
        conn.send(("ok", results))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        conn.send(("error", f"rank {rank}: {exc}\n{traceback.format_exc()}"))


def run_env_rank(args: dict) -> list[dict] | None:
    """Every workload of ``args`` as the rank the environment names (torchrun's,
    or a simulated host's launch: env:// rendezvous); rank 0's records, None
    on the other ranks. Errors raise."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = measure(rank, world, join(rank, world, None, timedelta(seconds=300)), args)
    dist.destroy_process_group()
    return results if rank == 0 else None


# glibc gives a freed block at the top of its heap back to the system and maps
# large blocks afresh; whether a model's gradients land there changes from run to
# run and from rank to rank, and that model then page-faults all of them every
# step (6000 faults, +10 ms a step on the 2-core VM), whichever backend it trains
# on. Fixed thresholds keep freed memory mapped for the next step, as jemalloc or
# tcmalloc (torch's CPU performance advice) would.
STEADY_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 25)}


def run(world: int, args: dict) -> list[dict]:
    """Every workload of ``args`` on ``world`` fresh ranks; rank 0's step times
    (the slowest rank's for ``UNSYNCHRONIZED``).
    The ranks start with ``STEADY_MALLOC`` (unless the environment sets those)."""
    added = {k: v for k, v in STEADY_MALLOC.items() if k not in os.environ}
    os.environ.update(added)
    try:
        return spawn(_rank, world, args)
    finally:
        for name in added:
            del os.environ[name]


def format_table(records: list[dict]) -> str:
    """Step times, what each backend adds to the floor (and to the ``fake``
    backend's step, where it was timed), the step on the groupcomm group with
    the opt-in that lets peers read the collectives' inputs in place
    (``opt-in``: for FSDP2 its ``set_allocate_memory_from_process_group_for_comm(True)``,
    for DDP our ``shared_allreduce_hook``) and, for DDP, the speedup bounds
    ``gloo / (fake + comm)`` and, for the hooked step, ``gloo / (fake + hook
    comm)`` (see the module's docstring)."""
    nan = float("nan")
    lines = [
        f"{'world':>5} {'workload':<8} {'model':<12} {'floor ms':>9} {'fake ms':>8} {'gloo ms':>9} "
        f"{'groupcomm ms':>13} {'speedup':>8} {'gloo - floor':>13} {'groupcomm - floor':>18} "
        f"{'groupcomm - fake':>17} {'comm ms':>8} {'bound':>7} {'opt-in ms':>9} {'speedup':>8} "
        f"{'hook comm':>9} {'bound':>7}"
    ]
    for r in records:
        fake, comm = r.get("fake_ms", nan), r.get("comm_ms", nan)
        opted = r.get("alloc_ms", r.get("hook_ms", nan))
        hook_comm = r.get("hook_comm_ms", nan)
        lines.append(
            f"{r['world']:>5} {r['workload']:<8} {r['model']:<12} {r['floor_ms']:>9.2f} {fake:>8.2f} "
            f"{r['gloo_ms']:>9.2f} {r['groupcomm_ms']:>13.2f} {r['gloo_ms'] / r['groupcomm_ms']:>7.2f}x "
            f"{r['gloo_ms'] - r['floor_ms']:>13.2f} {r['groupcomm_ms'] - r['floor_ms']:>18.2f} "
            f"{r['groupcomm_ms'] - fake:>17.2f} {comm:>8.2f} "
            + (f"{r['gloo_ms'] / (fake + comm):>6.2f}x" if fake + comm > 0 else f"{'-':>7}")
            + (f" {opted:>9.2f} {r['gloo_ms'] / opted:>7.2f}x" if opted > 0 else f" {'-':>9} {'-':>8}")
            + (
                f" {hook_comm:>9.2f} {r['gloo_ms'] / (fake + hook_comm):>6.2f}x"
                if fake + hook_comm > 0
                else f" {'-':>9} {'-':>7}"
            )
        )
    return "\n".join(lines)
