"""``python -m torch_groupcomm.bench``: see the package docstring."""

from __future__ import annotations

import argparse
import json
import os

import torch

from . import __doc__ as _usage
from . import collectives, workloads


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, run the ranks, print the table."""
    parser = argparse.ArgumentParser(prog="python -m torch_groupcomm.bench", description=_usage.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=None, help="world sizes (default: 2 4; workloads: 2)")
    parser.add_argument(
        "--ops", default=",".join(collectives.OPS), help=f"comma-separated, from: {','.join(collectives.OPS)}"
    )
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--step", type=int, default=8, help="size multiplier between rows (default 8)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the tensors live; cuda compares with nccl, one GPU per rank",
    )
    parser.add_argument(
        "--async",
        dest="async_rows",
        action="store_true",
        help="also time each op issued with async_op=True and waited for",
    )
    parser.add_argument(
        "--peer",
        action="append",
        choices=["deepspeed", "fake"],
        default=[],
        help="also time this all-reduce in the same rounds (CPU, all_reduce rows; repeatable): "
        "deepspeed: DeepSpeed's inference_all_reduce; fake: torch's no-op backend",
    )
    parser.add_argument(
        "--workload",
        help=f"comma-separated, from: {','.join(workloads.WORKLOADS)}: time training steps instead of collectives",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        choices=sorted(workloads.MODELS),
        help="; ".join(f"{k}: {v}" for k, v in workloads.MODELS.items()),
    )
    parser.add_argument("--steps", type=int, default=10, help="training steps per timed round (workloads)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per backend")
    parser.add_argument("--json", dest="json_path", help="also write the records as JSON")
    parser.add_argument("--plot", dest="plot_path", help="also plot bandwidth vs size (needs matplotlib)")
    ns = parser.parse_args(argv)
    if ns.workload:
        records = _workloads(parser, ns)
    else:
        records = _collectives(parser, ns)
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(records, f, indent=1)


def _workloads(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict:
    names = [w.strip() for w in ns.workload.split(",") if w.strip()]
    unknown = sorted(set(names) - set(workloads.WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(workloads.WORKLOADS)}")
    if ns.device != "cpu":
        parser.error("--workload runs on the CPU")
    args = {"workloads": names, "model": ns.model, "steps": max(ns.steps, 1), "rounds": max(ns.rounds, 1)}
    records: list[dict] = []
    for world in ns.world or [2]:
        records += workloads.run(world, args)
    print(
        f"model: {ns.model}: {workloads.MODELS[ns.model]}; median ms per step on rank 0 "
        f"(floor and fake: on the slowest rank), "
        f"{args['rounds']} alternating rounds of {args['steps']} steps; glibc malloc: "
        + ", ".join(f"{k}={os.environ.get(k, v)}" for k, v in workloads.STEADY_MALLOC.items())
    )
    print(workloads.format_table(records))
    return {"records": records}


def _collectives(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict:
    ops = [o.strip() for o in ns.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(collectives.OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(collectives.OPS)}")
    if not isinstance(getattr(torch, ns.dtype, None), torch.dtype):
        parser.error(f"unknown dtype {ns.dtype!r}")
    worlds = ns.world or [2, 4]
    args = {
        "ops": ops,
        "min_bytes": collectives.parse_bytes(ns.min_bytes),
        "max_bytes": collectives.parse_bytes(ns.max_bytes),
        "step": max(ns.step, 2),
        "dtype": ns.dtype,
        "rounds": max(ns.rounds, 1),
        "device": ns.device,
        "async": ns.async_rows,
        "peers": ns.peer,
    }
    if ns.peer and ns.device != "cpu":
        parser.error("--peer compares CPU all-reduces")
    if ns.device == "cuda" and torch.cuda.device_count() < max(worlds):
        parser.error(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} visible, world {max(worlds)}")
    if ns.device == "cuda" and "broadcast_object" in ops:
        parser.error("broadcast_object is a CPU benchmark (the message queue); leave it out with --device cuda")
    records: list[dict] = []
    memcpy = 0.0
    for world in worlds:
        result = collectives.run_world(world, args)
        records += result["records"]
        memcpy = max(memcpy, result["memcpy_gbps"])
    print(collectives.format_table(records, memcpy))
    scaling = collectives.format_scaling(records)
    if scaling:
        print(scaling)
    if ns.plot_path:
        collectives.plot(records, ns.plot_path)
    return {"memcpy_gbps": memcpy, "records": records}


if __name__ == "__main__":
    main()
