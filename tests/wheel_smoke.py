"""Smoke test of an installed wheel, run from outside the checkout.

    python tests/wheel_smoke.py [--world 2] [--timeout 120]

CI builds the wheel, installs it into a fresh virtual environment and runs
this file with that environment's python from a temporary directory, so the
package comes from site-packages, as a user gets it: a module, the compiled
extension or the entry point missing from the wheel fails here. The ranks
never import torch_groupcomm themselves: torch finds the backend through the
installed entry point. Each rank runs the common collectives and send/recv
against closed-form values; the parent checks the version metadata and that
nothing is left in /dev/shm. Prints one closing line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing
import os
import sys
import tempfile
import traceback
from datetime import timedelta

from _harness import shm_segments  # the tests' own check (this file's folder is on sys.path)


def collectives(rank: int, world: int) -> int:
    """Runs the checks on one rank; returns how many passed (raises on a wrong value)."""
    import torch
    import torch.distributed as dist

    checks = 0

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        nonlocal checks
        if not torch.equal(got, want):
            raise AssertionError(f"rank {rank}: {what}: got {got.flatten()[:8]}, want {want.flatten()[:8]}")
        checks += 1

    every = sum(range(1, world + 1))
    for numel in (2, 1 << 20):  # one small, one large (4 MiB) message
        x = torch.full((numel,), float(rank + 1))
        dist.all_reduce(x)
        same(x, torch.full((numel,), float(every)), f"all_reduce of {numel}")
    x = torch.full((1000,), float(rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    same(x, torch.full((1000,), float(world), dtype=torch.bfloat16), "all_reduce MAX bf16")
    x = torch.tensor([rank + 1], dtype=torch.int64)
    work = dist.all_reduce(x, op=dist.ReduceOp.BXOR, async_op=True)
    work.wait()
    want = 0
    for r in range(1, world + 1):
        want ^= r
    same(x, torch.tensor([want]), "async all_reduce BXOR")

    out = torch.empty(world * 3)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    same(out, torch.arange(world).repeat_interleave(3).float(), "all_gather_into_tensor")
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, torch.arange(world * 3, dtype=torch.float32))
    same(out, torch.arange(rank * 3, rank * 3 + 3).float() * world, "reduce_scatter_tensor")
    x = torch.full((5,), float(rank))
    dist.broadcast(x, src=world - 1)
    same(x, torch.full((5,), float(world - 1)), "broadcast")
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + 10 * rank)
    same(out, torch.arange(world, dtype=torch.float32) * 10 + rank, "all_to_all_single")
    if world > 1:
        peer = (rank + 1) % world
        send = dist.isend(torch.full((4,), float(rank)), dst=peer)
        got = torch.empty(4)
        dist.recv(got, src=(rank - 1) % world)
        send.wait()
        same(got, torch.full((4,), float((rank - 1) % world)), "send/recv ring")
    dist.barrier()
    return checks


def rank_main(rank: int, world: int, store_path: str, timeout_s: float, results) -> None:
    """One rank: a groupcomm default group over a FileStore, the checks, teardown."""
    try:
        import torch.distributed as dist

        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "groupcomm", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        checks = collectives(rank, world)
        module = sys.modules.get("torch_groupcomm")
        dist.destroy_process_group()
        results.put((rank, checks, getattr(module, "__file__", None), None))
    except BaseException:
        results.put((rank, 0, None, traceback.format_exc()))
        raise SystemExit(1) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds the ranks may take (default 120)")
    args = parser.parse_args()

    import torch

    import torch_groupcomm

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    where = os.path.dirname(os.path.abspath(torch_groupcomm.__file__))
    if where == os.path.join(checkout, "torch_groupcomm"):
        print(f"wheel smoke: torch_groupcomm imported from the checkout ({where}), not an installed wheel")
        return 1
    metadata = importlib.metadata.version("torch_groupcomm")
    if metadata != torch_groupcomm.__version__ or "+torch" not in metadata:
        print(f"wheel smoke: version {torch_groupcomm.__version__!r} against metadata {metadata!r}")
        return 1

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        store_path = os.path.join(scratch, "store")
        ranks = [
            context.Process(target=rank_main, args=(r, args.world, store_path, args.timeout, results))
            for r in range(args.world)
        ]
        for process in ranks:
            process.start()
        reports = {}
        failure = None
        try:
            for _ in range(args.world):
                rank, checks, module_file, error = results.get(timeout=args.timeout)
                reports[rank] = (checks, module_file)
                if error is not None:
                    failure = f"rank {rank} failed:\n{error}"
                    break
        except Exception:
            failure = f"ranks {sorted(set(range(args.world)) - set(reports))} gave no result in {args.timeout} s"
        for process in ranks:
            process.join(timeout=10 if failure is None else 1)
            if process.is_alive():
                process.kill()
                process.join()
    if failure is None:
        codes = [p.exitcode for p in ranks]
        if any(codes):
            failure = f"rank exit codes {codes}"
        elif any(not (f or "").startswith(where) for _, f in reports.values()):
            failure = f"a rank did not use the installed package: {[f for _, f in reports.values()]}"
        elif shm_segments():
            failure = f"segments left in /dev/shm: {shm_segments()}"
    if failure is not None:
        print(f"wheel smoke: FAILED: {failure}")
        return 1
    checks = sum(c for c, _ in reports.values())
    print(
        f"wheel smoke: torch_groupcomm {metadata} on torch {torch.__version__} from {where}: "
        f"{checks} checks on {args.world} ranks, /dev/shm clean"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
