"""Tensor-parallel decoding: tokens per second of a small Llama-style decoder
(``decoder.py``) sharded over the ranks, compiled with
``torch.compile(fullgraph=True)``, generating greedily at each batch size,
with each backend's all-reduce in the same processes, in alternating rounds.

The decoders differ only in the all-reduce they were built with:

- ``groupcomm``: ``GroupCoordinator.all_reduce`` of the ``groupcomm`` default
  group (the custom op ``torch.ops.groupcomm.all_reduce``, which the compiled
  graph calls straight into the shared-memory engine);
- ``gloo``: torch's functional all-reduce (``_functional_collectives``, what
  torch's own tensor parallelism traces) over a gloo group of the same ranks;
- ``deepspeed`` (``--peer deepspeed``): ``torch.ops.deepspeed.inference_all_reduce``,
  the out-of-place form of the shared-memory op behind DeepSpeed's
  ``inference_all_reduce`` (what its CPU AutoTP inference calls); it has a
  meta kernel, so it compiles into the graph as well;
- ``floor``: no all-reduce at all (each rank keeps its partial sums): what
  the decoding costs without communication. Its tokens differ, and its ranks
  never wait for each other, so it shows the slowest rank's pace.

Every round generates the same tokens from the same prompt; the tokens of the
communicating backends must be equal to each other, round after round and on
every rank (the bench fails otherwise).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable

import torch

from . import decoder
from .ranks import join, spawn

WORKLOAD = "tp-decode"
PROMPT_TOKENS = 8
# Backends whose ranks never wait for each other: the table shows the slowest rank's pace.
UNSYNCHRONIZED = ("floor",)


def _functional_all_reduce(group) -> decoder.AllReduce:
    import torch.distributed._functional_collectives as funcol

    return lambda x: funcol.all_reduce(x, "sum", group)


def _deepspeed_all_reduce(world: int, dtype: torch.dtype) -> decoder.AllReduce:
    """DeepSpeed's out-of-place shared-memory all-reduce, started over the
    already initialised world; refused where DeepSpeed itself would fall back
    to torch.distributed (its kernel needs AVX2 for fp32, AVX-512BW for 16-bit)."""
    from .collectives import start_deepspeed

    start_deepspeed(world)
    import deepspeed.comm
    from deepspeed.comm import comm as ds_comm

    deepspeed.comm.inference_all_reduce(torch.ones(1, dtype=dtype))  # builds and loads its op
    level = getattr(ds_comm.cdb, "shm_vector_kernel_level", 0)
    needed = 1 if dtype == torch.float32 else 2
    if not hasattr(torch.ops.deepspeed, "inference_all_reduce") or level < needed:
        raise SystemExit(
            f"--peer deepspeed: DeepSpeed's shared-memory all-reduce is not usable for {dtype} here "
            f"(its kernel level {level}, needs {needed}); it would fall back to torch.distributed"
        )
    return torch.ops.deepspeed.inference_all_reduce


def _all_reduces(rank: int, world: int, args: dict) -> dict[str, decoder.AllReduce]:
    import torch.distributed as dist

    from .._registry import get_coordinator

    reduces: dict[str, decoder.AllReduce] = {
        "groupcomm": get_coordinator(dist.group.WORLD).all_reduce,
        "gloo": _functional_all_reduce(dist.new_group(backend="gloo")),
    }
    if "deepspeed" in args["peers"]:
        os.environ["RANK"] = str(rank)
        reduces["deepspeed"] = _deepspeed_all_reduce(world, getattr(torch, args["dtype"]))
    reduces["floor"] = lambda x: x
    return reduces


def _config(args: dict) -> decoder.DecoderConfig:
    """The stated decoder, its cache long enough for the prompt and the new tokens."""
    config = decoder.DECODERS[args["decoder"]]
    return dataclasses.replace(config, max_seq=max(config.max_seq, PROMPT_TOKENS + args["tokens"]))


def _rank(rank: int, world: int, port: int, args: dict, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # inductor's pool of compile workers would only fight the ranks for the cores
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)
    import torch._dynamo.config as dynamo_config
    import torch.distributed as dist

    # one forward, compiled once per backend and batch size (each decoder its own graph)
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    try:
        sync = join(rank, world, port, timedelta(seconds=600))
        reduces = _all_reduces(rank, world, args)
        weights = decoder.ShardedWeights(_config(args), rank, world, getattr(torch, args["dtype"]))
        records = [_batch(rank, world, batch, weights, reduces, args, sync) for batch in args["batches"]]
        dist.destroy_process_group()
        conn.send(("ok", records))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        conn.send(("error", f"rank {rank}: {exc}\n{traceback.format_exc()}"))


def _batch(rank: int, world: int, batch: int, weights, reduces: dict, args: dict, sync) -> dict:
    """Compile (or not) one decoder per backend at ``batch``, generate once
    untimed, then time ``rounds`` alternating rounds; the record of rank 0."""
    import torch.distributed as dist

    steps: dict[str, Callable] = {}
    for name, all_reduce in reduces.items():
        module = decoder.TPDecoder(weights, batch, all_reduce)
        steps[name] = torch.compile(module, fullgraph=True, dynamic=False) if args["compile"] else module
    prompt = decoder.prompt(batch, PROMPT_TOKENS, weights.config.vocab)
    reference: dict[str, torch.Tensor] = {}
    compile_s: dict[str, float] = {}
    for name, step in steps.items():  # the first generation compiles
        dist.barrier(group=sync)
        start = time.perf_counter()
        reference[name], _ = decoder.generate(step, prompt, args["tokens"])
        compile_s[name] = time.perf_counter() - start
    samples: dict[str, list[float]] = {name: [] for name in steps}
    repeatable = True
    for round_ in range(args["rounds"]):
        order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
        for name in order:
            dist.barrier(group=sync)
            tokens, seconds = decoder.generate(steps[name], prompt, args["tokens"])
            samples[name].append(seconds)
            repeatable &= torch.equal(tokens, reference[name])
    rate = {name: batch * args["tokens"] / statistics.median(s) for name, s in samples.items()}
    digests = {name: decoder.digest(tokens) for name, tokens in reference.items()}
    seen: list = [None] * world
    dist.all_gather_object(seen, (rate, digests, repeatable), group=sync)
    for name in UNSYNCHRONIZED:
        rate[name] = min(r[name] for r, _, _ in seen)
    communicating = [name for name in steps if name not in UNSYNCHRONIZED]
    equal = all(d[name] == digests["groupcomm"] for _, d, _ in seen for name in communicating)
    if rank == 0:
        sys.stderr.write(f"  world {world} batch {batch} done\n")
    return {
        "workload": WORKLOAD,
        "decoder": args["decoder"],
        "dtype": args["dtype"],
        "world": world,
        "batch": batch,
        "tokens": args["tokens"],
        "compiled": args["compile"],
        "tokens_per_s": rate,
        "first_generation_s": compile_s,
        "digests": digests,
        "equal": equal and all(r for _, _, r in seen),
    }


def run(world: int, args: dict) -> list[dict]:
    """Every batch size of ``args`` on ``world`` fresh ranks; rank 0's records."""
    return spawn(_rank, world, args)


