"""Sharded training with FSDP2 (``fully_shard``) on the ``groupcomm`` backend.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py [--backend gloo] [--steps 20]

Parameters are sharded across ranks; forward all-gathers them and backward
reduce-scatters the gradients, both through groupcomm, in buffers the backend
allocates. Only rank 0 prints: every rank's loss per step (gathered at the
end), the first parameter's shard, then one result line, e.g.

    result: 20 FSDP2 steps on 2 ranks (groupcomm), parameters sharded 2 ways; final loss rank0=0.012345 rank1=0.013456
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard


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
    # Let the backend allocate FSDP2's communication buffers (set per FSDP
    # module): on groupcomm's shared-memory path the peers then read them in
    # place; gloo allocates them as FSDP2 would.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_allocate_memory_from_process_group_for_comm(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    true_w = torch.linspace(-1, 1, 32)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = (x @ true_w).unsqueeze(1)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    shard = next(model.parameters())
    every = [None] * world
    dist.all_gather_object(every, losses)
    if rank == 0:  # one process prints, so lines from several ranks never interleave
        backend = dist.get_backend()
        print(f"backend={backend} world={world}: loss per step on each rank")
        for step in range(args.steps):
            print(f"  step {step:3d} " + " ".join(f"rank{r}={every[r][step]:.6f}" for r in range(world)))
        print(f"first parameter: local shard {tuple(shard.to_local().shape)} of full {tuple(shard.shape)}")
        final = " ".join(f"rank{r}={every[r][-1]:.6f}" for r in range(world)) if args.steps else "none"
        print(
            f"result: {args.steps} FSDP2 steps on {world} ranks ({backend}), parameters sharded {world} ways; "
            f"final loss {final}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
