"""Buffers in shared blocks: those the backend allocates (``allocate_tensor``,
FSDP2's opt-in ``set_allocate_memory_from_process_group_for_comm``) and
storages moved there (``GroupCoordinator.share_storage``, DDP's
``shared_allreduce_hook``); on a shared-memory group the peers read them in
place. All-gathers, reduce-scatters and all-reduces give the same results
whichever ranks' inputs lie in a block, FSDP2 with the opt-in and DDP with the
hook train exactly like on gloo, and a block outlives its group safely."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import last_rank_dies, run_ranks, shm_segments

CPU = torch.device("cpu")


def _can_map_peers(rank: int, world: int) -> bool:
    """Whether every rank may open every peer's memfd through /proc, found
    without the package: each rank shows a token in one, the others read it."""
    fd = os.memfd_create("probe")
    os.pwrite(fd, (0x5EED0000 + rank).to_bytes(8, "little"), 0)
    shown = [None] * world
    dist.all_gather_object(shown, (os.getpid(), fd))
    ok = True
    for peer, (pid, their_fd) in enumerate(shown):
        if peer != rank:
            try:
                with open(f"/proc/{pid}/fd/{their_fd}", "rb") as f:
                    ok &= int.from_bytes(f.read(8), "little") == 0x5EED0000 + peer
            except OSError:
                ok = False
    dist.barrier()  # nobody closes its memfd before every peer read it
    os.close(fd)
    return ok


def _values(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.float64) * 7 + seed) % 97 - 40).to(dtype)


def _buffer(backend, use_block: bool, n: int, dtype: torch.dtype) -> torch.Tensor:
    if use_block:
        return backend.allocate_tensor(n, dtype=dtype, device=CPU)
    return torch.empty(n, dtype=dtype)


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 4))


def _train(model: nn.Module, rank: int) -> None:
    """Four SGD steps with momentum on this rank's own batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _fsdp2_matches_gloo(rank: int, world: int) -> None:
    """FSDP2 with the opt-in trains bit for bit like without it, and like
    gloo (exactly with two ranks; with three the sums' order differs)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    gloo = dist.new_group(backend="gloo")

    def trained(group, opt_in: bool) -> list:
        model = _small_model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():  # the setting is per FSDP module, not inherited
            if isinstance(module, FSDPModule):
                module.set_allocate_memory_from_process_group_for_comm(opt_in)
        _train(model, rank)
        return [p.full_tensor() for p in model.parameters()]

    from torch_groupcomm import get_coordinator

    workspace = get_coordinator().communicator_for(CPU).workspace
    held = workspace.shared_bytes
    opted = trained(dist.group.WORLD, True)
    assert (workspace.shared_bytes > held) == workspace.shared  # FSDP2's buffers came from blocks
    plain, ref = trained(dist.group.WORLD, False), trained(gloo, True)
    for a, b, c in zip(opted, plain, ref):
        assert torch.equal(a, b), "FSDP2 with the opt-in differs from without"
        if world == 2:
            assert torch.equal(a, c), "FSDP2 parameters differ from gloo"
        else:
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def _ddp_hook_matches_gloo(rank: int, world: int, shared: bool) -> None:
    """DDP with ``shared_allreduce_hook`` trains like DDP without it, on
    groupcomm and on gloo (the hook on gloo is torch's allreduce_hook), with
    and without gradients as views of the buckets; its buckets moved into
    shared blocks where the group has them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_groupcomm import get_coordinator
    from torch_groupcomm.ddp_hooks import shared_allreduce_hook

    gloo = dist.new_group(backend="gloo")
    workspace = get_coordinator().communicator_for(CPU).workspace

    def trained(group, hook: bool, views: bool) -> list:
        ddp = DDP(_small_model(), process_group=group, bucket_cap_mb=0.25, gradient_as_bucket_view=views)
        if hook:
            ddp.register_comm_hook(group, shared_allreduce_hook)
        _train(ddp, rank)
        return [p.detach().clone() for p in ddp.parameters()]

    reference = trained(gloo, False, False)
    held = workspace.shared_bytes
    runs = {"hook": trained(dist.group.WORLD, True, False)}
    assert (workspace.shared_bytes > held) == shared  # the buckets moved into blocks
    runs["hook, bucket views"] = trained(dist.group.WORLD, True, True)
    runs["no hook"] = trained(dist.group.WORLD, False, False)
    runs["hook on gloo"] = trained(gloo, True, False)
    for name, params in runs.items():
        for a, b in zip(params, reference):
            if world == 2:  # halving is exact: the same bits whether before or after the sum
                assert torch.equal(a, b), f"DDP ({name}) differs from DDP on gloo"
            else:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"DDP ({name}) differs from gloo")


