"""torch's fault-tolerance API (2.14 and 2.15), ``dist._reconfigure``: a group made with
``enable_reconfigure=True`` has no members until the processes whose handles
the peers exchanged form it; it is formed again with other orders, split in
two after a rank "fails", and grown back, each generation checked with real
collectives, on groupcomm exactly as on gloo (which implements it in torch
2.14 and 2.15). Then what only groupcomm promises: an op in flight fails when its
generation is replaced, a reused uuid fails on every member, bad handles
raise ValueError, and the re-formed group's CPU ops run natively again.
A reconfigure that fails part-way names itself in every later op's error
and a fresh uuid forms the group. Nothing is left in /dev/shm. torch < 2.14
has no such API."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import CPU_PATHS, NO_FR_DUMP, frontend_calls, last_rank_dies, run_ranks, shm_segments

pytestmark = pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch < 2.14 has no dist._reconfigure")

WORLD = 3
# gloo itself, then groupcomm on each CPU path of three ranks (each generation builds its communicator anew)
BACKENDS = [("gloo", {})] + [(backend, env) for _, backend, world, env, _ in CPU_PATHS if world == WORLD]
IDS = ["gloo"] + [name for name, _, world, _, _ in CPU_PATHS if world == WORLD]


def _exchange(key: str, value: str, among: list[int], me: int) -> list[str]:
    """Out of band, as a fault-tolerance manager would: every process in
    ``among`` (original ranks) publishes ``value``; all of them, in that order."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{me}", value)
    return [store.get(f"{key}/{r}").decode() for r in among]


def _generation(me: int) -> dict[str, object]:
    """Collectives on the current generation: who is where, and their sums."""
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([float(me)])
    gathered = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(gathered, mine)
    total = torch.tensor([me + 1.0, 2.0 * me])
    dist.all_reduce(total)
    root = mine.clone()
    dist.broadcast(root, 0)
    dist.barrier()
    return {
        "rank": rank,
        "size": size,
        "gathered": [int(t.item()) for t in gathered],
        "sum": total.tolist(),
        "root": int(root.item()),
    }


def _form(uuid: int, among: list[int], me: int, ordered: bool = True, key: str = "") -> None:
    handles = _exchange(key or f"handles/{uuid}", dist._get_reconfigure_handle(), among, me)
    work = dist._reconfigure(uuid, handles if ordered else set(handles))
    assert work.wait() and work.is_completed()


def check_generations(me: int, world: int, backend: str) -> dict[str, object]:
    if backend == "groupcomm":
        import torch_groupcomm  # noqa: F401
    dist.init_process_group(backend, timeout=timedelta(seconds=60), enable_reconfigure=True)
    report: dict[str, object] = {"supports": dist._supports_reconfigure()}
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as exc:
        assert "reconfigure" in str(exc), str(exc)
        report["before"] = "RuntimeError"
    everyone = list(range(world))

    _form(1, everyone[::-1], me)  # ranks reversed
    report["reversed"] = _generation(me)

    _form(2, everyone, me, ordered=False)  # the backend picks the order, every member alike
    unordered = _generation(me)
    assert sorted(unordered["gathered"]) == everyone and unordered["gathered"][unordered["rank"]] == me, unordered
    report["set"] = unordered["size"]

    # the last rank "fails": the others go on without it, it goes on alone
    survivors = everyone[:-1]
    if me in survivors:
        _form(3, survivors, me)
    else:
        _form(4, [me], me)
    report["split"] = _generation(me)

    _form(5, everyone, me)  # and it comes back
    report["healed"] = _generation(me)
    dist.destroy_process_group()
    return report


@pytest.mark.parametrize("backend,env", BACKENDS, ids=IDS)
def test_generations_as_on_gloo(backend: str, env: dict[str, object]) -> None:
    """Both backends through the same generations give the same ranks and values."""
    before = shm_segments()
    reports = run_ranks(check_generations, WORLD, backend=None, args=(backend,), env=env)
    assert shm_segments() == before
    expected = [
        {
            "supports": True,
            "before": "RuntimeError",
            "reversed": {"rank": WORLD - 1 - me, "size": WORLD, "gathered": [2, 1, 0], "sum": [6.0, 6.0], "root": 2},
            "set": WORLD,
            "split": (
                {"rank": me, "size": 2, "gathered": [0, 1], "sum": [3.0, 2.0], "root": 0}
                if me < WORLD - 1
                else {"rank": 0, "size": 1, "gathered": [me], "sum": [me + 1.0, 2.0 * me], "root": me}
            ),
            "healed": {"rank": me, "size": WORLD, "gathered": [0, 1, 2], "sum": [6.0, 6.0], "root": 0},
        }
        for me in range(WORLD)
    ]
    assert reports == expected


def _sum(me: int) -> float:
    t = torch.tensor([me + 1.0])
    dist.all_reduce(t)
    return t.item()


