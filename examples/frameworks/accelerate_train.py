"""Hugging Face Accelerate on the ``groupcomm`` backend (CPU, 2 processes).

    torchrun --standalone --nproc-per-node 2 examples/frameworks/accelerate_train.py [--backend gloo] [--steps 5]
    accelerate launch --multi_gpu --num_processes 2 examples/frameworks/accelerate_train.py [--backend gloo]

Accelerate's documented switch, ``InitProcessGroupKwargs(backend=...)``, does
not reach a CPU run: for a multi-process CPU job Accelerate 1.x sets the
backend to "gloo" (or "mpi") itself and rejects any other name ("Your
assigned backend groupcomm is not available, please use gloo"). It does keep
a process group that already exists, so the script makes the default group
itself, then creates the ``Accelerator``, which wraps the model in DDP on that
group. (``accelerate launch --cpu`` starts one process unless MPI is set up;
``--multi_gpu`` runs torchrun's launcher, which works without a GPU too.)
torch's backend autoload registers groupcomm at ``import torch``, so the
script does not import torch_groupcomm.

A 2-layer MLP trains on fixed random data (seed 0) with SGD; rank 0 then
prints one result line: the loss of the final model on the whole data set,
the sum of its parameters and a digest of their bytes. Run it with
``--backend gloo`` too: the two lines should be the same apart from the
backend's name.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader
from toy import fingerprint, make_data, make_model, result_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="groupcomm", help="torch.distributed backend (default: groupcomm)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    args = parser.parse_args()

    # The selection: the default group on groupcomm, made before the Accelerator.
    dist.init_process_group(args.backend)
    accelerator = Accelerator(cpu=True)

    data = make_data()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(data, batch_size=16, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    steps = 0
    while steps < args.steps:
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            steps += 1
            if steps == args.steps:
                break

    net = accelerator.unwrap_model(model)
    with torch.no_grad():
        x, y = data.tensors
        loss = nn.functional.mse_loss(net(x), y).item()
    accelerator.print(
        f"process group backend: {dist.get_backend()}, accelerate distributed type: "
        f"{accelerator.distributed_type.value}"
    )
    accelerator.print(
        result_line("accelerate ddp", args.backend, accelerator.num_processes, steps, loss, fingerprint(net))
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
