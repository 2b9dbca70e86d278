"""The training frameworks of docs/guide/frameworks.md, each on groupcomm and
on gloo: examples/frameworks/<framework>_train.py runs twice as real
processes, launched the way its docstring says, and the result lines agree.

The frameworks are optional (none is a dependency of the package): a test
whose framework is not installed skips.

The lines must agree exactly: loss, parameter sum and a digest of the
parameters' bytes. With 2 ranks every reduction is one addition of two
operands, which gives the same bits in either order, and DDP and ZeRO divide
by the world size the same way on both backends; so groupcomm's training is
gloo's bit for bit, and any difference is a wrong result, not rounding.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from _harness import RANK_TIMEOUT_S, shm_segments
from test_examples import TORCH_GLOO_EXIT_ABORT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = re.compile(r"^result: (.+) on (\w+), (.+)$", re.MULTILINE)
# DeepSpeed's first run on a machine compiles its CPU communication op (about
# a minute on two cores) before training.
TIMEOUT_S = max(RANK_TIMEOUT_S, 300.0)


def _launch(script: str, args: tuple[str, ...], torchrun: bool) -> tuple[int, str]:
    path = os.path.join(ROOT, "examples", "frameworks", script)
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        if torchrun
        else [sys.executable]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GROUPCOMM_", "TORCHELASTIC_", "MASTER_"))}
    env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run(
        [*launcher, path, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return done.returncode, done.stdout + done.stderr


def _deepspeed_buffers() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_")}
    except FileNotFoundError:
        return set()


def _result(script: str, backend: str, args: tuple[str, ...], torchrun: bool) -> tuple[str, str]:
    """Runs the script on ``backend``; returns its result line's (framework,
    rest), failing on a non-zero exit, on a last line that is not the result,
    or on a segment of ours left in /dev/shm. A gloo run that torch's gloo
    aborted at exit (see test_examples) runs again, up to three times in all."""
    for _ in range(3):
        returncode, output = _launch(script, (*args, "--backend", backend), torchrun)
        if returncode == 0 or backend != "gloo" or TORCH_GLOO_EXIT_ABORT not in output:
            break
    assert returncode == 0, f"{script} on {backend} exited with {returncode}:\n{output[-4000:]}"
    assert shm_segments() == [], (script, backend, shm_segments())
    found = RESULT.findall(output)
    assert len(found) == 1, f"{script} on {backend}: want one result line:\n{output[-4000:]}"
    framework, used, rest = found[0]
    assert used == backend, found
    return framework, rest


def _check(script: str, *args: str, torchrun: bool = True) -> None:
    before = _deepspeed_buffers()
    try:
        ours = _result(script, "groupcomm", args, torchrun)
        theirs = _result(script, "gloo", args, torchrun)
    finally:
        # DeepSpeed leaves its CPU op's shared buffers behind; drop the ones these runs made.
        for name in _deepspeed_buffers() - before:
            os.unlink(os.path.join("/dev/shm", name))
    assert ours == theirs, f"groupcomm: {ours}\ngloo:      {theirs}"
    assert re.match(r"2 ranks, 5 steps, final loss \S+, parameter checksum \S+, digest [0-9a-f]{12}$", ours[1]), ours


def test_lightning() -> None:
    """Lightning's DDPStrategy(process_group_backend=...), under torchrun."""
    pytest.importorskip("lightning")
    _check("lightning_train.py", "--steps", "5")


def test_accelerate() -> None:
    """Accelerate on the default group made before the Accelerator, under torchrun."""
    pytest.importorskip("accelerate")
    _check("accelerate_train.py", "--steps", "5")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed(stage: int) -> None:
    """DeepSpeed's init_distributed(dist_backend=...) with ZeRO stage 1, 2, 3 on CPU, under torchrun."""
    pytest.importorskip("deepspeed")
    _check("deepspeed_train.py", "--steps", "5", "--zero-stage", str(stage))


def test_ray_train() -> None:
    """Ray Train's TorchConfig(backend=...): 2 workers of a local Ray instance."""
    pytest.importorskip("ray.train.torch")
    _check("ray_train.py", "--steps", "5", torchrun=False)


def test_torchft() -> None:
    """torchft's Manager on a process group built by the backend's plugin: 2 replica groups."""
    pytest.importorskip("torchft")
    _check("torchft_train.py", "--steps", "5", torchrun=False)
