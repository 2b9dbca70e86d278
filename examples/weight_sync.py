"""RL-style weight sync: a trainer job pushes fresh weights to a separate
inference job through a StatelessProcessGroup.

    python examples/weight_sync.py [--versions 5] [--fleet 2]

Two independent jobs are started, as they would be in a real deployment: a
trainer (one process, its own ``init_process_group``) and an inference fleet
(``--fleet`` processes, their own ``init_process_group("groupcomm")``). Then
the trainer and every inference process form one more group without touching
torch.distributed's global state (``StatelessProcessGroup.create``), and after
each training step the trainer broadcasts its ``state_dict`` into the fleet's
live model through that group's coordinator (shared memory on one host). The
fleet checks its outputs against the checksum the trainer announces. The
processes report to this one, which alone prints: what each did per version,
then one result line, e.g.

    result: weights of 5 versions synced to 2 inference processes, every checksum matching the trainer's
"""

import argparse
import multiprocessing as mp
import queue
import socket

import torch
import torch.distributed as dist
import torch.nn as nn


def report(reports, version: int, who: int, line: str) -> None:
    """Hands a line to the launching process, which prints every process's
    lines in order (version, then the trainer before inference 0, 1, ...)."""
    reports.put((version, who, line))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16))


def probe_checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return model(torch.linspace(-1, 1, 64).unsqueeze(0)).sum().item()


def trainer(reports, sync_port: int, job_port: int, fleet: int, versions: int) -> None:
    from torch_groupcomm import StatelessProcessGroup

    dist.init_process_group("groupcomm", init_method=f"tcp://127.0.0.1:{job_port}", rank=0, world_size=1)
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = StatelessProcessGroup.create("127.0.0.1", sync_port, rank=0, world_size=1 + fleet)
    weights = sync.coordinator()
    for version in range(versions):
        x = torch.randn(32, 64)
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for tensor in model.state_dict().values():
            weights.broadcast(tensor, src=0)
        sync.broadcast_obj({"version": version, "checksum": probe_checksum(model)}, src=0)
        report(
            reports,
            version,
            -1,
            f"[trainer] version {version}: loss {loss.item():.5f}, pushed {len(model.state_dict())} tensors",
        )
    sync.barrier()
    sync.destroy()
    dist.destroy_process_group()


def inference(reports, rank: int, sync_port: int, job_port: int, fleet: int, versions: int) -> None:
    from torch_groupcomm import StatelessProcessGroup

    dist.init_process_group("groupcomm", init_method=f"tcp://127.0.0.1:{job_port}", rank=rank, world_size=fleet)
    model = make_model(seed=100 + rank)  # starts out different from the trainer
    sync = StatelessProcessGroup.create("127.0.0.1", sync_port, rank=1 + rank, world_size=1 + fleet)
    weights = sync.coordinator()
    for _ in range(versions):
        with torch.no_grad():
            for tensor in model.state_dict().values():
                weights.broadcast(tensor, src=0)  # in place, into the live model
        announced = sync.broadcast_obj(None, src=0)
        mine = probe_checksum(model)
        agreed = torch.tensor([mine])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # the fleet's own group still works alongside
        ok = mine == announced["checksum"] == agreed.item()
        report(
            reports,
            announced["version"],
            rank,
            f"[inference {rank}] version {announced['version']}: checksum {mine:.6f} "
            f"{'matches the trainer' if ok else 'DIFFERS'}",
        )
        if not ok:
            raise SystemExit(1)
    sync.barrier()
    sync.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--fleet", type=int, default=2)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    sync_port, trainer_port, fleet_port = free_port(), free_port(), free_port()
    reports = ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(reports, sync_port, trainer_port, args.fleet, args.versions))]
    procs += [
        ctx.Process(target=inference, args=(reports, r, sync_port, fleet_port, args.fleet, args.versions))
        for r in range(args.fleet)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    lines = []
    while True:  # every process has exited: what it reported is in the queue
        try:
            lines.append(reports.get(timeout=1))
        except queue.Empty:
            break
    for _, _, line in sorted(lines):
        print(line)
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes):
        print(f"result: weight sync FAILED, exit codes {codes} (trainer first)", flush=True)
        raise SystemExit(1)
    print(
        f"result: weights of {args.versions} versions synced to {args.fleet} inference processes, "
        "every checksum matching the trainer's",
        flush=True,
    )


if __name__ == "__main__":
    main()
