"""Benchmarks: groupcomm against gloo (CPU) or nccl (CUDA), side by side in the same processes.

    python -m torch_groupcomm.bench [--world 2 4] [--ops all_reduce,all_gather]
        [--min-bytes 8] [--max-bytes 64M] [--dtype float32] [--device cpu]
        [--async] [--peer deepspeed] [--peer fake] [--repeat 3] [--json out.json] [--plot out.png]
    python -m torch_groupcomm.bench --workload ddp,fsdp2 [--model mlp] [--world 2]
    python -m torch_groupcomm.bench --workload tp-decode [--batch 1 8] [--peer deepspeed]
    python -m torch_groupcomm.bench --hosts 2x2 [--link 1gbit] [--ops ... | --workload ddp,fsdp2]   (root)
    torchrun ... -m torch_groupcomm.bench [--ops ... | --workload ddp,fsdp2] [--link-rate 100gbit]

The first form times collectives per op and message size (``collectives.py``);
the second the training step of a stated model under DDP or FSDP2
(``workloads.py``); the third the tokens per second of a small decoder
sharded over the ranks and compiled, with each backend's all-reduce in turn
(``tp_decode.py``, the model in ``decoder.py``). With ``--hosts`` the
ranks of the collectives or the training workloads run on simulated hosts
behind shaped links (``netns.py``), and the collectives' table adds each
row's link bound. ``--repeat N`` runs the collectives' plan N times on
fresh ranks and reports each row's median over the runs. Under
``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) every rank
runs the plan itself and rank 0 prints the table. Nothing here is imported by the package itself.
"""