def _ring(me: int) -> float:
    """What this rank hears from its left neighbour in the current generation."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out, got = torch.tensor([float(me)]), torch.zeros(1)
    works = [dist.isend(out, (rank + 1) % size), dist.irecv(got, (rank - 1) % size)]
    for work in works:
        work.wait()
    return got.item()


def check_recoveries(me: int, world: int, backend: str) -> dict[str, object]:
    """The recoveries a fault-tolerance manager counts on: ranks that were
    never formed joining one that was, the same members again, after an
    abort, after a timed-out op, and a reused uuid on a group of one."""
    if backend == "groupcomm":
        import torch_groupcomm  # noqa: F401
    dist.init_process_group(backend, timeout=timedelta(seconds=60), enable_reconfigure=True)
    group = dist.group.WORLD
    impl = group._get_backend(torch.device("cpu"))
    everyone = list(range(world))
    report: dict[str, object] = {}
    if me == 0:
        _form(1, [me], me)
    _form(2, everyone, me)
    report["late join"] = _sum(me)
    _form(3, everyone, me)
    report["identity"] = _sum(me)
    report["ring"] = _ring(me)  # a rank may abort while its neighbour still reads

    impl.abort()
    report["error after abort"] = str(impl.get_error())
    _form(4, everyone, me)
    report["after abort"] = _sum(me)

    group.set_timeout(timedelta(milliseconds=300))
    if me == 1:  # alone in an all_reduce
        try:
            dist.all_reduce(torch.ones(4), async_op=True).wait()
        except RuntimeError as exc:
            report["timed out"] = "timed out" in str(exc).lower()
    group.set_timeout(timedelta(seconds=60))
    _exchange("timeout seen", "1", everyone, me)
    _form(5, everyone, me)
    report["after timeout"] = _sum(me)
    report["ring again"] = _ring(me)

    # a reconfigure that times out (rank 1 never comes) leaves the others free to try again
    if me == 0:
        handles = _exchange("retry", dist._get_reconfigure_handle(), everyone, me)[:2]
        try:
            dist._reconfigure(6, handles, timeout=timedelta(seconds=1)).wait()
        except RuntimeError as exc:
            report["gave up"] = type(exc).__name__
    else:
        _exchange("retry", dist._get_reconfigure_handle(), everyone, me)
    _exchange("gave up", "1", everyone, me)
    _form(7, everyone, me)
    report["retried"] = _sum(me)

    _form(10 + me, [me], me)
    try:
        _form(10 + me, [me], me, key=f"again/{me}")
    except RuntimeError as exc:
        report["reused alone"] = "already used" in str(exc)
    report["alone"] = (dist.get_rank(), dist.get_world_size(), _sum(me))
    # the store's host, rank 0, leaves last: the others use the store no more once done
    store = dist.distributed_c10d._get_default_store()
    store.set(f"done/{me}", "1")
    if me == 0:
        store.wait([f"done/{r}" for r in everyone])
    dist.destroy_process_group()
    return report


@pytest.mark.parametrize("backend,env", BACKENDS, ids=IDS)
def test_recoveries_as_on_gloo(backend: str, env: dict[str, object]) -> None:
    before = shm_segments()
    reports = run_ranks(check_recoveries, WORLD, backend=None, args=(backend,), env={**env, **NO_FR_DUMP})
    assert shm_segments() == before
    expected = [
        {
            "late join": 6.0,
            "identity": 6.0,
            "ring": float((me - 1) % WORLD),
            "error after abort": "ErrorType.SUCCESS",
            "after abort": 6.0,
            "after timeout": 6.0,
            "ring again": float((me - 1) % WORLD),
            "reused alone": True,
            "alone": (0, 1, me + 1.0),
            "retried": 6.0,
            **({"timed out": True} if me == 1 else {}),
            **({"gave up": "DistStoreError"} if me == 0 else {}),
        }
        for me in range(WORLD)
    ]
    assert reports == expected


def _ddp_in_step(me: int) -> bool:
    """A few DDP steps on the re-formed default group, each rank on its own
    data: whether every rank ends with the same parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(me)  # DDP starts every rank from rank 0's parameters
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + me))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(c, flat) for c in copies)


