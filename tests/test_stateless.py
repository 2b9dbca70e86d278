"""StatelessProcessGroup on real ranks: the object plane and barriers through
its own store, tensor collectives through its coordinator next to a default
group and to other stateless groups, barrier timeouts, and the RL weight-sync
pattern (a trainer broadcasting a state_dict to an inference fleet)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from _harness import free_port, run_ranks, shm_segments

from torch_groupcomm import stateless
from torch_groupcomm.stateless import StatelessProcessGroup

HOST = "127.0.0.1"


def _ports(n: int) -> list:
    """``n`` distinct free ports."""
    ports: list = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _no_segments_left() -> bool:
    """No segment of ours in /dev/shm, allowing a moment for ones that other
    test runs on this machine create and unlink right away."""
    deadline = time.monotonic() + 3
    while shm_segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not shm_segments()


def _value(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    """A deterministic, integer-valued tensor (sums of a few are exact)."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) % 97 * (seed + 1) + seed).to(dtype)


# -- in-process checks ---------------------------------------------------------------------


def test_create_validates_arguments() -> None:
    port = free_port()
    for kwargs, name in [
        (dict(rank=3, world_size=3), "rank"),
        (dict(rank=-1, world_size=3), "rank"),
        (dict(rank=0, world_size=0), "world_size"),
        (dict(rank=True, world_size=2), "rank"),
        (dict(rank=0, world_size=2.0), "world_size"),
        (dict(rank=0, world_size=1, store_timeout=0), "store_timeout"),
        (dict(rank=0, world_size=1, data_expiration_seconds=-1), "data_expiration_seconds"),
    ]:
        with pytest.raises(ValueError, match=name):
            StatelessProcessGroup.create(HOST, port, **kwargs)
    for bad_port in (0, 65536, "80"):
        with pytest.raises(ValueError, match="port"):
            StatelessProcessGroup.create(HOST, bad_port, 0, 1)


def test_world_of_one() -> None:
    g = StatelessProcessGroup.create(HOST, free_port(), 0, 1, store_timeout=10)
    g.send_obj({"a": 1}, 0)
    g.send_obj([2], dst=0)
    assert g.recv_obj(0) == {"a": 1} and g.recv_obj(src=0) == [2]
    assert g.broadcast_obj("x", src=0) == "x"
    assert g.all_gather_obj(5) == [5]
    g.barrier()
    c = g.coordinator()
    assert c is g.coordinator() and c.world_size == 1 and c.rank_in_group == 0
    x = _value(0, (3, 4))
    assert torch.equal(c.all_reduce(x), x)
    assert torch.equal(c.broadcast(x.clone(), src=0), x)
    with pytest.raises(ValueError, match="dst"):
        g.send_obj(1, 1)
    g.destroy()
    g.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        g.send_obj(1, 0)


# -- 1: the object plane and barriers on three ranks without a default group -------------


def _objects_main(rank: int, world: int, port: int, expiring_port: int) -> str:
    import torch.distributed as dist

    g = StatelessProcessGroup.create(HOST, port, rank, world, store_timeout=60)
    assert not dist.is_initialized()

    # Every rank sends to every rank (itself included) at once, so two ranks
    # send to each rank concurrently; every pair's order is kept.
    for i in range(3):
        for dst in range(world):
            g.send_obj({"src": rank, "dst": dst, "i": i, "pad": b"x" * (1000 * i)}, dst)
    for src in reversed(range(world)):
        for i in range(3):
            assert g.recv_obj(src) == {"src": src, "dst": rank, "i": i, "pad": b"x" * (1000 * i)}

    # Ranks 1 and 2 both send to 0 in a burst; 0 drains 2 first, then 1.
    if rank == 0:
        assert [g.recv_obj(2) for _ in range(5)] == [("two", i) for i in range(5)]
        assert [g.recv_obj(1) for _ in range(5)] == [("one", i) for i in range(5)]
        g.send_obj(torch.arange(6), 1)  # and the other direction
    else:
        for i in range(5):
            g.send_obj(("one" if rank == 1 else "two", i), 0)
        if rank == 1:
            assert torch.equal(g.recv_obj(0), torch.arange(6))

    for rnd in range(2):
        for src in range(world):
            mine = {"src": src, "round": rnd} if rank == src else None
            assert g.broadcast_obj(mine, src=src) == {"src": src, "round": rnd}
    assert g.all_gather_obj((rank, "r" * rank)) == [(r, "r" * r) for r in range(world)]
    assert g.all_gather_obj(None) == [None] * world

    # Barriers: after each, every rank's writes from before it are visible.
    for b in range(4):
        if rank == b % world:
            time.sleep(0.5)
        g.store.set(f"test/mark/{b}/{rank}", str(rank))
        seq = g.barrier_counter
        start = time.monotonic()
        g.barrier(timeout=30)
        if rank != b % world:
            assert time.monotonic() - start > 0.25, "barrier let a rank through before the late one arrived"
        assert g.store.check([f"test/mark/{b}/{r}" for r in range(world)])
        if rank == 0:  # the store host cleans each barrier's keys up
            keys = [
                stateless._BARRIER_KEY.format(seq=seq, phase=p, rank=r)
                for p in stateless._BARRIER_PHASES
                for r in range(world)
            ]
            assert not any(g.store.check([k]) for k in keys)

    # Bad rank arguments.
    for call in (
        lambda: g.send_obj(1, world),
        lambda: g.send_obj(1, -1),
        lambda: g.recv_obj(world),
        lambda: g.broadcast_obj(1, src=world),
        lambda: g.send_obj(1, True),
        lambda: g.recv_obj("0"),
    ):
        with pytest.raises(ValueError):
            call()

    # expire_data: keys older than the expiry are deleted; the default expiry keeps them.
    kept = [key for key, _ in g.entries if key.startswith("obj/bcast/")]
    assert kept
    g.expire_data()
    assert all(g.store.check([key]) for key in kept)

    h = StatelessProcessGroup.create(HOST, expiring_port, rank, world, data_expiration_seconds=0, store_timeout=60)
    assert h.broadcast_obj("meta" if rank == 0 else None, src=0) == "meta"
    h.barrier()  # everyone has read it: from now on rank 0 may expire it
    before = [key for key, _ in h.entries]
    assert len(before) == (1 if rank == 0 else 0) and all(h.store.check([key]) for key in before)
    h.send_obj(("never read", rank), (rank + 1) % world)  # send_obj expires what came before
    assert not any(h.store.check([key]) for key in before)
    h.barrier()
    written = [key for key, _ in h.entries]
    assert len(written) == 1 and written[0].startswith("obj/p2p/")
    assert h.store.check(written), "a barrier must not expire data"
    h.expire_data()
    assert not h.entries and not h.store.check(written)
    h.barrier()
    h.destroy()

    g.barrier()
    g.destroy()
    return "ok"


