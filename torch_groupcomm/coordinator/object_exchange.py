"""Objects, dicts of tensors and message queues between a group's ranks: the
part of vLLM's coordinator API built on the group's tensor primitives.

``GroupCoordinator`` inherits it; everything here goes through the
coordinator's communicators and op queue (``communicator_for``,
``p2p_communicator_for``, ``_run``), in order with the group's other calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import tensor_dict as td
from ..staging import flat

MQ_CHUNK_BYTES = 1 << 22
MQ_CHUNKS = 6


class ObjectExchange:
    """Picklable objects, tensor dicts and message-queue broadcasters over a
    coordinator's group (a base of ``GroupCoordinator``)."""

    # -- objects -----------------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank (through the message queue when the
        coordinator has one and ``src`` is its writer)."""
        self._check_rank("broadcast_object src", src)
        if self.world_size == 1:
            return obj
        if self.mq_broadcaster is not None and src == 0:
            return self.mq_broadcaster.broadcast_object(obj)
        return self._broadcast_object_cpu(obj, src)

    def _broadcast_object_cpu(self, obj: Any, src: int) -> Any:
        comm = self.communicator_for(torch.device("cpu"))

        def task() -> Any:
            payload = td.to_bytes(obj) if self.rank_in_group == src else None
            length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
            comm.broadcast_(length, src)
            if payload is None:
                payload = torch.empty(int(length.item()), dtype=torch.uint8)
            comm.broadcast_(payload, src)
            return obj if self.rank_in_group == src else td.from_bytes(payload)

        return self._run(task)

    def broadcast_object_list(self, obj_list: list[Any], src: int = 0, group: Any | None = None) -> list[Any]:
        """Replace ``obj_list``'s items by ``src``'s, in place (torch's
        ``broadcast_object_list`` over ``group`` when one is given)."""
        self._check_rank("broadcast_object_list src", src)
        if group is not None:
            dist.broadcast_object_list(obj_list, group_src=src, group=group)
            return obj_list
        received = self.broadcast_object(list(obj_list) if self.rank_in_group == src else None, src)
        if len(received) != len(obj_list):
            raise ValueError(
                f"groupcomm: broadcast_object_list got {len(received)} objects from rank {src}, "
                f"but the local list holds {len(obj_list)}"
            )
        obj_list[:] = received
        return obj_list

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        comm = self.communicator_for(torch.device("cpu"))

        def task() -> list[Any]:
            payload = td.to_bytes(obj)
            lengths = torch.empty(self.world_size, dtype=torch.int64)
            comm.all_gather_into(lengths, torch.tensor([payload.numel()], dtype=torch.int64))
            sizes = lengths.tolist()
            gathered = torch.empty(sum(sizes), dtype=torch.uint8)
            comm.all_gatherv_into(gathered, payload, sizes)
            return [td.from_bytes(part) for part in gathered.split(sizes)]

        return self._run(task)

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object to ``dst`` (a rank in the group)."""
        self._check_peer("send_object dst", dst)
        comm = self.p2p_communicator_for(torch.device("cpu"))

        def task() -> None:
            payload = td.to_bytes(obj)
            comm.send(torch.tensor([payload.numel()], dtype=torch.int64), dst)
            comm.send(payload, dst)

        self._run(task)

    def recv_object(self, src: int) -> Any:
        """The object ``src`` (a rank in the group) sent with ``send_object``."""
        self._check_peer("recv_object src", src)
        comm = self.p2p_communicator_for(torch.device("cpu"))

        def task() -> Any:
            length = comm.recv(torch.Size([1]), torch.int64, src)
            return td.from_bytes(comm.recv(torch.Size([int(length.item())]), torch.uint8, src))

        return self._run(task)

    # -- tensor dicts ------------------------------------------------------------------------

    def broadcast_tensor_dict(
        self,
        tensor_dict: dict[str, Any] | None = None,
        src: int = 0,
        group: Any | None = None,
        metadata_group: Any | None = None,
    ) -> dict[str, Any] | None:
        """``src``'s dict of tensors and plain values on every rank: the
        description goes as one object (message queue when there is one),
        then each tensor over its device's communicator. ``group`` and
        ``metadata_group`` are accepted for vLLM compatibility; this
        coordinator's own groups carry the data."""
        self._check_rank("broadcast_tensor_dict src", src)
        if self.world_size == 1:
            return tensor_dict
        if self.rank_in_group == src:
            entries, tensors = td.split_tensor_dict(tensor_dict)
            self.broadcast_object(entries, src)
            for _, tensor in tensors:
                if tensor.numel():
                    self._bcast_tensor(tensor, src)
            return tensor_dict
        entries = self.broadcast_object(None, src)
        result: dict[str, Any] = {}
        for key, value in entries:
            if isinstance(value, td.TensorMetadata):
                tensor = td.allocate(value, self.device)
                if tensor.numel():
                    self._bcast_tensor(tensor, src)
                value = tensor
            result[key] = value
        return result

    def _bcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        comm = self.communicator_for(tensor.device)
        self._run(lambda: comm.broadcast_(flat(tensor), src))

    def _use_all_gather(self, key: str, numel: int, all_gather_group, all_gather_tensors) -> bool:
        default = all_gather_group is not None and numel % all_gather_group.world_size == 0
        if all_gather_tensors is not None and key in all_gather_tensors:
            return (
                bool(all_gather_tensors[key])
                and all_gather_group is not None
                and numel % all_gather_group.world_size == 0
            )
        return default

    def send_tensor_dict(
        self,
        tensor_dict: dict[str, Any],
        dst: int | None = None,
        all_gather_group: Any | None = None,
        all_gather_tensors: dict[str, bool] | None = None,
    ) -> dict[str, Any] | None:
        """Send a dict of tensors and plain values to ``dst`` (default: the
        next rank). With ``all_gather_group`` (a coordinator whose ranks all
        hold the same tensors, e.g. tensor parallel), each of them sends only
        its slice of every tensor that divides evenly and the receivers'
        group all-gathers it back; ``all_gather_tensors`` turns that on or off
        per key."""
        if self.world_size == 1:
            return tensor_dict
        dst = self._check_peer(
            "send_tensor_dict dst", (self.rank_in_group + 1) % self.world_size if dst is None else dst
        )
        entries, tensors = td.split_tensor_dict(tensor_dict)
        self.send_object(entries, dst)
        for key, tensor in tensors:
            if not tensor.numel():
                continue
            if self._use_all_gather(key, tensor.numel(), all_gather_group, all_gather_tensors):
                tensor = tensor.reshape(all_gather_group.world_size, -1)[all_gather_group.rank_in_group]
            self.send(tensor.contiguous(), dst)
        return None

    def recv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: Any | None = None,
        all_gather_tensors: dict[str, bool] | None = None,
    ) -> dict[str, Any] | None:
        """The dict ``src`` (default: the previous rank) sent with
        ``send_tensor_dict``; pass the same ``all_gather_group`` settings."""
        if self.world_size == 1:
            return None
        src = self._check_peer(
            "recv_tensor_dict src", (self.rank_in_group - 1) % self.world_size if src is None else src
        )
        entries = self.recv_object(src)
        result: dict[str, Any] = {}
        for key, value in entries:
            if isinstance(value, td.TensorMetadata):
                tensor = td.allocate(value, self.device)
                if tensor.numel():
                    if self._use_all_gather(key, tensor.numel(), all_gather_group, all_gather_tensors):
                        part = self.recv(torch.Size([tensor.numel() // all_gather_group.world_size]), tensor.dtype, src)
                        tensor = all_gather_group.all_gather(part, dim=0).reshape(value.size)
                    else:
                        tensor = self.recv(value.size, value.dtype, src)
                value = tensor
            result[key] = value
        return result

    # -- message queues ----------------------------------------------------------------------

    def create_mq_broadcaster(self, writer_rank: int = 0, external_writer_handle: Any = None, blocking: bool = True):
        """A shared-memory MessageQueue from ``writer_rank`` to every other
        rank (readers on other hosts over TCP); collective. With
        ``external_writer_handle`` every rank joins that writer's queue as a
        reader instead."""
        from ..message_queue import MessageQueue

        if external_writer_handle is not None:
            return MessageQueue.create_from_handle(external_writer_handle, self.rank_in_group)
        self._check_rank("create_mq_broadcaster writer_rank", writer_rank)
        return MessageQueue.create_from_process_group(
            _ObjectChannel(self), MQ_CHUNK_BYTES, MQ_CHUNKS, writer_rank=writer_rank, blocking=blocking
        )

    def create_single_reader_mq_broadcasters(self, reader_rank_in_group: int = 0, blocking: bool = False):
        """Every rank writes its own queue that only ``reader_rank_in_group``
        reads: returns (this rank's writer queue, the reader's queues on the
        reader rank and [] elsewhere). (None, []) for a group of one."""
        self._check_rank("create_single_reader_mq_broadcasters reader_rank_in_group", reader_rank_in_group)
        if self.world_size == 1:
            return None, []
        from ..message_queue import MessageQueue

        return MessageQueue.create_from_process_group_single_reader(
            _ObjectChannel(self), MQ_CHUNK_BYTES, MQ_CHUNKS, reader_rank=reader_rank_in_group, blocking=blocking
        )


class _ObjectChannel:
    """The object-exchange interface MessageQueue builds on (the one a
    StatelessProcessGroup has), served by a coordinator's own CPU path."""

    def __init__(self, coordinator: ObjectExchange) -> None:
        self._coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.world_size = coordinator.world_size

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        return self._coordinator._broadcast_object_cpu(obj, src)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return self._coordinator.all_gather_object(obj)

    def barrier(self) -> None:
        self._coordinator.barrier()
