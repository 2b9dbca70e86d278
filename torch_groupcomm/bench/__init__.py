"""Benchmarks: groupcomm against gloo (CPU) or nccl (CUDA), side by side in the same processes.

    python -m torch_groupcomm.bench [--world 2 4] [--ops all_reduce,all_gather]
        [--min-bytes 8] [--max-bytes 64M] [--dtype float32] [--device cpu]
        [--async] [--peer deepspeed] [--peer fake] [--json out.json] [--plot out.png]
    python -m torch_groupcomm.bench --workload ddp,fsdp2 [--model mlp] [--world 2]

The first form times collectives per op and message size (``collectives.py``);
the second the training step of a stated model under DDP or FSDP2
(``workloads.py``). Nothing here is imported by the package itself.
"""