def test_objects_and_barriers_world3() -> None:
    ports = _ports(2)
    assert run_ranks(_objects_main, 3, backend=None, args=tuple(ports)) == ["ok"] * 3


# -- 2: a default group and two stateless groups side by side -----------------------------


def _three_groups_main(rank: int, world: int, port1: int, port2: int, hierarchical: bool) -> str:
    import torch.distributed as dist

    cpu = torch.device("cpu")
    # G1: processes 0 and 1. G2: all four, ranks reversed.
    g1 = StatelessProcessGroup.create(HOST, port1, rank, 2, store_timeout=60) if rank < 2 else None
    r2 = 3 - rank
    g2 = StatelessProcessGroup.create(HOST, port2, r2, 4, store_timeout=60)

    x = _value(rank, (3, 5))
    dist.all_reduce(x)
    assert torch.equal(x, sum(_value(r, (3, 5)) for r in range(4)))

    c1 = g1.coordinator() if g1 else None
    c2 = g2.coordinator(timeout=timedelta(seconds=60))
    assert g2.coordinator() is c2
    assert (c2.rank_in_group, c2.world_size) == (r2, 4)
    assert c2.communicator_for(cpu).name == ("hierarchical" if hierarchical else "shm")
    if c1:
        assert (c1.rank_in_group, c1.world_size) == (rank, 2)
        assert c1.communicator_for(cpu).name == "shm"

    for step in range(3):
        if c1:
            y = _value(10 * rank + step, (1000,))
            assert torch.equal(c1.all_reduce(y), _value(step, (1000,)) + _value(10 + step, (1000,)))
            assert torch.equal(y, _value(10 * rank + step, (1000,))), "all_reduce must be out of place"
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            # bf16 holds integers exactly only up to 256: keep its sums small.
            bound = 40 if dtype == torch.bfloat16 else 1 << 20
            z = (_value(r2 + step, (4, 33)) % bound).to(dtype)
            expected = sum(_value(r + step, (4, 33), torch.float64) % bound for r in range(4)).to(dtype)
            assert torch.equal(c2.all_reduce(z), expected), dtype
        w = torch.full((7,), float(rank + step))
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        assert torch.equal(w, torch.full((7,), 3.0 + step))
        if c1:
            b = _value(50 + rank, (6, 6))
            assert c1.broadcast(b, src=step % 2) is b
            assert torch.equal(b, _value(50 + step % 2, (6, 6)))
        src2 = (step + 1) % 4
        b2 = _value(7 + r2, (5, 8), torch.int32)
        assert c2.broadcast(b2, src=src2) is b2
        assert torch.equal(b2, _value(7 + src2, (5, 8), torch.int32))
        a = _value(r2 + step, (2, 3))
        for dim in (0, 1, -1):
            expected = torch.cat([_value(r + step, (2, 3)) for r in range(4)], dim=dim)
            assert torch.equal(c2.all_gather(a, dim=dim), expected), dim
        if g1:
            g1.send_obj({"step": step, "from": rank}, 1 - rank)
            assert g1.recv_obj(1 - rank) == {"step": step, "from": 1 - rank}
        assert g2.all_gather_obj((r2, rank, step)) == [(r, 3 - r, step) for r in range(4)]
        assert g2.broadcast_obj(("b", r2) if r2 == step else None, src=step) == ("b", step)
        t = torch.tensor([float(rank), 2.0 * rank])
        dist.broadcast(t, src=3 - step)
        assert torch.equal(t, torch.tensor([3.0 - step, 2.0 * (3 - step)]))

    # Tensor send/recv inside G2, in pairs of G2 ranks (0,1) and (2,3), both ways.
    peer = r2 ^ 1
    for order in (0, 1):
        if (r2 % 2) == order:
            c2.send(_value(100 + r2, (9,), torch.float64), dst=peer)
        else:
            got = c2.recv(torch.Size([9]), torch.float64, src=peer)
            assert torch.equal(got, _value(100 + peer, (9,), torch.float64))

    if g1:
        c1.barrier()
        g1.barrier()
    c2.barrier()
    g2.barrier()
    dist.barrier()
    if g1:
        g1.destroy()
    g2.destroy()
    assert g2.store is None
    assert _no_segments_left(), shm_segments()
    # The default group is untouched by their destruction.
    v = torch.ones(4) * rank
    dist.all_reduce(v)
    assert torch.equal(v, torch.full((4,), 6.0))
    return "ok"


