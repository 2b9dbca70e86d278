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
import os
import tempfile

import ray
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch.utils.data import DataLoader
from toy import fingerprint, make_data, make_model, result_line


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
    metrics = {
        "steps": steps,
        "loss": loss,
        "fingerprint": fingerprint(net),
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

    # The workers import toy.py from this folder, as the driver does.
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(
        num_cpus=args.workers + 1,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": here}},
    )
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
    line = result_line(
        "ray train torch", args.backend, metrics["world"], metrics["steps"], metrics["loss"], metrics["fingerprint"]
    )
    print(line, flush=True)


if __name__ == "__main__":
    main()
