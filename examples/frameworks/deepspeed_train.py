"""DeepSpeed ZeRO (stage 1, 2 or 3) on the ``groupcomm`` backend (CPU, 2 processes).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/frameworks/deepspeed_train.py [--backend gloo] [--zero-stage 1|2|3] [--steps 5]
    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 examples/frameworks/deepspeed_train.py [--backend gloo] [--zero-stage 3]

DeepSpeed takes the torch.distributed backend from
``deepspeed.init_distributed(dist_backend="groupcomm")``, which hands the
string to ``torch.distributed.init_process_group``; ``deepspeed.initialize``
then keeps that group. Without it DeepSpeed's CPU accelerator would pick
"ccl" (with oneCCL's bindings installed) or "gloo". torch's backend autoload
registers groupcomm at ``import torch``, so the script does not import
torch_groupcomm. The script sets DS_ACCELERATOR=cpu itself when it is unset.
DeepSpeed compiles its CPU communication op on a machine's first run (about
a minute), and leaves that op's buffers (deepspeed_allreduce_buffer_*) in
/dev/shm; training's collectives go through torch.distributed.

A 2-layer MLP trains in fp32 on fixed random data (seed 0) with torch's SGD
under ZeRO; rank 0 then prints one result line: the loss of the final model
(its parameters gathered from the ZeRO partitions) on the whole data set, the
sum of its parameters and a digest of their bytes. Run it with
``--backend gloo`` too: the two lines should be the same apart from the
backend's name.
"""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed.comm as ds_dist
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler
from toy import fingerprint, make_data, make_model, result_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="groupcomm", help="torch.distributed backend (default: groupcomm)")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()

    # The selection: DeepSpeed's own init, with the backend's name.
    deepspeed.init_distributed(dist_backend=args.backend)
    rank, world = ds_dist.get_rank(), ds_dist.get_world_size()

    data = make_data()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config=config
    )
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, shuffle=False))

    steps = 0
    while steps < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            steps += 1
            if steps == args.steps:
                break

    # Every rank joins the gather (ZeRO-3 holds a partition of each parameter).
    final = make_model()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
        for mine, trained in zip(final.parameters(), engine.module.parameters()):
            mine.copy_(trained.detach().reshape(mine.shape))
    if rank == 0:
        with torch.no_grad():
            x, y = data.tensors
            loss = nn.functional.mse_loss(final(x), y).item()
        print(f"process group backend: {torch.distributed.get_backend()}", flush=True)
        print(
            result_line(f"deepspeed zero-{args.zero_stage}", args.backend, world, steps, loss, fingerprint(final)),
            flush=True,
        )
    ds_dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
