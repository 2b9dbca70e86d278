"""torch's flight recorder on a groupcomm group: a rank that skips one
collective makes the others time out, every rank dumps its trace, and the
traces say which rank did not issue which op.

torch 2.15 attaches its recorder to every new group by itself and retires an
entry when our completion hook says the op succeeded, so finished ops read
"completed" and the hung one "scheduled"; its ``torchfrtrace`` analyzer reads
the dumps and names the missing rank. torch 2.14.1 has the recorder hook but
attaches it only by hand, retires entries at issue, and its analyzer refuses
the entries that hook writes ("c10d:<op>" is not a comm library it knows), so
there the dumps themselves are compared."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import run_ranks
from torch._C import _distributed_c10d as c10d

TORCH_2_15 = torch.__version__ >= (2, 15)
WORLD = 3

pytestmark = pytest.mark.skipif(
    not hasattr(c10d, "FlightRecorderHook"), reason="torch before 2.14 cannot record an out-of-tree backend"
)
SKIPPER = WORLD - 1


def check_flight_recorder(rank: int, world: int, dump_dir: str) -> str:
    from torch_groupcomm import CommTimeoutError

    group = dist.new_group(backend="groupcomm")
    hook = None if TORCH_2_15 else c10d.FlightRecorderHook.attach(group)  # noqa: F841 - kept attached
    for _ in range(3):
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((4,), float(world)))
    group.set_timeout(timedelta(seconds=2))
    if rank != SKIPPER:
        try:
            dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4), group=group)
        except CommTimeoutError:
            pass
        else:
            raise AssertionError(f"all_gather returned without rank {SKIPPER}")
    trace = c10d._dump_fr_trace(backend="groupcomm") if TORCH_2_15 else c10d._dump_fr_trace()
    with open(os.path.join(dump_dir, f"fr_{rank}"), "wb") as f:
        f.write(trace)
    dist.barrier()
    return group.group_name


def _ops(dump: dict, group_name: str):
    return [
        (e["profiling_name"].rpartition(":")[2], e["collective_seq_id"], e["state"])
        for e in dump["entries"]
        if e["process_group"][0] == group_name
    ]


def test_flight_recorder_names_the_missing_rank(tmp_path) -> None:
    names = run_ranks(check_flight_recorder, WORLD, args=(str(tmp_path),), env={"TORCH_FR_BUFFER_SIZE": "2000"})
    group_name = names[0]
    dumps = [pickle.loads((tmp_path / f"fr_{rank}").read_bytes()) for rank in range(WORLD)]
    # torch 2.15 names ops as its dispatcher does; 2.14 by collective family
    reduce_name, gather_name = ("all_reduce", "_all_gather_base") if TORCH_2_15 else ("allreduce", "allgather")
    reduces = [(reduce_name, seq, "completed" if TORCH_2_15 else "scheduled") for seq in (1, 2, 3)]
    for rank, dump in enumerate(dumps):
        ops = _ops(dump, group_name)
        if rank == SKIPPER:
            assert ops == reduces, ops
        else:  # issued, never completed
            assert ops == reduces + [(gather_name, 4, "scheduled")], ops
    if not TORCH_2_15:
        return
    report = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path), "-p", "fr_"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = report.stdout + report.stderr
    assert report.returncode == 0, text
    assert f"missing ranks: {{{SKIPPER}}}" in text and f"collective: groupcomm:{gather_name}" in text, text
