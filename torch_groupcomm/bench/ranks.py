"""Starting a benchmark's ranks: fresh processes on 127.0.0.1, each sending
back ``("ok", payload)`` or ``("error", text)`` through a pipe; and, inside a
rank, its default group and the groups the benchmarks time beside it."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import socket
from datetime import timedelta
from typing import Any, Callable


def spawn(target: Callable[..., None], world: int, args: dict) -> Any:
    """Run ``target(rank, world, port, args, conn)`` on ``world`` new ranks;
    return rank 0's payload, or raise with every rank's error."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(rank, world, port, args, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
    errors = [payload for status, payload in results if status != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return results[0][1]


def join(rank: int, world: int, port: int | None, timeout: timedelta) -> Any:
    """This rank's ``groupcomm`` default group on 127.0.0.1:``port`` (None:
    the environment's rendezvous, torchrun's or a simulated host's); returns
    the gloo group that keeps the timed rounds in step. The benchmarks time
    other groups: one whose connections carried the barrier just before a
    round would start it warm."""
    import torch.distributed as dist

    import torch_groupcomm  # noqa: F401  (registers the backend on any torch)

    init_method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("groupcomm", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(backend="gloo")


def fake_group() -> Any | None:
    """A group on torch's no-op ``fake`` backend (its collectives return at
    once, moving nothing), or None where this torch does not ship it."""
    import torch.distributed as dist

    try:
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers "fake"
    except ImportError:
        return None
    return dist.new_group(backend="fake")