@pytest.mark.parametrize("hierarchical", [False, True], ids=["one-host", "hosts-aabb"])
def test_default_group_and_two_stateless_groups(hierarchical: bool) -> None:
    env = {"GROUPCOMM_HOST_ID": ["a", "a", "b", "b"]} if hierarchical else {}
    ports = _ports(2)
    results = run_ranks(_three_groups_main, 4, backend="groupcomm", env=env, args=(*ports, hierarchical))
    assert results == ["ok"] * 4
    assert _no_segments_left(), shm_segments()


# -- 3: a barrier one rank never reaches -----------------------------------------------------


def _barrier_timeout_main(rank: int, world: int, port: int) -> str:
    g = StatelessProcessGroup.create(HOST, port, rank, world, store_timeout=60)
    g.barrier()
    if rank == 2:
        time.sleep(0.5)  # and never calls the second barrier
    else:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"phase 'arrived'.*ranks \[2\] missing"):
            g.barrier(timeout=2)
        elapsed = time.monotonic() - start
        assert 1.9 <= elapsed < 10, elapsed
    # Keep the store host (rank 0) alive until the others are done with the store.
    if rank == 0:
        assert [g.recv_obj(1), g.recv_obj(2)] == ["done", "done"]
    else:
        g.send_obj("done", 0)
    return "ok"


def test_barrier_times_out_naming_missing_rank() -> None:
    assert run_ranks(_barrier_timeout_main, 3, backend=None, args=(free_port(),)) == ["ok"] * 3


# -- 4: RL weight sync: a trainer broadcasts its weights to an inference fleet -------------------


def _make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def _train_step(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    inputs, targets = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def _weight_sync_main(rank: int, world: int, sync_port: int, fleet_port: int) -> str:
    trainer_seed, probe = 0, torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    if rank == 0:
        model = _make_model(trainer_seed)
    else:
        model = _make_model(1234 + rank)  # the fleet starts from other weights
        fleet = StatelessProcessGroup.create(HOST, fleet_port, rank - 1, 2, store_timeout=60)
        fleet_c = fleet.coordinator()
    sync = StatelessProcessGroup.create(HOST, sync_port, rank, world, store_timeout=60)
    c = sync.coordinator()

    expected = _make_model(trainer_seed) if rank else None
    for version in range(3):
        if version:
            if rank == 0:
                _train_step(model, version)
            else:
                _train_step(expected, version)
        names = sync.broadcast_obj(
            [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()] if rank == 0 else None, src=0
        )
        state = model.state_dict()
        assert [(n, tuple(t.shape), t.dtype) for n, t in state.items()] == names
        for name, _, _ in names:
            c.broadcast(state[name], src=0)  # in place, into the live parameters
        if rank:
            for name, tensor in expected.state_dict().items():
                assert torch.equal(model.state_dict()[name], tensor), (version, name)
            # The fleet's own group keeps working next to the sync group.
            model.eval()
            out = model(probe)
            both = fleet_c.all_gather(out.detach(), dim=0)
            assert torch.equal(both, torch.cat([out.detach(), out.detach()]))
        model.eval()
        outs = sync.all_gather_obj(model(probe).detach())
        assert all(torch.equal(o, outs[0]) for o in outs), version
    sync.barrier()
    sync.destroy()
    if rank:
        fleet.barrier()
        fleet.destroy()
    return "ok"


def test_weight_sync_trainer_to_fleet() -> None:
    ports = _ports(2)
    assert run_ranks(_weight_sync_main, 3, backend=None, args=tuple(ports)) == ["ok"] * 3
