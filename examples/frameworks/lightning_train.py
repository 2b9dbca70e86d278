"""PyTorch Lightning DDP on the ``groupcomm`` backend (CPU, 2 processes).

    torchrun --standalone --nproc-per-node 2 examples/frameworks/lightning_train.py [--backend gloo] [--steps 5]
    python examples/frameworks/lightning_train.py [--backend gloo]   # Lightning starts the second process itself

Lightning picks the torch.distributed backend from its strategy:
``DDPStrategy(process_group_backend="groupcomm")``; it passes that string
unchanged to ``torch.distributed.init_process_group``. torch's backend
autoload registers groupcomm at ``import torch``, so the script does not
import torch_groupcomm. Under torchrun Lightning takes the ranks from the
environment (``devices`` must equal ``--nproc-per-node``); run by plain
python it starts the other ranks as subprocesses of its own.

A 2-layer MLP trains on fixed random data (seed 0) with SGD; rank 0 then
prints one result line: the loss of the final model on the whole data set,
the sum of its parameters and a digest of their bytes. Run it with
``--backend gloo`` too: the two lines should be the same apart from the
backend's name.
"""

import argparse
import warnings

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from toy import fingerprint, make_data, make_model, result_line


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="groupcomm", help="torch.distributed backend (default: groupcomm)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    parser.add_argument("--ranks", type=int, default=2, help="processes; must equal torchrun's --nproc-per-node")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    data = make_data()
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.ranks,
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend=args.backend),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=16, shuffle=False))

    import torch.distributed as dist

    used = dist.get_backend()
    if trainer.is_global_zero:
        with torch.no_grad():
            x, y = data.tensors
            loss = nn.functional.mse_loss(module.net(x), y).item()
        print(f"process group backend: {used}", flush=True)
        print(
            result_line(
                "lightning ddp", args.backend, trainer.world_size, trainer.global_step, loss, fingerprint(module.net)
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
