"""The vLLM-style GroupCoordinator API on real ranks: tensor-parallel and
pipeline-parallel groups formed by the coordinator, objects, tensor dicts
(with the all-gather slicing), the message-queue broadcaster, and the
coordinator behind a plain c10d group."""

from __future__ import annotations

import pytest
import torch
from _harness import run_ranks, shm_segments


def _value(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (rank + 1) + rank).to(dtype)


def _check_tensor_ops(g, members) -> None:
    """Out-of-place collectives of coordinator ``g`` whose global ranks are ``members``."""
    me, world = g.rank_in_group, g.world_size
    x = _value(g.rank, (4, 6))
    assert torch.equal(g.all_reduce(x), sum(_value(r, (4, 6)) for r in members))
    assert torch.equal(x, _value(g.rank, (4, 6))), "all_reduce must be out of place"
    for dim in (0, 1, -1):
        expected = torch.cat([_value(r, (4, 6)) for r in members], dim=dim)
        assert torch.equal(g.all_gather(x, dim=dim), expected), dim
    rows = [i + 1 for i in range(world)]
    mine = _value(g.rank, (rows[me], 3))
    expected = torch.cat([_value(r, (rows[i], 3)) for i, r in enumerate(members)], dim=0)
    assert torch.equal(g.all_gatherv(mine, dim=0, sizes=rows), expected)
    both = g.all_gatherv([mine, mine * 2], dim=0, sizes=rows)
    assert torch.equal(both[0], expected) and torch.equal(both[1], expected * 2)
    y = _value(g.rank, (2, 4 * world))
    total = sum(_value(r, (2, 4 * world)) for r in members)
    assert torch.equal(g.reduce_scatter(y, dim=-1), total.chunk(world, dim=1)[me])
    z = _value(g.rank, (3 * world - 1, 2))
    total = sum(_value(r, (3 * world - 1, 2)) for r in members)
    sizes = [3 * world - 1 - (world - 1)] + [1] * (world - 1)
    assert torch.equal(g.reduce_scatterv(z, dim=0, sizes=sizes), total.split(sizes, dim=0)[me])
    for dst in range(world):
        got = g.gather(x, dst=dst, dim=1)
        if me == dst:
            assert torch.equal(got, torch.cat([_value(r, (4, 6)) for r in members], dim=1))
        else:
            assert got is None
    for src in range(world):
        b = _value(g.rank, (3, 5)).t()  # not contiguous: still filled in place
        out = g.broadcast(b, src=src)
        assert out is b and torch.equal(b, _value(members[src], (3, 5)).t())
    # ring send/recv between neighbours, default ranks
    if world > 1:
        if me % 2 == 0:
            g.send(_value(g.rank, (5,), torch.int64))
            got = g.recv(torch.Size([5]), torch.int64)
        else:
            got = g.recv(torch.Size([5]), torch.int64)
            g.send(_value(g.rank, (5,), torch.int64))
        assert torch.equal(got, _value(g.prev_rank, (5,), torch.int64))
    g.barrier()


def _check_objects(g, members) -> None:
    me, world = g.rank_in_group, g.world_size
    for src in range(world):
        obj = {"from": members[src], "payload": list(range(src + 3))} if me == src else None
        assert g.broadcast_object(obj, src=src) == {"from": members[src], "payload": list(range(src + 3))}
        lst = [f"r{members[src]}", src, None] if me == src else [None, None, None]
        assert g.broadcast_object_list(lst, src=src) == [f"r{members[src]}", src, None]
    big = "x" * (3 << 20) + str(g.rank)
    assert g.all_gather_object(big) == ["x" * (3 << 20) + str(r) for r in members]
    if world > 1:
        nxt, prv = (me + 1) % world, (me - 1) % world
        if me % 2 == 0:
            g.send_object({"to": nxt, "data": b"\0" * 70000}, dst=nxt)
            got = g.recv_object(src=prv)
        else:
            got = g.recv_object(src=prv)
            g.send_object({"to": nxt, "data": b"\0" * 70000}, dst=nxt)
        assert got == {"to": me, "data": b"\0" * 70000}


