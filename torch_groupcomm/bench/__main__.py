"""``python -m torch_groupcomm.bench``: see the package docstring."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import __doc__ as _usage
from . import collectives, decoder, netns, tp_decode, workloads

# After one simulated host's rank has failed, how long the others get to
# notice and exit before they are killed: a dead rank ends the bench in
# bounded time even where the survivors would wait for the group's timeout.
FAILED_RANK_GRACE_S = 30.0
WORKLOADS = (*workloads.WORKLOADS, tp_decode.WORKLOAD)


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
        choices=["coordinator", "deepspeed", "fake", "twin"],
        default=[],
        help="also time this call in the same rounds (CPU; repeatable): "
        "coordinator: GroupCoordinator.all_reduce (the custom op); "
        "deepspeed: DeepSpeed's inference_all_reduce (also a tp-decode backend); fake: torch's no-op backend "
        "(these three on all_reduce rows); twin: every op on a second gloo group, so that the gloo column's "
        "spread from run to run shows next to the speedup",
    )
    parser.add_argument(
        "--workload",
        help=f"comma-separated, from: {','.join(WORKLOADS)}: time training steps (ddp, fsdp2) or "
        "tensor-parallel decoding (tp-decode) instead of collectives",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        choices=sorted(workloads.MODELS),
        help="; ".join(f"{k}: {v}" for k, v in workloads.MODELS.items()),
    )
    parser.add_argument("--steps", type=int, default=10, help="training steps per timed round (ddp, fsdp2)")
    parser.add_argument(
        "--decoder",
        default="small",
        choices=sorted(decoder.DECODERS),
        help="tp-decode's model: " + "; ".join(f"{k}: {v.describe()}" for k, v in decoder.DECODERS.items()),
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="tp-decode's batch sizes (default 1 8)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens tp-decode generates per timed round")
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="tp-decode: run the decoder eagerly instead of torch.compile(fullgraph=True)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per backend")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="collectives: run the whole plan this many times on fresh ranks and report each row's median "
        "over the runs (a busy spell of a shared machine then moves one run's row, not the table)",
    )
    parser.add_argument("--json", dest="json_path", help="also write the records as JSON")
    parser.add_argument("--plot", dest="plot_path", help="also plot bandwidth vs size (needs matplotlib)")
    parser.add_argument(
        "--hosts",
        help="run the ranks on simulated hosts (network namespaces, root only): "
        "HxL (H hosts of L ranks, e.g. 2x2) or ranks per host (e.g. 3,1)",
    )
    parser.add_argument(
        "--link",
        help="with --hosts: each host's link, per direction, as tc writes a rate (default 1gbit; none: unshaped)",
    )
    parser.add_argument(
        "--link-rate",
        help="under torchrun: the hosts' link rate per direction (e.g. 100gbit), for the link bound columns",
    )
    # rank 0 of a --hosts run writes its results here instead of printing the table
    parser.add_argument("--result", dest="result_path", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.link is not None and not ns.hosts:
        parser.error("--link shapes simulated hosts: use it with --hosts (under torchrun: --link-rate)")
    if ns.repeat < 1:
        parser.error(f"--repeat {ns.repeat}: the plan runs at least once")
    if ns.repeat > 1 and ns.workload:
        parser.error("--repeat repeats the collectives' plan; --workload times its rounds within one run")
    if ns.workload:
        records = _workloads(parser, ns)
    else:
        records = _collectives(parser, ns)
    if ns.json_path and records is not None:
        with open(ns.json_path, "w") as f:
            json.dump(records, f, indent=1)


def _workloads(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict:
    names = [w.strip() for w in ns.workload.split(",") if w.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    if ns.device != "cpu":
        parser.error("--workload runs on the CPU")
    if (ns.hosts or collectives.from_environment()) and tp_decode.WORKLOAD in names:
        parser.error("--workload tp-decode runs on one host: leave out --hosts and torchrun")
    records: list[dict] = []
    training = [name for name in names if name in workloads.WORKLOADS]
    if training:
        records += _training(parser, ns, training)
    if tp_decode.WORKLOAD in names:
        records += _tp_decode(parser, ns)
    return {"records": records}


def _training(parser: argparse.ArgumentParser, ns: argparse.Namespace, names: list[str]) -> list[dict]:
    args = {"workloads": names, "model": ns.model, "steps": max(ns.steps, 1), "rounds": max(ns.rounds, 1)}
    where = ""
    if ns.hosts:
        tail = ["--workload", ",".join(names), "--model", ns.model]
        tail += ["--steps", str(args["steps"]), "--rounds", str(args["rounds"])]
        malloc = {k: os.environ.get(k, v) for k, v in workloads.STEADY_MALLOC.items()}
        records, layout, rate, _ = _on_simulated_hosts(parser, ns, tail, malloc)
        where = f"; hosts {'+'.join(map(str, layout))} ranks, links {rate or 'unshaped'}"
    elif collectives.from_environment():
        if ns.world:
            parser.error(f"--world: this run's world is the environment's (WORLD_SIZE={os.environ['WORLD_SIZE']})")
        records = workloads.run_env_rank(args)
        if records is None:
            return []
        if ns.result_path:
            Path(ns.result_path).write_text(json.dumps(records))
            return []
    else:
        records = []
        for world in ns.world or [2]:
            records += workloads.run(world, args)
    print(
        f"model: {ns.model}: {workloads.MODELS[ns.model]}; median ms per step on rank 0 "
        f"(floor and fake: on the slowest rank), "
        f"{args['rounds']} alternating rounds of {args['steps']} steps; glibc malloc: "
        + ", ".join(f"{k}={os.environ.get(k, v)}" for k, v in workloads.STEADY_MALLOC.items())
        + where
    )
    print(workloads.format_table(records))
    return records


def _tp_decode(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[dict]:
    if set(ns.peer) - {"deepspeed"}:
        parser.error("--workload tp-decode takes --peer deepspeed only")
    if not isinstance(getattr(torch, ns.dtype, None), torch.dtype) or not getattr(torch, ns.dtype).is_floating_point:
        parser.error(f"--workload tp-decode: --dtype {ns.dtype!r} is not a floating-point dtype")
    if min(ns.batch) < 1 or ns.tokens < 1:
        parser.error(f"--workload tp-decode: --batch {ns.batch} and --tokens {ns.tokens} must be at least 1")
    worlds = ns.world or [2]
    for world in worlds:
        try:
            decoder.check_shardable(decoder.DECODERS[ns.decoder], world)
        except ValueError as exc:
            parser.error(f"--decoder {ns.decoder} at world {world}: {exc}")
    args = {
        "decoder": ns.decoder,
        "dtype": ns.dtype,
        "batches": ns.batch,
        "tokens": ns.tokens,
        "rounds": max(ns.rounds, 1),
        "compile": ns.compile,
        "peers": ns.peer,
    }
    records: list[dict] = []
    for world in worlds:
        records += tp_decode.run(world, args)
    print(tp_decode.describe(args))
    print(tp_decode.format_table(records))
    if not all(r["equal"] for r in records):
        raise SystemExit(
            "python -m torch_groupcomm.bench --workload tp-decode: the backends generated different tokens"
        )
    return records


def _collectives(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict | None:
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
        parser.error("--peer times CPU calls")
    if ns.device == "cuda" and torch.cuda.device_count() < max(worlds):
        parser.error(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} visible, world {max(worlds)}")
    if ns.device == "cuda" and "broadcast_object" in ops:
        parser.error("broadcast_object is a CPU benchmark (the message queue); leave it out with --device cuda")
    if ns.hosts:
        return _across_hosts(parser, ns, args)
    if collectives.from_environment():
        return _from_environment(parser, ns, args)
    if ns.link_rate:
        parser.error("--link-rate is for runs under torchrun (with --hosts: --link)")
    runs: list[list[dict]] = []
    memcpy = 0.0
    for _ in range(ns.repeat):
        runs.append([])
        for world in worlds:
            result = collectives.run_world(world, args)
            runs[-1] += result["records"]
            memcpy = max(memcpy, result["memcpy_gbps"])
    records = runs[0] if ns.repeat == 1 else collectives.merge_runs(runs)
    print(collectives.format_table(records, memcpy))
    scaling = collectives.format_scaling(records)
    if scaling:
        print(scaling)
    if ns.plot_path:
        collectives.plot(records, ns.plot_path)
    return {"memcpy_gbps": memcpy, "records": records}


def _rate(parser: argparse.ArgumentParser, option: str, rate: str | None) -> float | None:
    """Bytes per second of a tc rate given on the command line (None: none given)."""
    if rate is None:
        return None
    try:
        return netns.parse_rate(rate)
    except ValueError as exc:
        parser.error(f"{option}: {exc}")


def _print_results(ns: argparse.Namespace, result: dict, link_bytes_per_s: float | None) -> None:
    print(collectives.format_table(result["records"], result["memcpy_gbps"], link_bytes_per_s))
    if ns.plot_path:
        collectives.plot(result["records"], ns.plot_path)


def _from_environment(parser: argparse.ArgumentParser, ns: argparse.Namespace, args: dict) -> dict | None:
    """One rank of a world the environment describes (torchrun, or a --hosts
    launch): run the plan; rank 0 prints the table (or, for --hosts, writes
    its results to --result). None on the other ranks."""
    if ns.world:
        parser.error(f"--world: this run's world is the environment's (WORLD_SIZE={os.environ['WORLD_SIZE']})")
    if ns.repeat > 1:
        parser.error("--repeat: under torchrun each launch is one run; launch it again")
    rate = _rate(parser, "--link-rate", ns.link_rate)
    result = collectives.run_env_rank(args)
    if result is None:
        return None
    if ns.result_path:
        Path(ns.result_path).write_text(json.dumps(result))
        return None
    _print_results(ns, result, rate)
    return {**result, "link_bytes_per_s": rate}


def _layout(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """--hosts: "2x2" -> [2, 2] (hosts x ranks each), "3,1" -> [3, 1]."""
    try:
        if match := re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text):
            counts = [int(match.group(2))] * int(match.group(1))
        else:
            counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        parser.error(f"--hosts {text!r}: HxL (e.g. 2x2, 4x1) or ranks per host (e.g. 3,1)")
    return counts


def _across_hosts(parser: argparse.ArgumentParser, ns: argparse.Namespace, args: dict) -> dict:
    """The collectives on simulated hosts; print rank 0's results with the link bound."""
    tail = ["--ops", ",".join(args["ops"])]
    tail += ["--min-bytes", str(args["min_bytes"]), "--max-bytes", str(args["max_bytes"])]
    tail += ["--step", str(args["step"]), "--dtype", args["dtype"], "--rounds", str(args["rounds"])]
    tail += ["--async"] if args["async"] else []
    tail += [arg for peer in args["peers"] for arg in ("--peer", peer)]
    results = [_on_simulated_hosts(parser, ns, tail, {}) for _ in range(ns.repeat)]
    result, layout, rate, link_bytes_per_s = results[0]
    if ns.repeat > 1:
        result = {
            "records": collectives.merge_runs([r[0]["records"] for r in results]),
            "memcpy_gbps": max(r[0]["memcpy_gbps"] for r in results),
        }
    _print_results(ns, result, link_bytes_per_s)
    return {**result, "layout": layout, "link": rate, "link_bytes_per_s": link_bytes_per_s}