def check_groupcomm_promises(me: int, world: int) -> dict[str, object]:
    from torch_groupcomm import GroupCommError, get_coordinator

    dist.init_process_group("groupcomm", timeout=timedelta(seconds=60), enable_reconfigure=True)
    report: dict[str, object] = {}
    handle = dist._get_reconfigure_handle()
    report["handle"] = handle.split(":")[:4]  # groupcomm, global rank, rank, generation
    everyone = list(range(world))
    try:
        dist.barrier()
    except RuntimeError as exc:
        report["unformed"] = "enable_reconfigure=True" in str(exc) and "_reconfigure" in str(exc)

    # bad arguments: ValueError, and the group is as it was
    others = _exchange("others", handle, everyone, me)
    bad = {
        "empty": [],
        "not a handle": ["gloo:0:0:-1:127.0.0.1:1"],
        "without me": [h for h in others if h != handle],
        "twice": [handle, handle],
    }
    for what, handles in bad.items():
        try:
            dist._reconfigure(90 + me, handles)
        except ValueError as exc:
            report[what] = str(exc).startswith("groupcomm: reconfigure")
    _form(1, everyone, me)

    # the re-formed group's plain CPU ops run in C++ again
    t = torch.full((1000,), float(me))
    with frontend_calls(["allreduce", "allgather", "_allgather_base"]) as entered:
        for _ in range(3):
            dist.all_reduce(t)
    report["native"] = entered == []
    report["sum"] = t[0].item()

    # an op in flight fails when its generation is replaced (the last rank never joins it)
    survivors = everyone[:-1]
    if me in survivors:
        work = dist.all_reduce(torch.ones(4), async_op=True)
        _form(2, survivors, me)
        try:
            work.wait()
            report["in flight"] = "completed"
        except GroupCommError:
            report["in flight"] = "failed"
        # a reused uuid fails on every member, before anything is torn down
        try:
            _form(2, survivors, me, key="handles/2/again")
        except RuntimeError as exc:
            report["reused"] = "already used" in str(exc)
        x = torch.ones(3)
        dist.all_reduce(x)
        report["after reuse"] = x.tolist()
    else:
        _form(3, [me], me)
    _form(4, everyone, me)
    y = torch.tensor([float(me)])
    dist.all_reduce(y)
    report["healed"] = y.item()
    report["ddp"] = _ddp_in_step(me)

    # a reconfigure that fails part-way (the last rank's settings are bad, found
    # once the group connected) fails within its own timeout, every later op
    # names it, and a fresh uuid forms the group
    if me == world - 1:
        os.environ["GROUPCOMM_SHM_CHUNK_BYTES"] = "not a number"
    handles = _exchange("handles/5", dist._get_reconfigure_handle(), everyone, me)
    started = time.monotonic()
    try:
        dist._reconfigure(5, handles, timeout=timedelta(seconds=2)).wait()
    except Exception as exc:
        report["failed"] = type(exc).__name__
    report["within its timeout"] = time.monotonic() - started < 10  # the group's is 60 s
    os.environ.pop("GROUPCOMM_SHM_CHUNK_BYTES", None)
    try:
        dist.all_reduce(torch.ones(1))
    except GroupCommError as exc:
        report["op names it"] = "dist._reconfigure (uuid 5), which failed" in str(exc)
    _exchange("fixed", "1", everyone, me)
    _form(6, everyone, me)
    z = torch.ones(1)
    dist.all_reduce(z)
    report["retried"] = z.item()
    report["communicator"] = get_coordinator().built_communicator("cpu").name
    dist.destroy_process_group()
    return report


def test_groupcomm_promises() -> None:
    before = shm_segments()
    reports = run_ranks(check_groupcomm_promises, WORLD, backend=None)
    assert shm_segments() == before
    for me, report in enumerate(reports):
        common = {
            "handle": ["groupcomm", str(me), str(me), "-1"],
            "unformed": True,
            "empty": True,
            "not a handle": True,
            "without me": True,
            "twice": True,
            "native": True,
            "sum": 27.0,
            "healed": 3.0,
            "ddp": True,
            "communicator": "shm",  # sum: 0+1+2, tripled twice
            "failed": "ValueError" if me == WORLD - 1 else "DistStoreError",
            "within its timeout": True,
            "op names it": True,
            "retried": 3.0,
        }
        if me < WORLD - 1:
            common.update({"in flight": "failed", "reused": True, "after reuse": [2.0] * 3})
        assert report == common, (me, report)


def check_after_a_death(me: int, world: int) -> dict[str, object]:
    import torch_groupcomm  # noqa: F401

    dist.init_process_group("groupcomm", timeout=timedelta(seconds=60), enable_reconfigure=True)
    everyone = list(range(world))
    _form(1, everyone, me)
    report = {"seen": last_rank_dies(me, world, lambda: dist.all_reduce(torch.ones(1000)))}
    _form(2, everyone[:-1], me)  # the survivors, as a fault-tolerance manager would decide
    report["after"] = _generation(me)
    report["ddp"] = _ddp_in_step(me)
    dist.destroy_process_group()
    return report


def test_survivors_form_a_group_after_a_death() -> None:
    """torchft's pattern: a rank is SIGKILLed, the others raise, then form
    the group among themselves and train on; nothing is left in /dev/shm."""
    before = shm_segments()
    reports = run_ranks(check_after_a_death, WORLD, backend=None, may_die=(WORLD - 1,), env=NO_FR_DUMP)
    assert shm_segments() == before
    assert reports == [
        {
            "seen": "raised",
            "ddp": True,
            "after": {"rank": me, "size": 2, "gathered": [0, 1], "sum": [3.0, 2.0], "root": 0},
        }
        for me in range(WORLD - 1)
    ] + [None]