def _all_reduce_any_mix(rank: int, world: int, shared: bool) -> None:
    """All-reduces with each rank's tensor moved into a block or not in turn:
    below the threshold, within one chunk and over several."""
    from torch_groupcomm import get_coordinator

    coordinator = get_coordinator()
    case = 0
    for n in (1000, 50_000, 700_000):
        for dtype in (torch.float32, torch.bfloat16):
            for mix in range(1 << world):
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                    tensor = _values(n, 11 * rank + case, dtype)
                    head = tensor[:7]  # a view taken before the move follows it
                    where = tensor.data_ptr()
                    if mix >> rank & 1:
                        moved = coordinator.share_storage(tensor)
                        assert moved == (shared and n * tensor.element_size() >= 64 << 10), (n, dtype)
                        assert (tensor.data_ptr() != where) == moved
                        assert torch.equal(tensor, _values(n, 11 * rank + case, dtype))  # contents kept
                        assert coordinator.share_storage(tensor) == moved  # once is enough
                    dist.all_reduce(tensor, op=op)
                    rows = torch.stack([_values(n, 11 * r + case, dtype) for r in range(world)]).double()
                    full = {
                        dist.ReduceOp.SUM: rows.sum(0),
                        dist.ReduceOp.AVG: rows.mean(0),
                        dist.ReduceOp.MAX: rows.max(0).values,
                    }[op]
                    tol = 0 if dtype == torch.float32 and op != dist.ReduceOp.AVG else 1e-2
                    torch.testing.assert_close(tensor, full.to(dtype), atol=tol, rtol=tol)
                    assert torch.equal(head, tensor[:7])
                    case += 1
    assert not coordinator.share_storage(torch.from_numpy(_values(1 << 16, 0, torch.float32).numpy()))  # not ours