def describe(args: dict) -> str:
    """The preamble line: what was run and how it was timed."""
    config = _config(args)
    how = "torch.compile(fullgraph=True)" if args["compile"] else "eager (--no-compile)"
    return (
        f"decoder: {args['decoder']}: {config.describe()}, {args['dtype']}, {how}; greedy, prompt "
        f"{PROMPT_TOKENS} tokens, {args['tokens']} new per round; median tokens/s on rank 0 "
        f"(floor: the slowest rank's) over {args['rounds']} alternating rounds"
    )


def format_table(records: list[dict]) -> str:
    """Tokens per second per batch and backend, each backend's ratio to gloo
    (and to DeepSpeed where it ran), the digest of the generated tokens; then
    whether the communicating backends generated the same tokens."""
    peers = ["deepspeed"] if any("deepspeed" in r["tokens_per_s"] for r in records) else []
    header = f"{'world':>5} {'batch':>5} {'backend':<10} {'tokens/s':>9} {'ms/step':>8} {'vs gloo':>8}"
    header += "".join(f" {'vs ' + p:>12}" for p in peers) + f" {'digest':>13}"
    lines = [header]
    for r in records:
        rate = r["tokens_per_s"]
        for name, tokens_per_s in rate.items():
            line = (
                f"{r['world']:>5} {r['batch']:>5} {name:<10} {tokens_per_s:>9.1f} "
                f"{1e3 * r['batch'] / tokens_per_s:>8.2f} {tokens_per_s / rate['gloo']:>7.2f}x"
            )
            line += "".join(f" {tokens_per_s / rate[p]:>11.2f}x" for p in peers)
            lines.append(line + f" {r['digests'][name]:>13}")
    same = all(r["equal"] for r in records)
    backends = [name for name in records[0]["tokens_per_s"] if name not in UNSYNCHRONIZED] if records else []
    lines.append(
        f"# tokens identical on {', '.join(backends)}, on every rank and round: {'yes' if same else 'NO'}"
        + ("" if same else " (see the digests)")
    )
    return "\n".join(lines)
