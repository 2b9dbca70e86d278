"""Subgroups, device meshes, per-device routing, and teardown."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from _harness import run_ranks


def _groupcomm_threads() -> list:
    return [t.name for t in threading.enumerate() if t.name.startswith("groupcomm-")]


def check_subgroups(rank: int, world: int) -> None:
    import torch_groupcomm
    from torch_groupcomm import _registry

    assert dist.group.WORLD.name() == "custom", dist.group.WORLD.name()
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    assert dist.get_backend(mine) == "groupcomm"
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mine, async_op=True).wait()
    assert torch.equal(t, torch.full((3,), float(2 + 2 * (rank % 2)))), t
    coordinator = torch_groupcomm.get_coordinator(mine)
    assert coordinator.world_size == 2 and coordinator.ranks == [rank % 2, rank % 2 + 2]
    # broadcast from a global rank inside a subgroup
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=rank % 2 + 2, group=mine)
    assert torch.equal(t, torch.full((2,), float(rank % 2 + 2)))
    # p2p inside a subgroup uses global ranks
    peer = rank ^ 2
    got = torch.empty(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), peer, mine), dist.P2POp(dist.irecv, got, peer, mine)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got.item() == peer
    sub, subgroups = dist.new_subgroups(group_size=2)
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    assert t.item() == 2 and len(subgroups) == 2
    enum_sub, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=enum_sub)
    assert t.item() == (3 if rank in (0, 3) else 2)
    # a gloo subgroup next to groupcomm ones
    gloo = dist.new_group([0, 1, 2, 3], backend="gloo")
    t = torch.ones(2)
    dist.all_reduce(t, group=gloo)
    assert torch.equal(t, torch.full((2,), 4.0))
    # DeviceMesh and DTensor over groupcomm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert dist.get_backend(mesh["tp"].get_group()) == "groupcomm"
    full = torch.arange(24.0).view(4, 6)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert dt.to_local().shape == (2, 3)
    assert torch.equal(dt.full_tensor(), full)
    assert torch.equal(dt.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full)
    summed = dt.sum()
    assert summed.full_tensor().item() == full.sum().item()
    # destroying everything frees every coordinator and worker thread
    names = set(_registry._coordinators)
    assert len(names) >= 6, names
    dist.destroy_process_group()
    assert _registry._coordinators == {}, _registry._coordinators
    assert _groupcomm_threads() == [], _groupcomm_threads()


def test_subgroups_mesh_and_teardown() -> None:
    run_ranks(check_subgroups, 4)


def _split(parent, split_ranks, **kwargs):
    """split_group's group, or the RuntimeError torch or the backend raised."""
    try:
        return dist.split_group(parent, split_ranks=split_ranks, **kwargs)
    except RuntimeError as exc:
        return exc


def check_split_group(rank: int, world: int) -> None:
    from datetime import timedelta

    import torch_groupcomm

    gloo = dist.new_group(backend="gloo")
    reference = _split(gloo, [[0, 2], [1, 3]])
    ours = _split(dist.group.WORLD, [[0, 2], [1, 3]])
    if isinstance(reference, RuntimeError):
        # torch 2.13-2.14 refuse a split on a CPU-only machine before asking any backend
        assert isinstance(ours, RuntimeError) and str(ours) == str(reference), (ours, reference)
        return
    assert not isinstance(ours, RuntimeError), ours
    assert dist.get_backend(ours) == "groupcomm"
    assert dist.get_process_group_ranks(ours) == [rank % 2, rank % 2 + 2]
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=ours)
    assert torch.equal(t, torch.full((3,), float(2 + 2 * (rank % 2)))), t
    # the order of a split's ranks is kept: the first listed is its rank 0, whatever its global rank
    ordered = _split(dist.group.WORLD, [[3, 1, 0], [2]], timeout=timedelta(seconds=17))
    members = [3, 1, 0] if rank != 2 else [2]
    assert dist.get_process_group_ranks(ordered) == members
    assert dist.get_rank(ordered) == members.index(rank)
    coordinator = torch_groupcomm.get_coordinator(ordered)
    assert coordinator.timeout == timedelta(seconds=17) and coordinator.ranks == members
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group_src=0, group=ordered)
    assert t.item() == members[0]
    outs = [torch.empty(2) for _ in members]
    dist.all_gather(outs, torch.full((2,), float(rank)), group=ordered)
    assert [o[0].item() for o in outs] == members
    if len(members) > 1:  # send/recv in the split group, by group rank
        me = members.index(rank)
        got = torch.empty(1)
        ops = [
            dist.P2POp(dist.isend, torch.tensor([float(rank)]), group_peer=(me + 1) % len(members), group=ordered),
            dist.P2POp(dist.irecv, got, group_peer=(me - 1) % len(members), group=ordered),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert got.item() == members[(me - 1) % len(members)]
    # a rank outside every split gets no group; a split group splits again
    partial = _split(dist.group.WORLD, [[0, 1]])
    assert (partial == dist.GroupMember.NON_GROUP_MEMBER) == (rank > 1), partial
    if rank in (3, 1):
        again = _split(ordered, [[1, 0]])  # group ranks of `ordered`: global 1 and 3
        assert dist.get_process_group_ranks(again) == [1, 3]
        t = torch.ones(4) * (rank + 1)
        dist.all_reduce(t, group=again)
        assert torch.equal(t, torch.full((4,), 6.0)), t
    elif rank == 0:
        assert _split(ordered, [[1, 0]]) == dist.GroupMember.NON_GROUP_MEMBER
    dist.barrier()
    # the split groups go with the rest
    from torch_groupcomm import _registry

    dist.destroy_process_group()
    assert _registry._coordinators == {}, _registry._coordinators
    assert _groupcomm_threads() == [], _groupcomm_threads()


def test_split_group_where_gloo_splits() -> None:
    run_ranks(check_split_group, 4)


def check_destroy_one_group(rank: int, world: int) -> None:
    from torch_groupcomm import _registry

    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=sub, async_op=True).wait()
    name = sub.group_name
    assert name in _registry._coordinators
    dist.destroy_process_group(sub)
    assert name not in _registry._coordinators
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


def test_destroy_one_group() -> None:
    run_ranks(check_destroy_one_group, 2)


def check_mixed_routing(rank: int, world: int) -> None:
    import torch_groupcomm

    pg = dist.group.WORLD
    assert pg.name() != "undefined"
    assert isinstance(pg._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(world)))))
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    # the coordinator of the CUDA side exists but never saw a CPU tensor
    coordinator = torch_groupcomm.get_coordinator(pg)
    assert coordinator._communicators == {}, coordinator._communicators
    # CPU PREMUL_SUM goes to gloo, which refuses it (we would have accepted it)
    try:
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    except (RuntimeError, ValueError) as exc:
        assert "groupcomm" not in str(exc), str(exc)
    else:
        raise AssertionError("PREMUL_SUM on CPU reached something other than gloo")


def test_mixed_mode_routes_cpu_to_gloo() -> None:
    run_ranks(check_mixed_routing, 2, backend="cpu:gloo,cuda:groupcomm")


def check_cpu_only_mode(rank: int, world: int) -> None:
    pg = dist.group.WORLD
    assert pg.name() == "custom", pg.name()
    assert type(pg._get_backend(torch.device("cpu"))).__name__ == "GroupCommBackend"
    t = torch.ones(3, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    assert torch.equal(t, torch.full((3,), world % 2, dtype=torch.int32))


def test_cpu_groupcomm_sets_default_backend() -> None:
    run_ranks(check_cpu_only_mode, 2, backend="cpu:groupcomm")