def _on_simulated_hosts(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, tail: list[str], env: dict[str, str]
) -> tuple[object, list[int], str | None, float | None]:
    """Start the ranks on the simulated hosts of ``--hosts``, each running
    this bench with ``tail`` from its environment (plus ``env``); rank 0's
    results as it wrote them, the layout, the link's rate and its bytes per
    second."""
    layout = _layout(parser, ns.hosts)
    link = ns.link or "1gbit"
    rate = None if link.lower() == "none" else link
    _rate(parser, "--link", rate)
    if ns.world:
        parser.error("--world: with --hosts the world is the layout's")
    if ns.link_rate:
        parser.error("--link-rate is for runs under torchrun; with --hosts the rate is --link's")
    if ns.device != "cpu":
        parser.error("--hosts runs on the CPU")
    try:
        netns.check_prerequisites()
    except RuntimeError as exc:
        raise SystemExit(f"python -m torch_groupcomm.bench --hosts: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="gcbench-") as tmp:
        result_path = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "torch_groupcomm.bench", *tail, "--result", str(result_path)]
        with netns.SimulatedHosts(layout, rate) as hosts:
            procs = hosts.launch(argv, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, log_dir=tmp)
            codes = _wait_ranks(procs, Path(tmp) / "rank0.log")
            if codes != [0] * len(procs) or not result_path.exists():
                for rank, code in enumerate(codes):
                    if code != 0:
                        log = (Path(tmp) / f"rank{rank}.log").read_text(errors="replace")
                        sys.stderr.write(f"--- rank {rank} (host {hosts.placement()[rank][0]}) ---\n{log[-3000:]}\n")
                raise SystemExit(
                    f"python -m torch_groupcomm.bench --hosts: ranks' exit codes {codes} "
                    f"(None: killed {FAILED_RANK_GRACE_S:.0f} s after another rank failed)"
                )
            return json.loads(result_path.read_text()), layout, rate, hosts.link_bytes_per_s


def _wait_ranks(procs: list, rank0_log: Path) -> list[int | None]:
    """Wait for the ranks, copying rank 0's log (its progress bar) to our
    stderr. Once one has failed, the others get FAILED_RANK_GRACE_S to
    exit before they are killed. Each rank's exit code (None: killed)."""
    copied = 0
    failed_at = None

    def copy_log() -> int:
        with open(rank0_log, "rb") as f:
            f.seek(copied)
            text = f.read()
        sys.stderr.write(text.decode(errors="replace"))
        sys.stderr.flush()
        return copied + len(text)

    while True:
        copied = copy_log()
        codes = [p.poll() for p in procs]
        if None not in codes:
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
            break
        time.sleep(0.2)
    codes = netns.wait_all(procs, 0)
    copy_log()
    return codes


if __name__ == "__main__":
    main()
