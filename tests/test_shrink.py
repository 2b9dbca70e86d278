"""Shrink after a failure, the fault-tolerant training pattern: 4 ranks train
with DDP, one is SIGKILLed in the middle of a step, the survivors see a
GroupCommError naming it, call ``dist.shrink_group`` and finish training on
the smaller group with equal parameters; then once more (4 -> 3 -> 2). Nothing
is left in /dev/shm. (The store's host, rank 0, is never the one killed.)
Every survivor sees the death within ~0.1 s, across hosts (hierarchical) too:
the dead rank's host tells the others by giving up on the group, and names
the dead rank through the group's store. On gloo the ranks that waited on
the dead one see it first, and a survivor waiting on them sees it when they
let go of the group (``shrink_group`` with SHRINK_ABORT), not at its timeout.

    python tests/test_shrink.py --runs 20   # repeats it, prints detection and shrink times
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import CPU_PATHS, run_ranks, shm_segments

WORLD = 4
VICTIMS = (3, 1)  # global ranks, killed in this order
STEPS = 4
KILL_AT = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _batch(step: int, phase: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * phase + 10 * step + rank)
    return torch.randn(16, 64, generator=g)


def _equal_everywhere(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(c, copies[0]) for c in copies)


def check_shrink(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_groupcomm import get_coordinator

    store = dist.distributed_c10d._get_default_store()
    # the survivors must not learn of a death from their timeout
    dist.group.WORLD.set_timeout(timedelta(seconds=20))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = {"detect_s": [], "shrink_s": [], "errors": []}
    for phase, victim in enumerate(VICTIMS):
        members = dist.get_process_group_ranks(dist.group.WORLD)
        ddp = DDP(model)
        failure = None
        for step in range(STEPS):
            loss = ddp(_batch(step, phase, rank)).square().mean()
            if rank == victim and step == KILL_AT:
                store.set(f"killed/{phase}", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                loss.backward()
            except RuntimeError as exc:
                failure = exc
                break
            opt.step()
            opt.zero_grad()
        assert failure is not None, f"phase {phase}: training went on without rank {victim}"
        store.set(f"detected/{phase}/{rank}", repr(time.time()))
        report["errors"].append(str(failure))
        dead = members.index(victim)
        if os.environ.get("GROUPCOMM_CPU_COMMUNICATOR") != "gloo":
            assert f"peer rank {dead}" in str(failure), str(failure)  # gloo says "Connection closed by peer"
        opt.zero_grad()
        start = time.monotonic()
        dist.shrink_group([dead], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
        report["shrink_s"].append(time.monotonic() - start)
        assert dist.get_world_size() == len(members) - 1
        assert get_coordinator().world_size == dist.get_world_size()
        ddp = DDP(model)  # takes rank 0's parameters
        for step in range(STEPS):
            ddp(_batch(step, phase + 10, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert _equal_everywhere(model), f"phase {phase}: parameters differ after training on"
    # every survivor of each death saw it, also the one that died next
    for phase in range(len(VICTIMS)):
        killed = float(store.get(f"killed/{phase}").decode())
        saw = [r for r in range(world) if r not in VICTIMS[: phase + 1]]
        report["detect_s"].append(max(float(store.get(f"detected/{phase}/{r}").decode()) - killed for r in saw))
    assert shm_segments() == [], shm_segments()
    report["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return report


SHRINK_PATHS = {p[0]: p[3] for p in CPU_PATHS if p[0] in ("shm-4", "hosts-aabb")}
SHRINK_PATHS["gloo-4"] = {"GROUPCOMM_CPU_COMMUNICATOR": "gloo"}


def _shrink_run(env: dict) -> list:
    """One run, checked; the survivors' reports."""
    results = run_ranks(check_shrink, WORLD, env=env, may_die=VICTIMS)
    rows = [results[r] for r in range(WORLD) if r not in VICTIMS]
    assert all(row is not None for row in rows), results
    for row in rows:
        assert row["params"] == rows[0]["params"]
        assert all(s < 3 for s in row["detect_s"]), row["detect_s"]
    assert shm_segments() == [], shm_segments()
    return rows


@pytest.mark.parametrize("path", sorted(SHRINK_PATHS))
def test_shrink_after_a_rank_dies(path: str) -> None:
    _shrink_run(SHRINK_PATHS[path])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--path", choices=sorted(SHRINK_PATHS), default="shm-4")
    args = parser.parse_args()
    runs = args.runs
    for run in range(runs):
        rows = _shrink_run(SHRINK_PATHS[args.path])
        detect = [max(row["detect_s"][i] for row in rows) for i in range(len(VICTIMS))]
        shrink = [max(row["shrink_s"][i] for row in rows) for i in range(len(VICTIMS))]
        print(
            f"{args.path} run {run + 1}/{runs}: detected {', '.join(f'{t:.2f}' for t in detect)} s after the kill; "
            f"shrink_group took {', '.join(f'{t:.2f}' for t in shrink)} s (4 -> 3, 3 -> 2); "
            f"parameters equal, /dev/shm clean",
            flush=True,
        )
        if run == 0:
            for row in rows:
                print("  a survivor's errors:", *row["errors"], sep="\n    ")
