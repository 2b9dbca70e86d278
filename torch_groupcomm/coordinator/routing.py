"""Which communicator carries a coordinator's calls on each device: the
routing decision, made once per group and device by the first call there.

CPU routing: ranks on one host use shared memory; a group spanning hosts uses
shared memory inside each host and gloo between hosts; ``GROUPCOMM_CPU_COMMUNICATOR``
can force ``gloo`` or ``shm``. CPU point-to-point traffic goes over the
communicator prepared with the group, or gloo: it is not ordered with
collectives, so it cannot create anything. CUDA tensors go to NCCL (the
communicator object is local; its NCCL communicators are made by the first
collective, or by a pair's first send/recv).
"""

from __future__ import annotations

import torch

from .. import custom_ops
from ..communicators.base import DeviceCommunicatorBase
from ..communicators.transports import Setting, build
from ..topology import discover, host_identity


class Routing:
    """The communicators of a ``GroupCoordinator`` (a base of it): built on
    first use, one per device type, and the op queue every call runs in."""

    def communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator that carries tensors living on ``device``."""
        comm = self._communicators.get(device.type)
        if comm is not None:
            return comm
        if self._destroyed:
            ended_by = f" by {self.ended_by}" if self.ended_by else ""
            raise RuntimeError(f"groupcomm: group {self.unique_name} has been destroyed{ended_by}")
        with self._lock:
            comm = self._communicators.get(device.type)
            if comm is None:
                comm = self._make_communicator(device)
                self._communicators[device.type] = comm
                if device.type == "cpu":
                    custom_ops.publish(self.unique_name, comm.native_engine(), self.ops)
        return comm

    def built_communicator(self, device_type: str) -> DeviceCommunicatorBase | None:
        """The communicator for ``device_type`` if it exists already (None
        otherwise: building one is a collective, which this never starts)."""
        return self._communicators.get(device_type)

    def share_storage(self, tensor: torch.Tensor) -> bool:
        """Move ``tensor``'s storage into memory the group's peers read in
        place, contents kept, as ``Tensor.share_memory_()`` moves it: the
        collectives on it then skip the copy through the shared segment.
        Every view of that storage follows; anything holding its old address
        (``numpy()``, ``data_ptr()``) does not, so call it only on a buffer
        you own. Returns whether the storage now lies there (False: not a
        shared-memory group, not yet used on the CPU, under 64 KiB, or not a
        plain CPU allocation; nothing moved)."""
        comm = self.built_communicator(tensor.device.type)
        return comm is not None and comm.share_storage(tensor)

    def prepare_cpu(self) -> None:
        """Build the CPU communicator now (collective over the group), so that
        send/recv, which are not ordered with collectives, can use it too."""
        self._p2p_cpu = self.communicator_for(torch.device("cpu"))

    def sends_through(self, comm: DeviceCommunicatorBase) -> bool:
        """Whether CPU send/recv go through ``comm`` (it was prepared with the
        group), without settling the choice as ``p2p_communicator_for`` does."""
        return self._p2p_cpu is comm

    def p2p_communicator_for(self, device: torch.device) -> DeviceCommunicatorBase:
        """The communicator for send/recv. Every rank must pick the same one
        whatever it has run so far: the CPU communicator if it was prepared
        when the group was made, otherwise gloo over the cpu_group."""
        if device.type == "cpu":
            if self._p2p_cpu is None:
                self._p2p_cpu = self._gloo()
            return self._p2p_cpu
        return self.communicator_for(device)

    @property
    def device_communicator(self) -> DeviceCommunicatorBase | None:
        """The communicator for this coordinator's device (None for a group of one)."""
        if self.world_size == 1:
            return None
        return self.communicator_for(self.device)

    def _setting(self, **fields) -> Setting:
        self.check_formed()
        return Setting(self.cpu_group, self.store, self.timeout, self.unique_name, self.config, **fields)

    def _gloo(self) -> DeviceCommunicatorBase:
        return build("gloo", self._setting())

    def check_device(self, device: torch.device) -> None:
        """Raise NotImplementedError for a device type no communicator serves."""
        if device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"groupcomm: tensors on device type {device.type!r} are not supported (CPU and CUDA only)"
            )

    def _make_communicator(self, device: torch.device) -> DeviceCommunicatorBase:
        """The routing decision for ``device``: NCCL for CUDA; on the CPU gloo
        when told so (or when the coordinator is asked not to use a device
        communicator), shared memory on one host (gloo if it cannot be
        mapped), hierarchical across hosts (gloo with one rank a host)."""
        self.check_device(device)
        if device.type == "cuda":
            return build("nccl", self._setting(device=device))
        cfg = self.config
        if not self.use_device_communicator or cfg.cpu_communicator == "gloo":
            return self._gloo()
        self.topology = discover(
            self.store, self.rank_in_group, self.world_size, host_identity(cfg.host_id), self.timeout
        )
        if self.topology.single_host or cfg.cpu_communicator == "shm":
            return build("shm", self._setting()) or self._gloo()
        if all(len(ranks) == 1 for ranks in self.topology.hosts):
            return self._gloo()  # nothing to share within a host
        return build("hierarchical", self._setting(topology=self.topology))

    def _run(self, task):
        """Run ``task`` in order with the group's queued c10d work."""
        return self.ops.run(task)
