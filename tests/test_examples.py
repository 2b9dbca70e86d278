"""The examples the README points newcomers to, run the way it says: through
torchrun (or plain python), as separate processes, each checked for the lines
that say it did its job. Every example prints from one process only and ends
with one ``result: ...`` line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from _harness import RANK_TIMEOUT_S, shm_segments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(script: str, args: tuple[str, ...], ranks: int) -> tuple[int, str, str]:
    path = os.path.join(ROOT, "examples", script)
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        if ranks
        else [sys.executable]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GROUPCOMM_", "TORCHELASTIC_", "MASTER_"))}
    done = subprocess.run(
        [*launcher, path, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S
    )
    return done.returncode, done.stdout, done.stderr


def _result(script: str, stdout: str, stderr: str) -> str:
    """The example's closing line: the last line of its standard output."""
    lines = stdout.rstrip("\n").splitlines()
    assert lines and lines[-1].startswith("result: "), f"{script} ends on no result line:\n{stdout}\n{stderr[-4000:]}"
    return lines[-1]


def run_example(script: str, *args: str, ranks: int = 0) -> tuple[str, str]:
    """Runs examples/<script> (under torchrun with ``ranks`` processes, else
    plain python); returns its standard output and its result line, failing
    on a non-zero exit, an output not closed by a result line or a segment of
    ours left in /dev/shm."""
    returncode, stdout, stderr = _launch(script, args, ranks)
    assert returncode == 0, f"{script} exited with {returncode}:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    assert shm_segments() == [], (script, shm_segments())
    return stdout, _result(script, stdout, stderr)


# torch's own gloo can abort a process at exit: its worker thread drops the
# last reference to a finished op, whose saved thread-local state holds a
# Python object, while the interpreter is finalizing (backtrace:
# ~AsyncAllreduceWork -> ~ThreadLocalState -> SafePyObject decref ->
# take_gil -> pthread_exit -> terminate). 3 of 40 plain-gloo runs of
# fsdp2_train.py on torch 2.13.0, with no groupcomm group in the process.
TORCH_GLOO_EXIT_ABORT = "terminate called without an active exception"


def run_gloo_reference(script: str, *args: str, ranks: int) -> tuple[str, str]:
    """Runs examples/<script> with ``--backend gloo`` for the values to compare
    against (its standard output and result line); a run that torch's gloo
    aborted at exit (after its work) runs again, up to three times in all."""
    for _ in range(3):
        returncode, stdout, stderr = _launch(script, (*args, "--backend", "gloo"), ranks)
        if returncode == 0 or TORCH_GLOO_EXIT_ABORT not in stdout + stderr:
            break
    assert returncode == 0, f"{script} on gloo exited with {returncode}:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    return stdout, _result(script, stdout, stderr)


def _losses(out: str) -> dict[tuple[int, int], str]:
    """{(rank, step): loss} from the per-step table rank 0 prints
    (``  step   3 rank0=0.123456 rank1=0.234567``)."""
    found = {}
    for step, row in re.findall(r"^  step +(\d+) ((?:rank\d+=\S+ ?)+)", out, re.MULTILINE):
        for rank, loss in re.findall(r"rank(\d+)=(\S+)", row):
            found[int(rank), int(step)] = loss
    return found


def test_ddp_train() -> None:
    """The README's main job: equal parameters, and the step-time line against gloo."""
    out, result = run_example("ddp_train.py", "--steps", "5", ranks=2)
    assert "backend=groupcomm world=2" in out, out
    assert sorted(_losses(out)) == [(r, s) for r in range(2) for s in range(5)], out
    assert re.fullmatch(
        r"result: parameters identical on 2 ranks after 5 steps; DDP step of a 4 x 1024x1024 MLP \(batch 8\): "
        r"groupcomm \d+\.\d ms, gloo \d+\.\d ms, groupcomm with shared_allreduce_hook \d+\.\d ms "
        r"\(\d+\.\d\dx and \d+\.\d\dx gloo's speed\)",
        result,
    ), out


