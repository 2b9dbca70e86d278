"""Ray Train (TorchTrainer) on the ``groupcomm`` backend (CPU, 2 workers).

    python examples/frameworks/ray_train.py [--backend gloo] [--steps 5]

Ray Train takes the torch.distributed backend from the trainer's
``torch_config=TorchConfig(backend="groupcomm")``; each worker passes the
string to ``torch.distributed.init_process_group`` (Ray's default on CPU is
"gloo"). The script starts a local Ray instance itself; the workers are
separate processes, and torch's backend autoload registers groupcomm in each
at ``import torch``, so nothing imports torch_groupcomm.

A 2-layer MLP trains on fixed random data (seed 0) with SGD under DDP
(``ray.train.torch.prepare_model``); worker 0 reports the loss of the final
model on the whole data set, the sum of its parameters and a digest of their
bytes (with a checkpoint: Ray keeps reported metrics only with one), and the
driver prints them as one result line. Run it with
``--backend gloo`` too: the two lines should be the same apart from the
backend's name.
"""

import argparse
import hashlib
import os
import tempfile

import ray
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch.utils.data import DataLoader, TensorDataset


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(256, 1, generator=gen)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def train_loop(config: dict) -> None:
    """Runs on every worker, in its own process."""
    import torch.distributed as dist

    data = make_data()
    model = ray.train.torch.prepare_model(make_model())
    loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=16, shuffle=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 0
    while steps < config["steps"]:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            steps += 1
            if steps == config["steps"]:
                break
    net = model.module if hasattr(model, "module") else model
    with torch.no_grad():
        x, y = data.tensors
        loss = nn.functional.mse_loss(net(x), y).item()
    flat = torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])
    metrics = {
        "steps": steps,
        "loss": loss,
        "checksum": flat.sum().item(),
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:12],
        "pg_backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "ddp": type(model).__name__,
    }
    # Ray Train keeps reported metrics only with a checkpoint: worker 0 attaches one.
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(net.state_dict(), os.path.join(folder, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="groupcomm", help="torch.distributed backend (default: groupcomm)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    parser.add_argument("--workers", type=int, default=2, help="training workers (default: 2)")
    args = parser.parse_args()

    ray.init(num_cpus=args.workers + 1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="ray-train-") as storage:
            trainer = TorchTrainer(
                train_loop,
                train_loop_config={"steps": args.steps},
                # The selection: Ray's TorchConfig names the backend.
                torch_config=TorchConfig(backend=args.backend),
                scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
                run_config=RunConfig(name="groupcomm-example", storage_path=storage),
            )
            metrics = trainer.fit().metrics
    finally:
        ray.shutdown()
    print(f"process group backend: {metrics['pg_backend']}, model: {metrics['ddp']}", flush=True)
    print(
        f"result: ray train torch on {args.backend}, {metrics['world']} ranks, {metrics['steps']} steps, "
        f"final loss {metrics['loss']:.6f}, parameter checksum {metrics['checksum']:.6f}, digest {metrics['digest']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
