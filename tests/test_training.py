"""DDP, FSDP2, tensor and pipeline parallelism on groupcomm train exactly like they do
on gloo: same losses and same parameters on every rank, in the same
processes, side by side; and under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_ranks

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, rank: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in _batches(rank):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _gathered_params(model: nn.Module, group) -> list:
    """Full parameters, and a check that every rank holds the same ones."""
    params = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, p.contiguous(), group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), "ranks hold different parameters"
        params.append(p.clone())
    return params


def check_ddp(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(backend="gloo")
    ours = DDP(_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.001)
    ref = DDP(_model(), process_group=gloo, bucket_cap_mb=0.001)
    ours_losses, ref_losses = _train(ours, rank), _train(ref, rank)
    assert ours_losses == ref_losses, (ours_losses, ref_losses)
    for a, b in zip(_gathered_params(ours.module, dist.group.WORLD), _gathered_params(ref.module, gloo)):
        assert torch.equal(a, b), "DDP parameters differ from gloo"
    # a no_sync window followed by a synchronised step also matches
    with ours.no_sync():
        nn.functional.mse_loss(ours(torch.ones(2, 16)), torch.zeros(2, 4)).backward()
    nn.functional.mse_loss(ours(torch.ones(2, 16)), torch.zeros(2, 4)).backward()
    grads = [p.grad.clone() for p in ours.parameters()]
    for g in grads:
        copies = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(copies, g)
        assert all(torch.equal(c, copies[0]) for c in copies)


def test_ddp_matches_gloo() -> None:
    run_ranks(check_ddp, 2)


def check_fsdp2(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    gloo = dist.new_group(backend="gloo")

    def sharded(group):
        model = _model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    ours, ref = sharded(dist.group.WORLD), sharded(gloo)
    ours_losses, ref_losses = _train(ours, rank), _train(ref, rank)
    assert ours_losses == ref_losses, (ours_losses, ref_losses)
    for a, b in zip(_gathered_params(ours, dist.group.WORLD), _gathered_params(ref, gloo)):
        assert torch.equal(a, b), "FSDP2 parameters differ from gloo"


def test_fsdp2_matches_gloo() -> None:
    run_ranks(check_fsdp2, 2)


def check_tensor_parallel(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    gloo = dist.new_group(backend="gloo")

    def parallel(group) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8 * world), nn.ReLU(), nn.Linear(8 * world, 4))
        mesh = DeviceMesh.from_group(group, "cpu")
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    ours, ref = parallel(dist.group.WORLD), parallel(gloo)
    # every rank feeds rank 0's batches: tensor parallelism wants the same input everywhere
    ours_losses, ref_losses = _train(ours, 0), _train(ref, 0)
    assert ours_losses == ref_losses, (ours_losses, ref_losses)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), "tensor-parallel parameters differ from gloo"


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_matches_gloo(world: int) -> None:
    run_ranks(check_tensor_parallel, world)


def _pipelined(schedule_name: str, group, rank: int, world: int):
    """One schedule of torch.distributed.pipelining over ``group``: the
    stages this rank holds (one per rank, or two, looped), trained for three
    steps; the last stage's losses and every held gradient."""
    from torch.distributed import pipelining

    schedule_cls = getattr(pipelining, schedule_name)
    per_rank = 1 if schedule_name in ("ScheduleGPipe", "Schedule1F1B") else 2
    stages_count = world * per_rank
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(2 * stages_count)]
    stages = [
        pipelining.PipelineStage(
            nn.Sequential(*layers[2 * i : 2 * i + 2]), i, stages_count, torch.device("cpu"), group=group
        )
        for i in range(rank, stages_count, world)
    ]
    schedule = schedule_cls(stages[0] if per_rank == 1 else stages, n_microbatches=4, loss_fn=nn.MSELoss())
    holds_first, holds_last = 0 in [s.stage_index for s in stages], stages_count - 1 in [s.stage_index for s in stages]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    losses: list = []
    for _ in range(3):
        step_losses: list = []  # the schedule refills it each step
        args = (x,) if holds_first else ()
        kwargs = {"target": y, "losses": step_losses} if holds_last else {}
        schedule.step(*args, **kwargs)
        losses += step_losses
    assert len(losses) == (12 if holds_last else 0), losses  # 3 steps of 4 microbatches
    grads = [p.grad.clone() for s in stages for p in s.submod.parameters()]
    return [loss.item() for loss in losses], grads


def check_pipelining(rank: int, world: int) -> None:
    gloo = dist.new_group(backend="gloo")
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"):
        ours_losses, ours_grads = _pipelined(name, dist.group.WORLD, rank, world)
        ref_losses, ref_grads = _pipelined(name, gloo, rank, world)
        assert ours_losses == ref_losses, (name, ours_losses, ref_losses)
        assert len(ours_grads) == len(ref_grads) > 0
        for a, b in zip(ours_grads, ref_grads):
            assert torch.equal(a, b), f"{name}: gradients differ from gloo"


@pytest.mark.parametrize("world", [2, 3])
def test_pipelining_matches_gloo(world: int) -> None:
    run_ranks(check_pipelining, world)


def _collectives(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(x * 2, "sum", group)
    z = funcol.all_gather_tensor(y + 1, 0, group)
    return funcol.reduce_scatter_tensor(z, "sum", 0, group).sin() + funcol.all_to_all_single(z, None, None, group).sum()


def check_compiled(rank: int, world: int) -> None:
    # functional collectives traced and lowered by inductor (what compiled
    # DTensor and FSDP2 code runs) give what they give eagerly
    x = torch.arange(8.0) + rank
    eager = _collectives(x, dist.group.WORLD)
    compiled = torch.compile(_collectives, fullgraph=True)(x, dist.group.WORLD)
    assert torch.allclose(eager, compiled), (eager, compiled)
    # a compiled DDP model (DDPOptimizer splits its graph at the buckets) trains as on gloo
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(backend="gloo")
    ours = DDP(_model(), process_group=dist.group.WORLD)
    ref = DDP(_model(), process_group=gloo)
    ours_losses, ref_losses = _train(torch.compile(ours), rank), _train(torch.compile(ref), rank)
    assert ours_losses == ref_losses, (ours_losses, ref_losses)
    for a, b in zip(ours.module.parameters(), ref.module.parameters()):
        assert torch.equal(a, b), "compiled DDP parameters differ from gloo"


def test_compiled_matches_eager_and_gloo() -> None:
    run_ranks(check_compiled, 2)
