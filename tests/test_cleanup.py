"""Nothing of ours stays in /dev/shm, however a run ends: normal exit with or
without destroy_process_group, an exception in the middle of the work, or
SIGKILL of any rank (the segments' creator included) during group creation,
during message-queue setup or in the middle of collectives. 20 runs in all."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import run_ranks, shm_segments

WORLD = 3


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _step(rank: int, step: int) -> None:
    """One step of a job's traffic: collectives and a send/recv pair."""
    dist.all_reduce(torch.ones(50000))
    dist.all_gather_into_tensor(torch.empty(WORLD * 1000), torch.ones(1000))
    if rank < 2:
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.ones(100), peer), dist.P2POp(dist.irecv, torch.empty(100), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _ending(rank: int, world: int, how: str, victim: int, when: float) -> str:
    """``how``: exit / destroy (normal ends), raise (an exception at step
    ``when``), kill-init (SIGKILL ``when`` s after starting to create the
    group), kill-mq (SIGKILL ``when`` s into a loop of message-queue setups),
    kill-step (SIGKILL at step ``when``)."""
    if how == "kill-init" and rank == victim:
        threading.Timer(when, _die).start()
    try:
        dist.init_process_group(
            "groupcomm",
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=5),
        )
        if how == "kill-mq":
            from torch_groupcomm import GroupCoordinator

            coordinator = GroupCoordinator([list(range(world))], rank, "groupcomm", group_name="mq")
            coordinator.barrier()
            if rank == victim:
                threading.Timer(when, _die).start()
            for _ in range(100):
                mq = coordinator.create_mq_broadcaster()
                for step in range(20):
                    mq.broadcast_object({"step": step} if rank == 0 else None)
                mq.close()
            return "finished"
        for step in range(300 if how.startswith("kill") else 5):
            if rank == victim and step == when:
                if how == "raise":
                    raise RuntimeError("boom in the middle of the job")
                if how == "kill-step":
                    _die()
            _step(rank, step)
        if how == "destroy":
            dist.destroy_process_group()
        return "finished"
    except Exception as exc:  # noqa: BLE001 - a peer's death is the point
        if how == "raise" and rank == victim:
            raise
        return f"raised {type(exc).__name__}"


CASES = (
    [("exit", -1, 0), ("destroy", -1, 0), ("raise", 1, 2), ("raise", 0, 3)]
    + [("kill-init", v, d) for v in range(WORLD) for d in (0.05, 0.3, 0.8)]
    + [("kill-mq", v, d) for v in (0, 2) for d in (0.1, 0.5)]
    + [("kill-step", v, s) for v, s in ((0, 0), (1, 2), (2, 4))]
)


@pytest.mark.parametrize("how,victim,when", CASES, ids=[f"{h}-r{v}-{w}" for h, v, w in CASES])
def test_nothing_left_in_dev_shm(how: str, victim: int, when: float) -> None:
    assert shm_segments() == [], shm_segments()
    try:
        results = run_ranks(
            _ending, WORLD, backend=None, args=(how, victim, when), may_die=range(WORLD), timeout=120, fresh=True
        )
    except AssertionError as exc:
        # only the rank that raised on purpose may report a failure
        assert how == "raise" and "boom in the middle of the job" in str(exc) and "hang" not in str(exc), str(exc)
    else:
        if how in ("exit", "destroy"):
            assert results == ["finished"] * WORLD, results
        else:
            assert all(r is None or r.startswith("raised") or r == "finished" for r in results), results
    deadline = time.monotonic() + 2
    while shm_segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shm_segments() == [], shm_segments()