def _check_tensor_dict(g, members) -> None:
    me = g.rank_in_group
    for src in range(g.world_size):
        d = None
        if me == src:
            d = {
                "a": _value(members[src], (3, 4)),
                "ids": torch.arange(7, dtype=torch.int32) + src,
                "half": _value(members[src], (5,), torch.bfloat16),
                "empty": torch.empty(0, 3),
                "note": f"step {src}",
                "n": src,
                "nothing": None,
            }
        got = g.broadcast_tensor_dict(d, src=src)
        assert set(got) == {"a", "ids", "half", "empty", "note", "n", "nothing"}
        assert torch.equal(got["a"], _value(members[src], (3, 4)))
        assert torch.equal(got["ids"], torch.arange(7, dtype=torch.int32) + src)
        assert got["half"].dtype == torch.bfloat16 and torch.equal(
            got["half"], _value(members[src], (5,), torch.bfloat16)
        )
        assert got["empty"].shape == (0, 3)
        assert got["note"] == f"step {src}" and got["n"] == src and got["nothing"] is None
    assert g.broadcast_tensor_dict({} if me == 0 else None, src=0) == {}


def _coordinator_main(rank: int, world: int) -> str:
    import torch.distributed as dist

    import torch_groupcomm
    from torch_groupcomm.coordinator import GroupCoordinator

    tp = GroupCoordinator([[0, 1], [2, 3]], rank, "groupcomm", True, group_name="tp")
    pp = GroupCoordinator([[0, 2], [1, 3]], rank, "groupcomm", True, group_name="pp")
    everyone = GroupCoordinator(
        [[0, 1, 2, 3]], rank, "groupcomm", True, use_message_queue_broadcaster=True, group_name="world"
    )
    assert shm_segments() == [], shm_segments()

    # rank bookkeeping
    assert tp.ranks == [rank - rank % 2, rank - rank % 2 + 1] and tp.rank_in_group == rank % 2 and tp.world_size == 2
    assert pp.ranks == [rank % 2, rank % 2 + 2] and pp.rank_in_group == rank // 2
    assert (tp.first_rank, tp.last_rank) == (tp.ranks[0], tp.ranks[1])
    assert tp.is_first_rank == (rank % 2 == 0) and tp.is_last_rank == (rank % 2 == 1)
    assert everyone.next_rank == (rank + 1) % 4 and everyone.prev_rank == (rank - 1) % 4
    assert tp.unique_name.startswith("tp:") and tp.device_group is not None and tp.cpu_group is not None
    assert everyone.mq_broadcaster is not None and tp.mq_broadcaster is None

    for g in (tp, pp, everyone):
        _check_tensor_ops(g, g.ranks)
        _check_objects(g, g.ranks)
        _check_tensor_dict(g, g.ranks)

    # pipeline hand-off: stage 0 (ranks 0, 1) sends to stage 1 (ranks 2, 3); each
    # tensor-parallel rank sends only its slice of tensors that split evenly
    full = {"h": _value(7, (4, 6)), "odd": _value(8, (5,)), "keep": _value(9, (2, 2)), "tag": "mb0"}
    if pp.rank_in_group == 0:
        assert pp.send_tensor_dict(full, all_gather_group=tp, all_gather_tensors={"keep": False}) is None
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors={"keep": False})
        assert set(got) == set(full) and got["tag"] == "mb0"
        for key in ("h", "odd", "keep"):
            assert torch.equal(got[key], full[key]), key
    if pp.rank_in_group == 1:
        pp.send_tensor_dict({"back": torch.full((3,), float(rank))}, dst=0)
    else:
        assert torch.equal(pp.recv_tensor_dict(src=1)["back"], torch.full((3,), float(rank + 2)))

    # broadcast_object on a coordinator with a message queue goes through it
    for step in range(50):
        got = everyone.broadcast_object({"step": step, "ids": [step] * 3} if rank == 0 else None)
        assert got == {"step": step, "ids": [step] * 3}
    big = b"y" * (5 << 20) + bytes([rank])  # more than one 4 MiB chunk of the queue
    assert everyone.broadcast_object(big if rank == 0 else None) == b"y" * (5 << 20) + b"\0"

    # a queue written by another rank, and one joined through an external handle
    mq = everyone.create_mq_broadcaster(writer_rank=2)
    for step in range(5):
        assert mq.broadcast_object(("from 2", step) if rank == 2 else None) == ("from 2", step)
    mq.close()
    from torch_groupcomm import MessageQueue

    external = MessageQueue(3, 3, [1, 2, 3]) if rank == 0 else None
    handle = everyone.broadcast_object(external.export_handle() if rank == 0 else None)
    if rank != 0:
        external = everyone.create_mq_broadcaster(external_writer_handle=handle)
    external.wait_until_ready()
    assert external.broadcast_object("external" if rank == 0 else None) == "external"
    external.close()

    writer, readers = everyone.create_single_reader_mq_broadcasters(reader_rank_in_group=0)
    writer.enqueue(("hello from", rank))
    if rank == 0:
        heard = sorted(q.dequeue(timeout=30) for q in readers if q is not None)
        assert ("hello from", 1) in heard and ("hello from", 3) in heard, heard
    else:
        assert readers == []
    everyone.barrier()

    # hooks that are identities on the CPU
    with everyone.graph_capture() as ctx:
        assert ctx.stream is None
    h, logits = torch.ones(2, 3), torch.zeros(2, 4)
    assert everyone.dispatch(h, logits) == (h, logits) and everyone.combine(h) is h
    everyone.prepare_communication_buffer_for_model(torch.nn.Linear(2, 2))

    # bad arguments name what was wrong
    for call, fragment in [
        (lambda: tp.broadcast(torch.ones(2), src=2), "broadcast src 2"),
        (lambda: tp.all_gather(torch.ones(2), dim=1), "dim 1 is out of range"),
        (lambda: tp.all_gatherv(torch.ones(2), sizes=[1, 2, 3]), "3 sizes for 2 ranks"),
        (lambda: tp.send_object("x", dst=tp.rank_in_group), "own rank"),
        (lambda: tp.gather(torch.ones(2), dst=-1), "gather dst -1"),
        (lambda: tp.broadcast_tensor_dict([1, 2], src=tp.rank_in_group), "expected a dict"),
    ]:
        with pytest.raises((ValueError, TypeError), match=fragment):
            call()

    # the coordinator behind the default c10d group offers the same API
    default = torch_groupcomm.get_coordinator(dist.group.WORLD)
    assert default.world_size == 4 and default.device_group is None
    _check_tensor_ops(default, [0, 1, 2, 3])
    _check_objects(default, [0, 1, 2, 3])
    _check_tensor_dict(default, [0, 1, 2, 3])
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)  # c10d traffic interleaved with coordinator calls
    assert torch.equal(t, torch.full((3,), 6.0))

    for g in (tp, pp, everyone):
        g.destroy()
        g.destroy()  # idempotent
    assert shm_segments() == [], shm_segments()
    return "ok"


