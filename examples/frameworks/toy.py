"""What every framework example trains and reports: fixed random data (seed
0), a 2-layer MLP with fixed initial weights, and the one result line whose
numbers the two backends' runs must share (tests/test_frameworks.py compares
them). The examples import it from their own folder."""

import hashlib

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def make_data() -> TensorDataset:
    """256 samples of a noisy linear target, the same on every rank and run."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(256, 1, generator=gen)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    """The MLP, with the same initial weights on every rank and run."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def fingerprint(model: nn.Module) -> tuple:
    """(sum of the parameters, a digest of their bytes): equal only for equal weights."""
    flat = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    return flat.sum().item(), hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:12]


def result_line(framework: str, backend: str, world: int, steps: int, loss: float, prints: tuple) -> str:
    """The example's last line; ``prints`` is :func:`fingerprint`'s answer."""
    checksum, digest = prints
    return (
        f"result: {framework} on {backend}, {world} ranks, {steps} steps, final loss {loss:.6f}, "
        f"parameter checksum {checksum:.6f}, digest {digest}"
    )
