"""Large messages read straight from the peer's memory (``GROUPCOMM_SHM_DIRECT``):
the same results as through the segment, for every op that takes that path
(all_to_all, scatter, send/recv), with uneven sizes, every root, and sends
that arrive before their receive."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_ranks, shm_segments

MIB = 1 << 20


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _can_read_peers(rank: int, world: int) -> bool:
    """Whether the kernel lets this process read every peer's memory, found
    without the package: each rank shows a token, the others read it."""
    token = ctypes.c_uint64(0x5EED0000 + rank)
    shown = [None] * world
    dist.all_gather_object(shown, (os.getpid(), ctypes.addressof(token), token.value))
    libc = ctypes.CDLL(None, use_errno=True)
    ok = True
    for peer, (pid, address, value) in enumerate(shown):
        if peer != rank:
            seen = ctypes.c_uint64(0)
            local = _IoVec(ctypes.addressof(seen), 8)
            remote = _IoVec(address, 8)
            ok &= libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8
            ok &= seen.value == value
    dist.barrier()  # nobody drops its token before every peer read it
    return ok


def _filled(n: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) % 251 + value).to(dtype)


def check_direct(rank: int, world: int) -> bool:
    from torch_groupcomm import GroupCommError, get_coordinator

    communicator = get_coordinator().communicator_for(torch.device("cpu"))
    assert communicator.name == "shm"
    wanted = os.environ["GROUPCOMM_SHM_DIRECT"] == "1"
    assert communicator.workspace.direct == (wanted and _can_read_peers(rank, world))

    # all_to_all: uneven, every message over 1 MiB, so each rank reads at an
    # offset only the sender's own split sizes give
    elems = [MIB // 4 + 1000 * (rank + 1) + 7 * j for j in range(world)]  # what rank sends to j
    outgoing = torch.cat([_filled(n, 1000 * rank + j) for j, n in enumerate(elems)])
    incoming_sizes = [MIB // 4 + 1000 * (i + 1) + 7 * rank for i in range(world)]
    got = torch.empty(sum(incoming_sizes))
    dist.all_to_all_single(got, outgoing, incoming_sizes, elems)
    assert torch.equal(got, torch.cat([_filled(n, 1000 * i + rank) for i, n in enumerate(incoming_sizes)]))
    outs = [torch.empty(3 * MIB // 8, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, [_filled(3 * MIB // 8, 10 * rank + j, torch.int64) for j in range(world)])
    for i, out in enumerate(outs):
        assert torch.equal(out, _filled(3 * MIB // 8, 10 * i + rank, torch.int64)), i
    # more large all_to_alls than the group's warm-up and trials of both
    # paths (10), after which the ranks' votes pick one: each still
    # delivers, whichever it took
    for call in range(12):
        sends = [MIB // 4 + 513 * (call + 1) * (rank + 1) + 11 * j for j in range(world)]
        receives = [MIB // 4 + 513 * (call + 1) * (i + 1) + 11 * rank for i in range(world)]
        got = torch.empty(sum(receives))
        dist.all_to_all_single(
            got, torch.cat([_filled(n, 100 * call + 10 * rank + j) for j, n in enumerate(sends)]), receives, sends
        )
        assert torch.equal(got, torch.cat([_filled(n, 100 * call + 10 * i + rank) for i, n in enumerate(receives)])), (
            call
        )

    # scatter from every root
    for root in range(world):
        pieces = [_filled(MIB // 2 + 1, 100 * root + r) for r in range(world)] if rank == root else None
        piece = torch.empty(MIB // 2 + 1)
        dist.scatter(piece, pieces, src=root)
        assert torch.equal(piece, _filled(MIB // 2 + 1, 100 * root + rank)), root

    # send/recv around the ring, receives posted in reverse tag order (the
    # first messages wait for their receive, or are taken aside), then one
    # from any source
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    sizes = [MIB // 4 + 11, MIB, 2 * MIB + 5]
    sends = [dist.isend(_filled(s, 10 * rank + t), nxt, tag=t) for t, s in enumerate(sizes)]
    inbox = [torch.empty(s) for s in sizes]
    recvs = [dist.irecv(inbox[t], prv, tag=t) for t in reversed(range(len(sizes)))]
    for work in sends + recvs:
        work.wait()
    for t, got in enumerate(inbox):
        assert torch.equal(got, _filled(sizes[t], 10 * prv + t)), t
    if rank == 0:
        anyone = torch.empty(MIB)
        sources = sorted(dist.recv(anyone) for _ in range(world - 1))
        assert sources == list(range(1, world)), sources
    else:
        dist.send(_filled(MIB, 0), 0)
    dist.barrier()

    # a receive of the wrong size fails, names both sizes, and consumes the
    # message: the next one goes through
    if rank == 1:
        dist.send(_filled(MIB, 1), 0)
        dist.send(_filled(MIB, 2), 0)
    elif rank == 0:
        with pytest.raises(GroupCommError, match=f"recv of {8 * MIB} bytes matched a message of {4 * MIB} bytes"):
            dist.recv(torch.empty(2 * MIB), 1)
        after = torch.empty(MIB)
        dist.recv(after, 1)
        assert torch.equal(after, _filled(MIB, 2))
    dist.barrier()
    return communicator.workspace.direct


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_direct_matches_the_segment(world: int, direct: str) -> None:
    env = {"GROUPCOMM_SHM_DIRECT": direct, "GROUPCOMM_CPU_COMMUNICATOR": "shm"}
    results = run_ranks(check_direct, world, env=env)
    assert len(set(results)) == 1, results
    assert shm_segments() == []
