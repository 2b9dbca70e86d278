"""A communicator that carries CPU tensors over the group's gloo ``cpu_group``.

All-reduce runs gloo's own ring on the typed tensor where gloo has the dtype
and op; everything else travels as raw bytes, so gloo's own dtype and op
limits do not apply: those reductions happen locally (see ``reduction.py``).
This is the portable path: any group, any host layout.

Exchanges between ranks (all-gather, all-to-all, the reduce-scatter built on
it, large broadcasts, gather, scatter) post their large sends after their
receives: gloo reads a pair's socket only into a posted receive, and the
notice of a receive queues behind the data already leaving on that pair, so
a swap whose large sends go first runs one direction at a time (8 MiB each
way between two hosts at 1 Gbit/s: 115 ms sends first, 68 ms receives first,
95 ms through gloo's all-gather, 67 ms the link's bound). Small sends go
first (``_SEND_FIRST_MAX_BYTES``). The C++ bridge runs barrier, broadcast,
gather, scatter, both forms of all_to_all, small all-gathers and the
all-reduces of gloo's dtypes and ops itself with the same messages
(``gloo_path``, ``csrc/bridge/gloo_path.h``), without Python's cost per op;
where this communicator is the group's send/recv transport it also posts
send/recv of dense tensors (as :meth:`GlooCommunicator.isend` would) and
completes them on the frontend's completion queue.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
from torch._C import _distributed_c10d as c10d

from ..errors import CommTimeoutError, GroupCommError
from ..reduction import Kind, Reduction, WirePlan, divide_, fold_pair, reduce_stacked, wire_plan
from ..staging import as_bytes
from .base import DeviceCommunicatorBase, DoneTransfer, Transfer, even_pieces

ABORTED = "groupcomm: gloo group aborted"

# The tag of the collectives' own sends and receives: far above the tags
# users give ``dist.send``, so that their posted receives never match ours.
COLLECTIVE_TAG = 0x7E000000
# All-reduces that put at most this many bytes on a rank's link as an
# all-gather gather and reduce locally; larger ones take gloo's ring.
_GATHER_REDUCE_BYTES = 256 << 10
# All-gathers of this many bytes or more among three or more ranks go around
# the ring (one stream on each link) rather than to every peer at once.
_RING_MIN_BYTES = 1 << 20
# Broadcasts and reduces of this many bytes or more among three or more ranks
# travel down a chain in pieces (each rank forwards a piece while the next
# arrives), so that no link carries the tensor twice; gloo's own broadcast is
# a binomial tree, whose root sends the whole tensor to ceil(log2(world))
# ranks (twice among 3 or 4), and a gather brings every rank's to the root.
# Between two ranks a broadcast is one send and one receive posted from the
# caller's thread, where gloo's broadcast makes the same transfer from its
# worker thread: 2 hosts at 10 Gbit/s, 64 KiB, 93-114 us (1.1x-1.5x gloo's
# speed in 7 runs) against 123-217 us through gloo's broadcast; at 1 Gbit/s
# both take 1.04x-1.05x the link's bound from 64 KiB to 16 MiB.
_CHAIN_MIN_BYTES = 32 << 10
# A chain plans two halves up to 1 MiB, from there pieces of 512 KiB, and
# from 8 MiB _CHAIN_PIECES: every rank must wake for each piece, which costs
# more than the overlap gains on small ones (4 hosts of 1 rank at 10 Gbit/s,
# 64 KiB in 4 pieces 0.8x gloo's speed, in 2 1.4x-1.5x), while two halves
# already cut a chain of H hops from H to (H+1)/2 times one transfer
# (1 Gbit/s, 64 KiB in 1 piece: 1.0x-2.2x gloo, in 2 1.8x). Whether the
# planned pieces beat one depends on the hosts more than on the size, so a
# broadcast's first calls of each size class from 1 MiB time both
# (_C.Tuner): 4 hosts of 1 rank on 2 vCPUs, 1 MiB, keep two halves at
# 1 Gbit/s (2.0x gloo, 1.8x in one piece) and one piece at 10 Gbit/s
# (1.0x-1.1x, 0.9x in two, three or four). A reduce goes down the chain from
# 32 KiB rather than gathered below 1 MiB: 1 Gbit/s 256 KiB 0.6x -> 1.7x-1.8x
# gloo's speed (1.05x the link's bound); its pieces are the planned ones.
_CHAIN_PIECE_BYTES = 512 << 10
_CHAIN_PIECES = 16
# An all-reduce among 3+ ranks of at least _TUNED_ALL_REDUCE_MIN_BYTES and
# less than _TUNED_ALL_REDUCE_MAX_BYTES times gloo's ring against two
# exchanges (_start_direct_all_reduce) on its first calls of each size class,
# and the ranks keep the faster. 4 hosts of 1 rank, `bench --ops all_reduce`:
# at 10 Gbit/s, where two cores are the limit, the chosen exchanges read
# 1.2x-1.5x gloo at 1 MiB and 1.1x at 2 MiB (the ring 0.95x-1.0x); at
# 1 Gbit/s the ring keeps the links busier and wins (back to back, 1 MiB
# 52.7 ms against 54.8, 4 MiB 213 against 241), and the timing keeps it.
# Below 1 MiB the trials mislead at 1 Gbit/s (256 KiB: the exchanges won
# them, then read 0.6x gloo); from 4 MiB neither wins at 10 Gbit/s by more
# than the noise.
_TUNED_ALL_REDUCE_MIN_BYTES = 1 << 20
_TUNED_ALL_REDUCE_MAX_BYTES = 4 << 20
# Below this a broadcast keeps its two halves untimed: trial calls of a few
# hundred microseconds decide on noise (4 hosts at 10 Gbit/s, 64 KiB, with
# eight trials: runs of 0.64x-1.37x gloo timed, 1.12x-1.88x in halves).
_TUNED_CHAIN_MIN_BYTES = 1 << 20
# A gather's root takes (a scatter's root sends) blocks of this many bytes
# or more from one peer at a time: several streams into one link lose to one
# (4 hosts at 1 Gbit/s, 16 MiB gather: 1.14x the link's bound at once, gloo's
# one after the other 1.05x).
_ONE_PEER_AT_A_TIME_BYTES = 1 << 20
# Between two ranks, an all-to-all or all-gather that carries fewer bytes
# than this each way is one exchange (a receive and a send posted from the
# caller's thread): gloo's own all-to-all hands the call to its worker thread
# and back (2 hosts of 1 rank, all-to-all of 16-64 KiB: 1.2x-1.6x gloo's
# speed through the exchange, 0.9x-1.2x through gloo's own; all-gather of
# 1-64 KiB 1.7x-3.0x against 1.4x-2.1x). From there to
# _PAIR_ALL_TO_ALL_MAX_BYTES a direction, gloo's own all-to-all: with
# 128 KiB a way at 1 Gbit/s the exchange took 1.1x-1.4x its time. From 1 MiB
# a direction the exchange again (1 Gbit/s: 1.5x-1.7x, gloo's send-first
# swap runs one way at a time).
_PAIR_EXCHANGE_MAX_BYTES = 64 << 10
_PAIR_ALL_TO_ALL_MAX_BYTES = 1 << 20
# An exchange posts its sends of fewer bytes than this before its receives,
# the larger ones after them. Posted first, a small send is on its way while
# the receives are posted, which gloo then fills at once: 4 hosts of 1 rank,
# all_to_all, small sends first against receives first in the same
# processes: 10 Gbit/s 64 KiB 1.05-1.27 ms against 1.80-1.81, 1 MiB
# 1.44-1.70 ms against 2.23-2.37; unshaped links 16 KiB-1 MiB 1.4-2.0 ms
# against 2.3-3.2. A large send posted first holds the receives' notices
# back: at 1 Gbit/s, blocks of 256 KiB took the same either way, of 512 KiB
# 17.0 ms against 12.9 (4 hosts) and of 1 MiB 9.6 ms against 8.7 (2 hosts).
# Where a host's ranks share its link, each rank's share of it (2 hosts of 2
# ranks at 1 Gbit/s, blocks of 256 KiB: 0.85x-0.90x gloo sends first,
# 1.0x receives first).
_SEND_FIRST_MAX_BYTES = 512 << 10
# A byte count no op reaches (the C++ side's int64 limit).
NEVER_BYTES = (1 << 63) - 1
# Between two ranks a reduce of this many bytes or more comes to dst in pieces
# of at least _REDUCE_PIECE_BYTES (at most _REDUCE_PIECES), each reduced
# while the next arrives.
_REDUCE_PIECE_BYTES = 1 << 20
_REDUCE_PIECES = 8


def _chain_piece_bytes(nbytes: int) -> int:
    """The bytes of a piece a chain moves a tensor of ``nbytes`` in: two
    halves, pieces of _CHAIN_PIECE_BYTES from twice that, _CHAIN_PIECES
    larger ones from _CHAIN_PIECES times it. The C++ gloo path's chain
    broadcast plans the same (GlooPath::chainBroadcast)."""
    return max(-(-nbytes // _CHAIN_PIECES), min(-(-nbytes // 2), _CHAIN_PIECE_BYTES))


def _chain_pieces(nbytes: int, element_size: int, piece_bytes: int | None = None) -> list[tuple[int, int]]:
    """(start, stop) elements of the pieces of ``piece_bytes`` (by default
    :func:`_chain_piece_bytes`') a chain moves a tensor of ``nbytes`` in."""
    piece = (piece_bytes or _chain_piece_bytes(nbytes)) // element_size
    numel = nbytes // element_size
    return [(a, min(a + piece, numel)) for a in range(0, numel, piece)]


# The dtypes torch's ProcessGroupGloo all-reduces, and the ops it has on them.
_GLOO_FLOAT = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_GLOO_INTEGER = {torch.int8, torch.uint8, torch.int32, torch.int64}
_GLOO_FLOAT_OPS = {Kind.SUM, Kind.PRODUCT, Kind.MIN, Kind.MAX}
_GLOO_INTEGER_OPS = _GLOO_FLOAT_OPS | {Kind.BAND, Kind.BOR, Kind.BXOR}


def gloo_plan(dtype: torch.dtype, kind: Kind, ranks: int) -> WirePlan | None:
    """How gloo's own all-reduce of ``ranks`` carries ``kind`` on ``dtype``,
    or None where it cannot. float16 and bfloat16 sums of three or more
    ranks stay off gloo's ring, which rounds at every step: the package
    accumulates them in float32."""
    plan = wire_plan(dtype, kind)
    if plan is None:
        return None
    if plan.dtype in (torch.float16, torch.bfloat16) and ranks > 2:
        return None
    if plan.dtype in _GLOO_FLOAT and plan.kind in _GLOO_FLOAT_OPS:
        return plan
    if plan.dtype in _GLOO_INTEGER and plan.kind in _GLOO_INTEGER_OPS:
        return plan
    return None


@contextlib.contextmanager
def _typed_failures() -> Iterator[None]:
    """Gloo's failures typed as this package's: gloo raises a plain
    RuntimeError and says "timed out" when its timeout passed (the one place
    that reads another library's words)."""
    try:
        yield
    except GroupCommError:
        raise
    except RuntimeError as exc:
        raise _ours(exc) from exc


def _finish(work, timeout: timedelta | None = None) -> bool:
    """``work.wait()``, with gloo's failures typed as this package's."""
    with _typed_failures():
        return work.wait() if timeout is None else work.wait(timeout)


def _unheld(failure: GroupCommError) -> None:
    """Clear the locals of the finished frames ``failure`` (and what caused
    it) passed through. Whoever keeps a failed op's exception keeps
    its frames, and a frame that held gloo's work holds the group's gloo
    context, whose connections then stay open: a peer blocked on this rank
    would wait for its timeout instead of failing when this rank lets go of
    the group (``_let_go``)."""
    seen: set[int] = set()
    exc: BaseException | None = failure
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row along dim 0 (0 for a tensor without rows)."""
    rows = tensor.shape[0] if tensor.dim() > 0 else 0
    return tensor.nbytes // rows if rows else 0


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as one row of bytes."""
    return as_bytes(tensor.reshape(-1))


def _ms(timeout: timedelta) -> int:
    return int(timeout.total_seconds() * 1000)


def _ours(exc: RuntimeError) -> GroupCommError:
    text = str(exc).lower()
    timed_out = "timed out" in text or "timeout" in text
    return (CommTimeoutError if timed_out else GroupCommError)(str(exc))


class _GlooTransfer:
    """A gloo send or recv; ``abort()`` of its communicator wakes its waiter.
    A failed one lets go of gloo's work (the communicator's waiter keeps it
    until gloo is done with it): see ``_unheld``."""

    __slots__ = ("work", "_comm", "_failure")

    def __init__(self, work, comm: GlooCommunicator) -> None:
        self.work, self._comm = work, comm
        self._failure: GroupCommError | None = None

    def wait(self, timeout: timedelta | None = None) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            finished = _finish(self.work, timeout)
        except GroupCommError as exc:
            self.work, self._failure = None, exc
            _unheld(exc)
            raise
        finally:
            self._comm._forget(self)
        if not finished:  # gloo's answer to Work::abort()
            raise GroupCommError(ABORTED)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class GlooCommunicator(DeviceCommunicatorBase):
    """CPU collectives over gloo (TCP), on byte views of any dtype.

    Gloo wakes no waiter when its group is aborted, so collectives are waited
    for here through their future (``abort()`` ends that wait), and posted
    send/recv are aborted one by one (gloo does implement that). Every work
    is waited for and dropped through ``_C.AbortableWait``, so that gloo's
    threads never need the GIL (which would abort a process exiting while
    they still held one).
    """

    name = "gloo"

    def __init__(self, *args, rank_names: Sequence[int] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from .._native import _C

        # what errors call this group's ranks (their rank in a larger group)
        self._rank_names = list(rank_names) or list(range(self.world_size))
        # an exchange's sends below this go before its receives
        self.send_first_max_bytes = _SEND_FIRST_MAX_BYTES
        self._lock = threading.Lock()
        self._aborted = False
        self._posted: set[_GlooTransfer] = set()
        self._waiter = _C.AbortableWait()
        # how a size class of chain broadcast is cut, and whether an
        # all-reduce among 3+ ranks is gloo's ring (way 0) or
        # _start_direct_all_reduce (1): shared with the gloo path
        self._pieces = _C.Tuner(from_bytes=_TUNED_CHAIN_MIN_BYTES)
        self._reduce_ways = _C.Tuner(from_bytes=_TUNED_ALL_REDUCE_MIN_BYTES, to_bytes=_TUNED_ALL_REDUCE_MAX_BYTES)
        self._gloo_path = None  # _C.GlooPath, once the bridge asked for it

    def gloo_path(self, queue: object) -> object | None:
        """The ops :meth:`_gloo_routes` names, run by the bridge in C++ on
        the gloo group: the same algorithms (gloo's own, or the same sends and
        receives) as this communicator's own methods, so a rank whose call
        the bridge leaves to Python (a strided tensor, say) still pairs with
        the others."""
        if self._gloo_path is None and self.cpu_group is not None:
            from .._native import _C

            group = self.cpu_group
            backend = group if isinstance(group, c10d.Backend) else group._get_backend(torch.device("cpu"))
            timeout = self.current_timeout()
            self._gloo_path = _C.GlooPath(
                gloo=backend,
                waiter=self._waiter,
                pieces=self._pieces,
                all_reduce_ways=self._reduce_ways,
                queue=queue,
                timeout_ms=-1 if timeout is None else _ms(timeout),
                tag=COLLECTIVE_TAG,
                rank_names=self._rank_names,
                chain_min_bytes=_CHAIN_MIN_BYTES,
                chain_piece_bytes=_CHAIN_PIECE_BYTES,
                chain_pieces=_CHAIN_PIECES,
                one_peer_at_a_time_bytes=_ONE_PEER_AT_A_TIME_BYTES,
                ring_min_bytes=_RING_MIN_BYTES,
                gather_reduce_max_bytes=_GATHER_REDUCE_BYTES,
                pair_exchange_max_bytes=_PAIR_EXCHANGE_MAX_BYTES,
                pair_all_to_all_max_bytes=_PAIR_ALL_TO_ALL_MAX_BYTES,
                send_first_max_bytes=self.send_first_max_bytes,
                **self._gloo_routes(),
            )
        return self._gloo_path

    def _gloo_routes(self) -> dict[str, bool | int]:
        """Which of its ops the bridge runs on the C++ gloo path; an
        all_to_all_single without split sizes of ``python_all_to_all_min_bytes``
        or more comes to :meth:`all_to_all_even_into` instead."""
        return {
            "barrier": True,
            "broadcast": True,
            "rooted": True,
            "all_to_all": True,
            "all_gather": True,
            "all_reduce": True,
            "python_all_to_all_min_bytes": NEVER_BYTES,
        }

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        if self._gloo_path is not None:
            self._gloo_path.set_timeout(_ms(timeout))

    def abort(self) -> None:
        from .._native import _C

        with self._lock:
            self._aborted = True
            posted, self._posted = list(self._posted), set()
        self._waiter.abort()
        if self._gloo_path is not None:
            self._gloo_path.abort()
        for p in posted:
            _C.abort_work(p.work)

    def disconnect(self) -> None:
        self.abort()
        self._let_go()

    def destroy(self) -> None:
        self._let_go()

    def _let_go(self) -> None:
        """Drop this communicator's hold on the gloo group (its kept works
        hold it too): once nobody else holds it, its connections close and a
        peer's gloo op waiting on this rank fails at once ("Connection closed
        by peer") instead of at its timeout. Kept while an abort ended a wait
        before gloo's op did: that op runs on until its timeout, and freeing
        the group would wait for it."""
        if self._gloo_path is not None:
            self._gloo_path.release()
        if not self._waiter.cut_short():
            self._waiter.forget()
            self.cpu_group = None

    def _wait(self, work) -> None:
        """Wait for gloo's collective ``work``; a failure leaves no frame
        holding it (``_unheld``): pass it unnamed, or popped from a list."""
        try:
            with _typed_failures():
                completed = self._waiter.wait(work)  # raises gloo's failure
            if not completed:
                raise GroupCommError(ABORTED)
        except GroupCommError as exc:
            del work
            _unheld(exc)
            raise

    def _post(self, work) -> Transfer:
        self._waiter.keep(work)
        posted = _GlooTransfer(work, self)
        with self._lock:
            if self._aborted:
                raise GroupCommError(ABORTED)
            self._posted.add(posted)
        return posted

    def _forget(self, posted: _GlooTransfer) -> None:
        with self._lock:
            self._posted.discard(posted)

    def _opts(self, cls, **fields):
        opts = cls()
        timeout = self.current_timeout()
        if timeout is not None:
            opts.timeout = timeout
        for key, value in fields.items():
            setattr(opts, key, value)
        return opts

    def start_exchange(
        self, recvs: Sequence[tuple[torch.Tensor, int]], sends: Sequence[tuple[torch.Tensor, int]]
    ) -> Callable[[], None]:
        """Post a send of each small ``(tensor, dst)`` of ``sends``, a
        receive of each ``(tensor, src)`` of ``recvs``, then the larger sends
        (``send_first_max_bytes``, and the module's docstring); the returned
        call waits for them all."""
        timeout = self.current_timeout()
        small = [(t, peer) for t, peer in sends if t.nbytes < self.send_first_max_bytes]
        large = [(t, peer) for t, peer in sends if t.nbytes >= self.send_first_max_bytes]
        posted = [
            (self._transfer(send, tensor, peer), peer)
            for send, pairs in ((True, small), (False, recvs), (True, large))
            for tensor, peer in pairs
            if tensor.numel()
        ]

        def finish() -> None:
            for transfer, peer in posted:
                self._arrived(transfer, peer, timeout)

        return finish

    def _transfer(self, send: bool, tensor: torch.Tensor, peer: int) -> Transfer:
        """A send (or receive) of ``tensor``'s bytes to (from) ``peer`` with
        the collectives' tag; a failure names the peer."""
        with self._naming(peer):
            post = self.cpu_group.send if send else self.cpu_group.recv
            return self._post(post([as_bytes(tensor)], peer, COLLECTIVE_TAG))

    def _arrived(self, transfer: Transfer, peer: int, timeout: timedelta | None) -> None:
        """Wait for ``transfer`` with ``peer``; a failure names the peer."""
        with self._naming(peer):
            transfer.wait(timeout)

    @contextlib.contextmanager
    def _naming(self, peer: int):
        """A failure inside (other than this side's abort) names ``peer``,
        the one rank the step was waiting on: a lost connection names none."""
        try:
            yield
        except (GroupCommError, RuntimeError) as exc:
            if str(exc) == ABORTED:
                raise
            ours = exc if isinstance(exc, GroupCommError) else _ours(exc)
            raise type(ours)(f"{ours} (waiting on peer rank {self._rank_names[peer]})") from exc

    def start_all_gather(self, output: torch.Tensor, input_: torch.Tensor) -> Callable[[], None]:
        """Begin ``all_gather_into(output, input_)``; the returned call waits
        for it (``input_`` must stay unchanged until then)."""
        blocks = list(output.view(self.world_size, -1))
        blocks[self.rank_in_group].copy_(input_)
        return self._start_gather_pieces(blocks, input_)

    def _start_gather_pieces(self, pieces: Sequence[torch.Tensor], mine: torch.Tensor) -> Callable[[], None]:
        """Begin sending ``mine`` to every peer and receiving each peer
        ``r``'s into ``pieces[r]``; the returned call waits for them."""
        me, world = self.rank_in_group, self.world_size
        peers = [(me + k) % world for k in range(1, world)]
        return self.start_exchange([(pieces[r], r) for r in peers], [(mine, r) for r in peers])

    def start_reduce_scatter(
        self, output: torch.Tensor, input_: torch.Tensor, reduction: Reduction
    ) -> Callable[[], None]:
        """Begin a reduce-scatter of ``input_`` (``world`` equal blocks) into
        ``output`` (one block); the returned call waits and reduces."""
        return self._start_reduce_pieces(list(input_.view(self.world_size, -1)), reduction, output)

    def _start_reduce_pieces(
        self, pieces: Sequence[torch.Tensor], reduction: Reduction, output: torch.Tensor
    ) -> Callable[[], None]:
        """Begin sending ``pieces[r]`` to each peer ``r`` and receiving every
        peer's piece of this rank (as long as ``pieces[rank]``); the returned
        call waits and reduces them all into ``output``."""
        me, world = self.rank_in_group, self.world_size
        received = pieces[me].new_empty((world, pieces[me].numel()))
        received[me].copy_(pieces[me])
        peers = [(me + k) % world for k in range(1, world)]
        finish = self.start_exchange([(received[r], r) for r in peers], [(pieces[r], r) for r in peers])

        def reduce() -> None:
            finish()
            reduce_stacked(received, reduction, output)

        return reduce

    def start_all_reduce(self, tensor: torch.Tensor, reduction: Reduction) -> Callable[[], None]:
        """Begin ``all_reduce_(tensor, reduction)``; the returned call waits
        for it (and reduces, where the reduction happens here)."""
        world = self.world_size
        if tensor.numel() == 0:
            return lambda: None
        if tensor.nbytes * (world - 1) <= _GATHER_REDUCE_BYTES:
            # one exchange, then the reduction here: gloo's ring takes several
            # round trips (2 hosts at 1 Gbit/s, 64 KiB: 0.6 vs 2.1 ms)
            gathered = tensor.new_empty(world * tensor.numel())
            arrived = self.start_all_gather(gathered, tensor)

            def reduce() -> None:
                arrived()
                reduce_stacked(gathered.view(world, -1), reduction, tensor)

            return reduce
        if world >= 3:
            way, trial = self._reduce_ways.choose(tensor.nbytes)
            start = time.perf_counter_ns()
            finish = (
                self._start_direct_all_reduce(tensor, reduction)
                if way
                else self._start_ring_all_reduce(tensor, reduction)
            )

            def timed() -> None:
                finish()
                self._timed(self._reduce_ways, tensor.nbytes, trial, start)

            return timed
        return self._start_ring_all_reduce(tensor, reduction)

    def _start_direct_all_reduce(self, tensor: torch.Tensor, reduction: Reduction) -> Callable[[], None]:
        """Begin an all-reduce among 3+ ranks in two exchanges (GlooPath's
        directAllReduce): piece p of every rank's tensor (even pieces, one per
        rank) goes to rank p, which reduces them and sends the result to
        every rank. Two transfers deep where gloo's ring is 2(n-1), with the
        same bytes on the links: 4 hosts of 1 rank at 10 Gbit/s, 1 MiB,
        5.1 ms against the ring's 8.2 ms back to back."""
        me = self.rank_in_group
        flat = tensor.contiguous().view(-1)
        pieces = [flat[a:b] for a, b in even_pieces(flat.numel(), self.world_size)]
        reduced = self._start_reduce_pieces(pieces, reduction, pieces[me])

        def finish() -> None:
            reduced()
            self._start_gather_pieces(pieces, pieces[me])()
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))

        return finish

    def _start_ring_all_reduce(self, tensor: torch.Tensor, reduction: Reduction) -> Callable[[], None]:
        """Begin an all-reduce on gloo's own (its ring among 3+ ranks), in
        the wire dtype and op gloo has; the generic path where it has none."""
        world = self.world_size
        plan = gloo_plan(tensor.dtype, reduction.kind, world)
        scaled = reduction.kind == Kind.AVG or (
            reduction.kind == Kind.PREMUL_SUM and (tensor.is_floating_point() or tensor.is_complex())
        )
        if plan is None and scaled and tensor.dtype not in (torch.bool, torch.float16):
            # gloo's ring sums, then each rank divides (or scales first), as
            # the chain reduce does. float16's sum would overflow where its
            # average does not.
            plan = gloo_plan(tensor.dtype, Kind.SUM, world)
        if plan is None:
            super().all_reduce_(tensor, reduction)
            return lambda: None
        if reduction.kind == Kind.PREMUL_SUM:
            reduce_stacked(tensor.unsqueeze(0), reduction, tensor)
        opts = self._opts(c10d.AllreduceOptions, reduceOp=getattr(c10d.ReduceOp, plan.kind.name))
        started = [self.cpu_group.allreduce([plan.apply(tensor)], opts)]
        peer = 1 - self.rank_in_group if world == 2 else None

        def finish() -> None:
            with self._naming(peer) if peer is not None else contextlib.nullcontext():
                self._wait(started.pop())
            if reduction.kind == Kind.AVG:
                divide_(tensor, world)

        return finish

    def all_reduce_(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        self.start_all_reduce(tensor, reduction)()

    def reduce_scatterv_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        sizes: list[int],
        reduction: Reduction,
    ) -> None:
        if len(set(sizes)) == 1:
            self.start_reduce_scatter(output, input_, reduction)()
            return
        super().reduce_scatterv_into(output, input_, sizes, reduction)

    def reduce_(self, tensor: torch.Tensor, dst: int, reduction: Reduction) -> None:
        world = self.world_size
        if world >= 3 and tensor.nbytes >= _CHAIN_MIN_BYTES:
            self._chain_reduce_(tensor.view(-1), dst, reduction)
            return
        if world == 2 and tensor.nbytes >= _RING_MIN_BYTES:
            self._pairwise_reduce_(tensor.view(-1), dst, reduction)
            return
        super().reduce_(tensor, dst, reduction)

    def _chain_reduce_(self, flat: torch.Tensor, dst: int, reduction: Reduction) -> None:
        """Reduce down the chain dst+1, dst+2, ..., dst in pieces (the chain
        broadcast's, run backwards): a rank receives each piece of the
        partial result of the ranks before it, folds its own in and passes it
        on while the next piece arrives, so that no link carries more than
        the tensor once (4 hosts at 1 Gbit/s, 16 MiB: a reduce-scatter and a
        gather took 1.78x the link's bound)."""
        world, me = self.world_size, self.rank_in_group
        position = (me - dst - 1) % world
        prev, after = (me - 1) % world, (me + 1) % world
        # AVG and PREMUL_SUM go down the chain as a sum (a pair's fold would
        # divide, or scale, at every step)
        inner = Reduction(Kind.SUM) if reduction.kind in (Kind.AVG, Kind.PREMUL_SUM) else reduction
        own = flat
        if reduction.kind == Kind.PREMUL_SUM:
            own = torch.empty_like(flat)
            reduce_stacked(flat.unsqueeze(0), reduction, own)
        pieces = _chain_pieces(flat.nbytes, flat.element_size())
        if position == 0:
            self._down_chain([], [own[a:b] for a, b in pieces], prev, after)
            return
        partial = torch.empty_like(flat)
        parts = [partial[a:b] for a, b in pieces]

        def fold(i: int) -> None:
            a, b = pieces[i]
            fold_pair(partial[a:b], own[a:b], inner, mine_first=False)

        self._down_chain(parts, parts if me != dst else [], prev, after, fold)
        if me == dst:
            flat.copy_(partial)
            if reduction.kind == Kind.AVG:
                divide_(flat, world)

    def _pairwise_reduce_(self, flat: torch.Tensor, dst: int, reduction: Reduction) -> None:
        """Reduce between two ranks: the other rank's tensor comes to dst in
        pieces, each reduced into dst's while the next is on the wire (a
        gather, then one pass: 2 hosts at 10 Gbit/s, 16 MiB, 0.8x gloo)."""
        pieces = even_pieces(flat.numel(), max(1, min(_REDUCE_PIECES, flat.nbytes // _REDUCE_PIECE_BYTES)))
        peer = 1 - self.rank_in_group
        if self.rank_in_group != dst:
            self._down_chain([], [flat[a:b] for a, b in pieces], peer, dst)
            return
        theirs = torch.empty_like(flat)

        def fold(i: int) -> None:
            a, b = pieces[i]
            fold_pair(flat[a:b], theirs[a:b], reduction, mine_first=dst < peer)

        self._down_chain([theirs[a:b] for a, b in pieces], [], peer, peer, fold)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() == 0:
            return
        if self.world_size == 2:
            peer, data = 1 - self.rank_in_group, [as_bytes(tensor)]
            self._down_chain(data if src == peer else [], [] if src == peer else data, peer, peer)
            return
        if self.world_size >= 3 and tensor.nbytes >= _CHAIN_MIN_BYTES:
            self._chain_broadcast(as_bytes(tensor), src)
            return
        opts = self._opts(c10d.BroadcastOptions, rootRank=src, rootTensor=0)
        self._wait(self.cpu_group.broadcast([as_bytes(tensor)], opts))

    def _chain_broadcast(self, data: torch.Tensor, src: int) -> None:
        """Broadcast ``data`` down the chain src, src+1, ... in the pieces
        the group's _C.Tuner chooses for its size (the planned ones or
        the whole, timed on the first calls): a rank receives every piece
        into place and sends each on once it arrived."""
        world, nbytes = self.world_size, data.numel()
        position = (self.rank_in_group - src) % world
        prev, after = (self.rank_in_group - 1) % world, (self.rank_in_group + 1) % world
        way, trial = self._pieces.choose(nbytes)
        start = time.perf_counter_ns()
        piece = _chain_piece_bytes(nbytes) if way == 0 else nbytes
        parts = [data[a:b] for a, b in _chain_pieces(nbytes, 1, piece)]
        self._down_chain(parts if position else [], parts if position < world - 1 else [], prev, after)
        self._timed(self._pieces, nbytes, trial, start)

    def _timed(self, tuner: object, nbytes: int, trial: int, start_ns: int) -> None:
        """Record trial ``trial`` of ``tuner``'s size class of ``nbytes``
        (begun at ``start_ns``), as GlooPath::tuned does: after the class's
        last trial every rank keeps the way whose time summed over the ranks
        is lower."""
        if trial >= 0 and tuner.record(nbytes, trial, time.perf_counter_ns() - start_ns):
            totals = tuner.totals(nbytes)
            self._wait(self.cpu_group.allreduce([totals], self._opts(c10d.AllreduceOptions)))
            tuner.decide(nbytes, totals)

    def _down_chain(
        self,
        into: list[torch.Tensor],
        onward: list[torch.Tensor],
        prev: int,
        after: int,
        arrived: Callable[[int], None] | None = None,
    ) -> None:
        """One rank's part of a chain: a receive from ``prev`` posted into
        each piece of ``into`` (none at the chain's head), and piece i of
        ``onward`` sent to ``after`` (none at its tail) once piece i arrived
        and ``arrived(i)`` ran."""
        timeout = self.current_timeout()
        arriving = [self._transfer(False, p, prev) for p in into]
        leaving = []
        for i in range(len(into or onward)):
            if arriving:
                self._arrived(arriving[i], prev, timeout)
                if arrived is not None:
                    arrived(i)
            if onward:
                leaving.append(self._transfer(True, onward[i], after))
        for transfer in leaving:
            self._arrived(transfer, after, timeout)

    def all_gather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        if output.numel() == 0:
            return
        if self.world_size == 1:
            output.copy_(input_)
            return
        if self.world_size >= 3 and output.nbytes >= _RING_MIN_BYTES:
            self._ring_all_gather(output.view(self.world_size, -1), input_)
            return
        if self.world_size == 2 and _PAIR_EXCHANGE_MAX_BYTES <= input_.nbytes and output.nbytes < _RING_MIN_BYTES:
            self._pair_all_gather(output, input_)
            return
        self.start_all_gather(output, input_)()

    def _pair_all_gather(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """Between two ranks, one gloo all-to-all that leaves this rank's own
        block out (copied here): gloo's all-gather sends each block in two
        halves, sends posted first, and took 1.2x-1.7x the time between two
        hosts, 64 B-256 KiB. The bridge's allgatherBase does the same."""
        me = self.rank_in_group
        blocks = as_bytes(output.view(-1)).view(2, -1)
        mine = _flat_bytes(input_)
        blocks[me].copy_(mine)
        splits = [0, 0]
        splits[1 - me] = mine.numel()
        opts = self._opts(c10d.AllToAllOptions)
        self._wait(self.cpu_group.alltoall_base(blocks[1 - me], mine, splits, splits, opts))

    def _ring_all_gather(self, blocks: torch.Tensor, input_: torch.Tensor) -> None:
        """All-gather around the ring: at step s a rank sends on to the next
        rank the block it received at step s - 1 (its own at step 0), so each
        link carries one stream each way."""
        me, world, timeout = self.rank_in_group, self.world_size, self.current_timeout()
        left, right = (me - 1) % world, (me + 1) % world
        blocks[me].copy_(input_)
        arriving = [self._transfer(False, blocks[(me - s) % world], left) for s in range(1, world)]
        leaving = []
        for s in range(world - 1):
            leaving.append(self._transfer(True, blocks[(me - s) % world], right))
            self._arrived(arriving[s], left, timeout)
        for transfer in leaving:
            self._arrived(transfer, right, timeout)

    def all_to_all_into(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_sizes: list[int],
        input_sizes: list[int],
    ) -> None:
        if self.world_size == 1:
            output.copy_(input_)
            return
        me, world = self.rank_in_group, self.world_size
        out_row, in_row = _row_bytes(output), _row_bytes(input_)
        if world == 2 and (
            _PAIR_EXCHANGE_MAX_BYTES
            <= max(output_sizes[1 - me] * out_row, input_sizes[1 - me] * in_row)
            < _PAIR_ALL_TO_ALL_MAX_BYTES
        ):
            # gloo's own, as the bridge runs it: both ranks decide alike
            out = output.contiguous()
            opts = self._opts(c10d.AllToAllOptions)
            self._wait(
                self.cpu_group.alltoall_base(
                    _flat_bytes(out),
                    _flat_bytes(input_.contiguous()),
                    [n * out_row for n in output_sizes],
                    [n * in_row for n in input_sizes],
                    opts,
                )
            )
            if out is not output:
                output.copy_(out)
            return
        outs, ins = output.split(output_sizes), input_.split(input_sizes)
        outs[me].copy_(ins[me])
        peers = [(me + k) % world for k in range(1, world)]
        self.start_exchange([(outs[r], r) for r in peers], [(ins[r], r) for r in peers])()

    def gather_into(self, outputs: list[torch.Tensor] | None, input_: torch.Tensor, dst: int) -> None:
        if input_.numel() == 0:
            return
        if self.rank_in_group != dst:
            self.start_exchange([], [(input_, dst)])()
            return
        outputs[dst].copy_(input_)
        peers = [r for r in range(self.world_size) if r != dst]
        if input_.nbytes < _ONE_PEER_AT_A_TIME_BYTES:
            self.start_exchange([(outputs[r], r) for r in peers], [])()
            return
        for r in peers:
            self.start_exchange([(outputs[r], r)], [])()

    def scatter_from(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, src: int) -> None:
        if output.numel() == 0:
            return
        if self.rank_in_group != src:
            self.start_exchange([(output, src)], [])()
            return
        output.copy_(inputs[src])
        peers = [r for r in range(self.world_size) if r != src]
        if output.nbytes < _ONE_PEER_AT_A_TIME_BYTES:
            self.start_exchange([], [(inputs[r], r) for r in peers])()
            return
        for r in peers:
            self.start_exchange([], [(inputs[r], r)])()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Transfer:
        if tensor.numel() == 0:
            return DoneTransfer()
        return self._post(self.cpu_group.send([as_bytes(tensor)], dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Transfer:
        if tensor.numel() == 0:
            return DoneTransfer()
        return self._post(self.cpu_group.recv([as_bytes(tensor)], src, tag))

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        posted = self._post(self.cpu_group.recv_anysource([as_bytes(tensor)], tag))
        posted.wait()
        return posted.work._source_rank()

    def barrier(self) -> None:
        """Returns once every rank has called it. Between two ranks one byte
        each way, a receive and a send posted from this thread: gloo's own
        barrier sends the same two messages from its worker thread. Among
        three or more an all-reduce of one byte: gloo's ring takes 0.5x-0.8x
        the time of its barrier (3 and 4 hosts of 1 rank at 1 and 10 Gbit/s)."""
        if self.world_size == 2:
            peer = 1 - self.rank_in_group
            mine, theirs = torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
            self.start_exchange([(theirs, peer)], [(mine, peer)])()
            return
        byte = torch.zeros(1, dtype=torch.uint8)
        self._wait(self.cpu_group.allreduce([byte], self._opts(c10d.AllreduceOptions)))