@pytest.mark.parametrize("hosts", [None, ["a", "a", "b", "b"]], ids=["one-host", "hosts-aabb"])
def test_coordinator_api_world4(hosts) -> None:
    # on two simulated hosts the groups go hierarchical and the message queue
    # serves ranks 2 and 3 over TCP
    env = {"GROUPCOMM_HOST_ID": hosts} if hosts else {}
    assert run_ranks(_coordinator_main, 4, env=env) == ["ok"] * 4


def _gloo_main(rank: int, world: int) -> str:
    from torch_groupcomm.coordinator import GroupCoordinator

    plain = GroupCoordinator([list(range(world))], rank, "gloo", use_device_communicator=False, group_name="plain")
    assert plain.device_communicator.name == "gloo"
    _check_tensor_ops(plain, plain.ranks)
    _check_objects(plain, plain.ranks)
    _check_tensor_dict(plain, plain.ranks)
    solo = GroupCoordinator([[r] for r in range(world)], rank, "groupcomm", True, group_name="solo")
    x = torch.ones(3)
    assert solo.world_size == 1 and solo.all_reduce(x) is x and solo.broadcast_object("o") == "o"
    assert solo.all_gather(x) is x and solo.broadcast_tensor_dict({"x": x}) == {"x": x}
    assert solo.create_single_reader_mq_broadcasters() == (None, [])
    plain.destroy()
    solo.destroy()
    return "ok"


def test_coordinator_on_gloo_and_groups_of_one() -> None:
    assert run_ranks(_gloo_main, 3, backend="gloo") == ["ok"] * 3
