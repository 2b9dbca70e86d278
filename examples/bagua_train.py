"""Data-parallel training written against the Bagua-style functional API.

    torchrun --standalone --nproc-per-node 4 examples/bagua_train.py [--hosts 2] [--steps 20]

(``--hosts`` defaults to 2 simulated hosts; ``--hosts 0`` uses the real ones.)

Instead of DDP, the loop does the communication itself with
``torch_groupcomm.communication``: ``init_process_group()`` (torchrun's
variables, ``groupcomm`` backend), ``broadcast`` of rank 0's initial weights,
and a hierarchical ``allreduce_inplace(..., op=ReduceOp.AVG)`` of the
gradients each step (reduce inside each host, all-reduce among host leaders,
broadcast inside each host). ``--hosts 2`` pretends the ranks sit on two hosts
by giving each block of ranks its own ``GROUPCOMM_HOST_ID``, so the
hierarchical path runs on one machine. At the end rank 0 checks that every
rank holds the same parameters. Only rank 0 prints: each rank's place in the
hierarchy and loss per step (gathered at the end), then one result line, e.g.

    result: parameters identical on 4 ranks after 20 steps, gradients averaged across 2 hosts; final loss 0.012345 (mean over ranks)
"""

import argparse
import os

import torch
import torch.nn as nn

from torch_groupcomm import communication
from torch_groupcomm.communication import ReduceOp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts (0: the real ones)")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.hosts > 0:
        os.environ["GROUPCOMM_HOST_ID"] = f"sim-host-{rank * args.hosts // world}"
    communication.init_process_group()
    group = communication.get_default_group()
    intra = group.get_intra_node_communicator()
    inter = group.get_inter_node_communicator()
    leader = (
        f"inter-node rank {inter.rank()}/{inter.nranks()}" if inter else "no inter-node communicator (not a leader)"
    )
    place = f"intra-node rank {intra.rank()}/{intra.nranks()}, {leader}"

    torch.manual_seed(100 + rank)  # deliberately different, then replaced by rank 0's
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    for p in model.parameters():
        communication.broadcast(p.data, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(rank)
    true_w = torch.linspace(-1, 1, 32)
    params = list(model.parameters())
    losses, mean_losses = [], []
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = (x @ true_w).unsqueeze(1)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        # one all-reduce for all gradients: flatten, average, copy back
        grads = torch.cat([p.grad.view(-1) for p in params])
        communication.allreduce_inplace(grads, op=ReduceOp.AVG, hierarchical=True)
        for p, g in zip(params, grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        optimizer.step()
        mean_loss = loss.detach().reshape(1).clone()
        communication.allreduce_inplace(mean_loss, op=ReduceOp.AVG)
        losses.append(loss.item())
        mean_losses.append(mean_loss.item())

    flat = torch.cat([p.detach().view(-1) for p in params])
    copies = torch.empty(world, flat.numel())
    communication.allgather(flat, copies)
    every = [None] * world
    torch.distributed.all_gather_object(every, (place, losses))
    if rank == 0:  # one process prints, so lines from several ranks never interleave
        print(f"hosts {group.hosts}")
        for r, (where, _) in enumerate(every):
            print(f"  rank {r}/{world}: {where}")
        print("loss per step on each rank (and the mean over ranks)")
        for step in range(args.steps):
            each = " ".join(f"rank{r}={every[r][1][step]:.6f}" for r in range(world))
            print(f"  step {step:3d} {each} (mean {mean_losses[step]:.6f})")
        same = all(torch.equal(c, flat) for c in copies)
        hosts = len(group.hosts)
        final = f"final loss {mean_losses[-1]:.6f} (mean over ranks)" if args.steps else "no steps"
        if not same:
            print(f"result: parameters DIFFER across {world} ranks after {args.steps} steps", flush=True)
            raise SystemExit("ranks diverged")
        print(
            f"result: parameters identical on {world} ranks after {args.steps} steps, "
            f"gradients averaged across {hosts} host{'s' if hosts != 1 else ''}; {final}",
            flush=True,
        )
    communication.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
