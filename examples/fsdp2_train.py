"""Sharded training with FSDP2 (``fully_shard``) on the ``groupcomm`` backend.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py [--backend gloo] [--steps 20]

Parameters are sharded across ranks; forward all-gathers them and backward
reduce-scatters the gradients, both through groupcomm. Each rank prints its
loss per step.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="groupcomm")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    true_w = torch.linspace(-1, 1, 32)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = (x @ true_w).unsqueeze(1)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"[rank {rank}/{world} backend={dist.get_backend()}] step {step:3d} loss {loss.item():.6f}", flush=True)
    shard = next(model.parameters())
    if rank == 0:
        print(f"first parameter: local shard {tuple(shard.to_local().shape)} of full {tuple(shard.shape)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