def _blocks_stay_bounded(rank: int, world: int, backend, workspace) -> None:
    """Blocks of ever larger sizes, each all-gathered in place and freed: a
    rank keeps at most 256 MiB of freed blocks, and drops its mappings of
    the blocks its peers closed, whenever 256 MiB more have been mapped."""
    mib = 1 << 20
    largest = 0
    for step in range(16):
        size = (8 + 2 * step) * mib  # never fits a block freed before
        largest = size
        outs = [backend.allocate_tensor(size // 4 + k, dtype=torch.float32, device=CPU) for k in range(3)]
        for k, out in enumerate(outs):
            n = out.numel() // world
            mine = out.narrow(0, n * rank, n)
            mine.fill_(rank + k + step)
            dist.all_gather_into_tensor(out.narrow(0, 0, n * world), mine)
            assert all(out[n * r].item() == r + k + step for r in range(world)), (step, k)
        del outs, out, mine
    dist.barrier()
    assert workspace.shared_bytes <= 256 * mib, workspace.shared_bytes
    # each peer's blocks alive (in use or kept), the mappings made since
    # the last check and one more block; the 16 steps mapped 1.1 GiB a peer
    bound = (world - 1) * (256 * mib + 3 * largest) + 256 * mib + largest
    assert workspace.peer_block_bytes <= bound, (workspace.peer_block_bytes, bound)


def check_shared_alloc(rank: int, world: int) -> bool:
    from torch_groupcomm import get_coordinator

    dist.barrier()  # builds the CPU communicator: the backend's plan is known from here
    workspace = get_coordinator().communicator_for(CPU).workspace
    wanted = os.environ["GROUPCOMM_SHM_DIRECT"] == "1"
    assert workspace.shared == (wanted and _can_map_peers(rank, world))
    backend = dist.group.WORLD._get_backend(CPU)
    assert backend.supports_tensor_alloc(CPU) == workspace.shared
    _fsdp2_matches_gloo(rank, world)
    _ddp_hook_matches_gloo(rank, world, workspace.shared)
    _all_reduce_any_mix(rank, world, workspace.shared)

    # the same block again for the same size, once the tensor is gone
    first = backend.allocate_tensor(1 << 18, dtype=torch.float32, device=CPU)
    assert first.shape == (1 << 18,) and first.dtype == torch.float32
    where = first.data_ptr()
    del first
    again = backend.allocate_tensor(1 << 18, dtype=torch.float32, device=CPU)
    assert again.data_ptr() == where or not workspace.shared
    small = backend.allocate_tensor(10, dtype=torch.int64, device=CPU)  # too small to gain: plain
    assert small.shape == (10,) and small.dtype == torch.int64

    # FSDP2's all-gather (the input a view of the output's own chunk) and
    # reduce-scatter, with each rank's buffers in a block or not in turn, so
    # that every mix of in-place and copied inputs occurs; sizes below the
    # threshold, within one chunk and over several.
    case = 0
    for n in (1000, 50_000, 700_000):
        for dtype in (torch.float32, torch.bfloat16):
            for mix in range(1 << world):
                in_block = bool(mix >> rank & 1)
                out = _buffer(backend, in_block, n * world, dtype)
                mine = out.narrow(0, n * rank, n)
                mine.copy_(_values(n, rank + case, dtype))
                dist.all_gather_into_tensor(out, mine)
                expected = torch.cat([_values(n, r + case, dtype) for r in range(world)])
                assert torch.equal(out, expected), (n, dtype, mix)

                separate = _buffer(backend, in_block, n, dtype)  # an input outside the output
                separate.copy_(_values(n, 3 * rank + case, dtype))
                gathered = torch.empty(n * world, dtype=dtype)
                work = dist.all_gather_into_tensor(gathered, separate, async_op=True)
                work.wait()
                assert torch.equal(gathered, torch.cat([_values(n, 3 * r + case, dtype) for r in range(world)]))

                grads = _buffer(backend, in_block, n * world, dtype)
                grads.copy_(_values(n * world, 5 * rank + case, dtype))
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                    got = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(got, grads, op=op)
                    rows = torch.stack([_values(n * world, 5 * r + case, dtype) for r in range(world)]).double()
                    full = {
                        dist.ReduceOp.SUM: rows.sum(0),
                        dist.ReduceOp.AVG: rows.mean(0),
                        dist.ReduceOp.MAX: rows.max(0).values,
                    }[op]
                    want = full.narrow(0, n * rank, n).to(dtype)
                    tol = 0 if dtype == torch.float32 and op != dist.ReduceOp.AVG else 1e-2
                    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
                case += 1

    # a block outlives its group: readable after the group is destroyed
    group = dist.new_group()
    dist.barrier(group=group)
    kept = group._get_backend(CPU).allocate_tensor(1 << 17, dtype=torch.float64, device=CPU)
    kept.fill_(rank)
    dist.all_reduce(kept, group=group)
    dist.destroy_process_group(group)
    assert torch.equal(kept, torch.full((1 << 17,), float(sum(range(world))), dtype=torch.float64))
    del kept, again
    if workspace.shared:
        _blocks_stay_bounded(rank, world, backend, workspace)
    dist.barrier()
    return workspace.shared


@pytest.mark.parametrize("world,direct", [(2, "1"), (3, "1"), (2, "0")])
def test_shared_buffers_match(world: int, direct: str) -> None:
    env = {"GROUPCOMM_SHM_DIRECT": direct, "GROUPCOMM_CPU_COMMUNICATOR": "shm"}
    results = run_ranks(check_shared_alloc, world, env=env)
    assert len(set(results)) == 1, results
    assert shm_segments() == []


def check_killed_rank_in_place(rank: int, world: int) -> str:
    from torch_groupcomm import get_coordinator

    dist.barrier()
    assert get_coordinator().communicator_for(CPU).workspace.shared
    backend = dist.group.WORLD._get_backend(CPU)
    n = 200_000
    out = backend.allocate_tensor(n * world, dtype=torch.float32, device=CPU)
    grads = backend.allocate_tensor(n * world, dtype=torch.float32, device=CPU)
    got = torch.empty(n)
    summed = torch.ones(n * world)
    assert get_coordinator().share_storage(summed)
    dist.all_gather_into_tensor(out, out.narrow(0, n * rank, n))
    dist.barrier()

    def in_place_ops() -> None:
        dist.all_gather_into_tensor(out, out.narrow(0, n * rank, n))
        dist.reduce_scatter_tensor(got, grads)
        dist.all_reduce(summed)

    return last_rank_dies(rank, world, in_place_ops)


def test_killed_rank_fails_in_place_ops() -> None:
    env = {"GROUPCOMM_SHM_DIRECT": "1", "GROUPCOMM_CPU_COMMUNICATOR": "shm"}
    results = run_ranks(check_killed_rank_in_place, 3, env=env, may_die=(2,), group_timeout=timedelta(seconds=60))
    assert results[:2] == ["raised", "raised"]
    assert shm_segments() == []