def test_fsdp2_train_matches_gloo() -> None:
    """FSDP2 with backend-allocated buffers: every rank's loss per step as on gloo."""
    ours, result = run_example("fsdp2_train.py", "--steps", "6", ranks=2)
    theirs, their_result = run_gloo_reference("fsdp2_train.py", "--steps", "6", ranks=2)
    assert "backend=groupcomm world=2" in ours and "backend=gloo world=2" in theirs, (ours, theirs)
    assert "first parameter: local shard (64, 32) of full (128, 32)" in ours, ours
    losses = _losses(ours)
    assert sorted(losses) == [(r, s) for r in range(2) for s in range(6)], ours
    assert losses == _losses(theirs), (ours, theirs)
    final = f"final loss rank0={losses[0, 5]} rank1={losses[1, 5]}"
    assert result == f"result: 6 FSDP2 steps on 2 ranks (groupcomm), parameters sharded 2 ways; {final}", result
    assert their_result == result.replace("(groupcomm)", "(gloo)"), (result, their_result)


def test_tensor_dict_broadcast() -> None:
    """The driver's dicts reach every worker (the example checks each step's checksum)."""
    out, result = run_example("tensor_dict_broadcast.py", "--steps", "20", ranks=4)
    assert re.fullmatch(
        r"result: 20 steps on 4 ranks, inputs identical everywhere: \d+ us per step \(broadcast_tensor_dict \+ all_reduce\)",
        result,
    ), out


def test_bagua_train() -> None:
    """Two simulated hosts: one leader each talks across them, every rank ends equal."""
    out, result = run_example("bagua_train.py", "--steps", "5", ranks=4)
    assert out.count(": intra-node rank ") == 4 and out.count("inter-node rank ") == 2, out
    assert sorted(_losses(out)) == [(r, s) for r in range(4) for s in range(5)], out
    assert re.fullmatch(
        r"result: parameters identical on 4 ranks after 5 steps, gradients averaged across 2 hosts; "
        r"final loss \d+\.\d{6} \(mean over ranks\)",
        result,
    ), out


def test_weight_sync() -> None:
    """Every inference process gets every version the trainer pushes."""
    out, result = run_example("weight_sync.py", "--versions", "3", "--fleet", "2")
    matched = re.findall(r"^\[inference (\d)\] version (\d): checksum \S+ matches the trainer$", out, re.MULTILINE)
    assert sorted(matched) == [(str(i), str(v)) for i in range(2) for v in range(3)], out
    assert len(re.findall(r"^\[trainer\] version \d: loss \S+, pushed \d+ tensors$", out, re.MULTILINE)) == 3, out
    assert result == (
        "result: weights of 3 versions synced to 2 inference processes, every checksum matching the trainer's"
    ), out


def test_tp_decode_matches_gloo() -> None:
    """The compiled tensor-parallel decoder generates the same tokens on groupcomm as on gloo."""
    args = ("--decoder", "tiny", "--batch", "2", "--tokens", "6")
    ours, result = run_example("tp_decode.py", *args, ranks=2)
    theirs, their_result = run_gloo_reference("tp_decode.py", *args, ranks=2)
    assert "backend=groupcomm world=2: tiny decoder" in ours and "backend=gloo world=2" in theirs, (ours, theirs)
    pattern = (
        r"result: 2 x 6 tokens generated greedily on 2 ranks \((\w+)\), compiled: \d+\.\d tokens/s; tokens (\w{12})"
    )
    ours_match, theirs_match = re.fullmatch(pattern, result), re.fullmatch(pattern, their_result)
    assert ours_match and theirs_match, (result, their_result)
    assert ours_match.group(1) == "groupcomm" and theirs_match.group(1) == "gloo", (result, their_result)
    assert ours_match.group(2) == theirs_match.group(2), (result, their_result)
