"""Data-parallel training on the ``groupcomm`` backend with plain DDP.

    torchrun --nproc-per-node 2 examples/ddp_train.py [--backend gloo] [--steps 20]

The script is ordinary torch code: only the backend string names groupcomm
(torch's backend autoload registers it; no import of torch_groupcomm needed).
Each rank prints its loss per step; at the end rank 0 checks that every rank
holds the same parameters.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="groupcomm")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
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

    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    if rank == 0:
        same = all(torch.equal(c, flat) for c in copies)
        print(f"parameters identical on all {world} ranks: {same}", flush=True)
        if not same:
            raise SystemExit("ranks diverged")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
