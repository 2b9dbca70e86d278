"""torchft (fault-tolerant DDP across replica groups) on the ``groupcomm`` backend (CPU, 2 processes).

    python examples/frameworks/torchft_train.py [--backend gloo] [--steps 5]

torchft does not take a backend name: its ``Manager`` is handed a
reconfigurable process group object (``torchft.ProcessGroupGloo``,
``ProcessGroupNCCL``, ...), which it re-forms on a fresh store prefix every
time the quorum changes by calling the object's ``_create_pg(store, rank,
world_size)``. ``ProcessGroupBackend`` below is such an object for any
backend registered with ``torch.distributed.Backend.register_backend``: it
builds the backend the way ``init_process_group`` does, through the plugin's
creator. ``Manager(pg=ProcessGroupBackend("groupcomm"), ...)`` is the
selection; ``--backend gloo`` uses torchft's own ``ProcessGroupGloo``.
torch's backend autoload registers groupcomm at ``import torch``, so the
script does not import torch_groupcomm.

The script starts torchft's lighthouse and two replica groups of one process
each (what ``torchft_lighthouse`` plus a torchrun per replica group would
be); they train a 2-layer MLP on fixed random data (seed 0), each on its half,
with ``torchft.DistributedDataParallel`` and ``torchft.Optimizer``. Replica 0
reports the loss of the final model on the whole data set, the sum of its
parameters and a digest of their bytes, printed as one result line. Run it
with ``--backend gloo`` too: the two lines should be the same apart from the
backend's name.
"""

import argparse
import multiprocessing as mp
import os
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at "info"

import torch
import torch.distributed as dist
import torch.nn as nn
import torchft
from torch._C._distributed_c10d import _DistributedBackendOptions
from torch.distributed import ProcessGroup as BaseProcessGroup
from torchft._torchft import LighthouseServer
from torchft.process_group import ProcessGroupWrapper
from toy import fingerprint, make_data, make_model, result_line


class ProcessGroupBackend(ProcessGroupWrapper):
    """A torchft process group on a registered torch.distributed backend plugin."""

    def __init__(self, backend: str, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._backend = backend

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> BaseProcessGroup:
        plugin = dist.Backend._plugins[self._backend.upper()]
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
        options = _DistributedBackendOptions()
        options.store = store
        options.group_rank = rank
        options.group_size = world_size
        options.timeout = self._timeout
        # the same name on every member: one group per quorum
        options.group_id = f"torchft_{self._backend}_quorum_{self._quorum_id}"
        options.global_ranks_in_group = list(range(world_size))
        backend = (
            plugin.creator_fn(options, None)
            if plugin.extended_api
            else plugin.creator_fn(store, rank, world_size, self._timeout)
        )
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.CUSTOM, backend)
        return pg

    def getBackendName(self) -> str:
        return f"torchft-{self._backend}"


def replica(index: int, replicas: int, backend: str, steps: int, lighthouse: str, results) -> None:
    """One replica group (of one process): trains under torchft's manager."""
    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    # The selection: the process group object handed to the manager.
    pg = torchft.ProcessGroupGloo() if backend == "gloo" else ProcessGroupBackend(backend)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=replicas,
        use_async_quorum=False,
        load_state_dict=lambda state: (
            model.load_state_dict(state["model"]),
            optimizer.load_state_dict(state["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"replica_{index}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timedelta(seconds=60),
    )
    try:
        ddp = torchft.DistributedDataParallel(manager, model)
        opt = torchft.Optimizer(manager, optimizer)
        data = make_data()
        x_all, y_all = data.tensors
        mine = torch.arange(index, len(data), replicas)  # this replica group's half
        batches = [mine[i : i + 16] for i in range(0, len(mine), 16)]
        while manager.current_step() < steps:
            rows = batches[manager.current_step() % len(batches)]
            opt.zero_grad()  # starts the quorum (torchft re-forms the group if it changed)
            nn.functional.mse_loss(ddp(x_all[rows]), y_all[rows]).backward()
            opt.step()  # commits only if every replica's allreduce succeeded
        if index == 0:
            with torch.no_grad():
                loss = nn.functional.mse_loss(model(x_all), y_all).item()
            results.put(
                {
                    "steps": manager.current_step(),
                    "replicas": manager.num_participants(),
                    "loss": loss,
                    "pg": pg.getBackendName(),
                    "fingerprint": fingerprint(model),
                }
            )
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="groupcomm", help="torch.distributed backend (default: groupcomm)")
    parser.add_argument("--steps", type=int, default=5, help="committed optimizer steps (default: 5)")
    parser.add_argument("--replicas", type=int, default=2, help="replica groups, one process each (default: 2)")
    args = parser.parse_args()

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=replica, args=(i, args.replicas, args.backend, args.steps, lighthouse.address(), results))
        for i in range(args.replicas)
    ]
    for proc in procs:
        proc.start()
    try:
        result = results.get(timeout=180)
    finally:
        for proc in procs:
            proc.join(timeout=60)
        lighthouse.shutdown()
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if failed:
        raise SystemExit(f"replica processes exited with {failed}")
    print(f"torchft process group: {result['pg']}", flush=True)
    line = result_line(
        "torchft ddp", args.backend, result["replicas"], result["steps"], result["loss"], result["fingerprint"]
    )
    print(line, flush=True)


if __name__ == "__main__":
    main()
