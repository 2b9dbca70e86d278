"""Seeded randomized differential test: ``groupcomm`` against ``gloo``.

What it does
------------
From a seed, every rank builds the same list of random collective calls
(:func:`generate_calls`): the op (all_reduce, reduce, broadcast, all_gather in
list form, even or uneven, all_gather_into_tensor in concat or stack form,
reduce_scatter in list form, even or uneven, reduce_scatter_tensor,
all_to_all_single with even or uneven splits, all_to_all in list form, gather,
scatter, barrier, send/recv between two ranks, batch_isend_irecv), the dtype,
the shapes (0-d, empty, odd sizes up to 300001 elements, multi-dim), the reduce
op, root, splits, the group (the default group or a subgroup made up front), a
memory layout (contiguous, transposed, strided with gaps, offset into a larger
buffer), ``async_op``, and which ranks' buffers lie in the group's shared
memory, where the peers read them in place (moved there as
``shared_allreduce_hook`` moves DDP's buckets, or allocated there as FSDP2's
opt-in allocates its buffers; every mix of ranks in and out). Only the data
differs per rank; it is derived from (seed, call index, rank, slot), so any
rank can regenerate any other rank's input without communicating.

Every call runs twice in the same processes with the same inputs: on the
``groupcomm`` group (in the drawn layout, async or not) and on a ``gloo``
group over the same ranks (contiguous copies, synchronous). Async ``groupcomm``
calls are waited for in small batches (the generator decides when), so several
are in flight at once, possibly on different groups and across later
synchronous calls. Where gloo does not offer the (op, dtype, reduce op) pair
(probed on torch 2.13, see :func:`gloo_supports`: PREMUL_SUM, integer AVG,
complex PRODUCT, uneven all_gather and list all_to_all, complex gather, int16
collectives), the reference is plain torch math over every rank's regenerated
input, following the semantics in the README's table (float references
computed in float64 and rounded once; integer SUM/PRODUCT wrap; integer AVG is
the wrapped sum divided by the group size, truncated toward zero; on bool
SUM/MAX are "or", PRODUCT/MIN "and"). With ``cross_check`` the gloo results
are also compared with the torch math, which validates the references.

Besides the outputs, it checks that inputs of out-of-place ops are left
unchanged and that the gaps around strided/offset views are not written.

Why
---
The hand-written tests cover each op on a few chosen inputs; random sequences
find the combinations nobody wrote down (a non-contiguous output of an uneven
collective on a subgroup while another group's async op is in flight, sizes
around the 16 KiB one-round all-reduce limit and the shared-memory chunk size,
...). A failure names everything needed to replay it:
``python tests/differential.py --world W --seed S --only INDEX``.

How outputs are compared (documented tolerances)
------------------------------------------------
* Data movement (broadcast, gathers, scatters, all-to-alls, send/recv): bitwise
  identical, for every dtype. Float inputs are then random bit patterns (NaN
  payloads, infinities, subnormals included).
* Integer and bool reductions, MIN and MAX on every dtype: identical values.
* Floating and complex SUM, AVG, PRODUCT, PREMUL_SUM: half of those calls use
  small integers (scaled by an exactly representable premul factor), whose
  results are exact in every float dtype, so SUM/PRODUCT/PREMUL_SUM must match
  exactly. Otherwise, with ``n`` ranks in the group, ``eps`` the dtype's
  machine epsilon (of the component dtype for complex), and ``S`` a bound on
  the sum of the magnitudes being added (``n * scale * |factor|``; for PRODUCT
  the product of the magnitude bounds), each element must satisfy
  ``|got - want| <= 2*n*eps*S + 2*eps*|want| + n*tiny`` (4 instead of 2 for
  complex products). Recursive summation in any order errs by at most
  ``(n-1)*eps/2*S``; ``groupcomm`` accumulates float16/bfloat16 in float32 and
  rounds once while gloo rounds at each step, and the torch reference rounds
  once from float64, so two correct implementations differ by less than the
  bound, while a missing or doubled contribution, a wrong slice or a wrong op
  exceeds it. For float32 at world 4 and unit-scale data that is about 4e-6
  absolute; for bfloat16 about 0.25 (exact-data calls cover bfloat16 tightly).

A mismatch reports seed, call index, op, dtype, shapes, reduce op, group,
root, layout, async flag, rank, which output, the reference used, the max
difference and the first differing element. A call that raises stops the run
with the same description.

Not supported: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. torch's checker reports
a mismatch on the *gloo* reference groups after a send/recv between some of
their ranks (plain gloo does the same), so the run stops there.

Known open bugs of the package are listed in ``EXCLUDED``; the generator steers
around them (and the summary says so) until they are fixed; ``--no-exclusions``
turns that off.

Command line (spawns the ranks itself; ``--help`` for replaying single calls,
per-rank environments such as simulated hosts, tracing and stack dumps)::

    python tests/differential.py --world 4 --calls 5000 --seed 123
    python tests/differential.py --world 4 --env GROUPCOMM_HOST_ID=a,a,b,b --cross-check
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import faulthandler
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

# op kinds and how often the generator draws them
_KIND_WEIGHTS = {
    "all_reduce": 4,
    "reduce": 2,
    "broadcast": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "reduce_scatter": 2,
    "reduce_scatter_tensor": 2,
    "all_to_all_single": 2,
    "all_to_all": 2,
    "gather": 2,
    "scatter": 2,
    "barrier": 1,
    "send_recv": 2,
    "batch_isend_irecv": 2,
}
KINDS: tuple[str, ...] = tuple(_KIND_WEIGHTS)
# the kind:variant labels a run of a few hundred calls must all exercise
LABELS: tuple[str, ...] = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather:even",
    "all_gather:uneven",
    "all_gather_into_tensor:concat",
    "all_gather_into_tensor:stack",
    "reduce_scatter:even",
    "reduce_scatter:uneven",
    "reduce_scatter_tensor:concat",
    "reduce_scatter_tensor:stack",
    "all_to_all_single:even",
    "all_to_all_single:uneven",
    "all_to_all:even",
    "all_to_all:uneven",
    "gather",
    "scatter",
    "barrier",
    "send_recv:blocking",
    "send_recv:nonblocking",
    "batch_isend_irecv",
)
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
P2P = {"send_recv", "batch_isend_irecv"}

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COMPLEX = (torch.complex64, torch.complex128)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_DTYPE_WEIGHTS = {
    torch.float32: 4,
    torch.float64: 2,
    torch.float16: 2,
    torch.bfloat16: 2,
    torch.int8: 1,
    torch.uint8: 1,
    torch.int16: 1,
    torch.int32: 1,
    torch.int64: 2,
    torch.bool: 1,
    torch.complex64: 2,
    torch.complex128: 1,
}
PREMUL_FACTORS = (0.5, 2.5, -1.5, 3.0, -0.25)  # exact in every float dtype
LAYOUTS = ("contig", "transpose", "stride", "offset")
# torch 2.11's gloo has no list-form alltoall ("Backend gloo does not support
# alltoall"); 2.12's was not checked, so before 2.13 the reference goes through
# all_to_all_single
_GLOO_LIST_ALLTOALL = torch.__version__ >= (2, 13)

Shape = tuple[int, ...]

# Bugs in the package the generator steers around until they are fixed:
# id -> (what, whether it applies to a run with this environment). Keep this
# empty unless a bug is reported and still open.
EXCLUDED: dict[str, tuple[str, Callable[[Mapping[str, Any]], bool]]] = {}


def active_exclusions(env: Mapping[str, Any]) -> frozenset[str]:
    """The ids in EXCLUDED that apply to a run with environment ``env``
    (none with DIFFERENTIAL_NO_EXCLUSIONS=1, to check a fix)."""
    if env.get("DIFFERENTIAL_NO_EXCLUSIONS") == "1":
        return frozenset()
    return frozenset(k for k, (_, applies) in EXCLUDED.items() if applies(env))


def valid_redops(kind: str, dtype: torch.dtype) -> list[str]:
    """Reduce ops the README's table promises for ``dtype`` (through ``kind``)."""
    if dtype in FLOATS:
        ops = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
    elif dtype in COMPLEX:
        ops = ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"]
        if kind == "all_reduce":  # dist.all_reduce refuses complex PRODUCT itself
            ops.remove("PRODUCT")
    elif dtype == torch.bool:
        ops = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    else:
        ops = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    return ops


@dataclasses.dataclass
class Call:
    """One random call, identical on every rank (data excepted)."""

    index: int
    kind: str
    variant: str
    group: int  # index into group_specs(world)
    dtype: torch.dtype
    shape: Shape  # the per-rank base shape
    redop: str | None = None
    factor: float | None = None  # PREMUL_SUM factor
    factor_tensor: bool = False  # pass the factor as a 0-d tensor
    root: int = 0  # group rank
    async_op: bool = False
    layout: str = "contig"
    data: str = "bits"  # bits | exact | exact_prod | real | prod
    scale: float = 1.0
    sizes: list[int] = dataclasses.field(default_factory=list)  # uneven leading dims
    splits: list[list[int]] = dataclasses.field(default_factory=list)  # [src][dst] rows / sizes
    messages: list[tuple[int, int, Shape, int]] = dataclasses.field(default_factory=list)  # src, dst, shape, tag
    fill: int = 0  # output sentinel selector
    flush: bool = False  # wait for every pending async call after this one
    shared: int = 0  # group ranks (bits) whose buffers lie in the group's shared memory
    share_via: str = "adopt"  # how they get there: adopt (DDP's hook) | alloc (FSDP2's opt-in)
    coalesced: bool = False  # issued alone in a _coalescing_manager block (torch's coalesced form)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.variant}" if self.variant else self.kind

    def describe(self, ranks: Sequence[int]) -> str:
        parts = [f"op={self.label}", f"dtype={str(self.dtype).replace('torch.', '')}", f"shape={self.shape}"]
        if self.redop:
            parts.append(
                f"redop={self.redop}"
                + (f"({self.factor}{',tensor' if self.factor_tensor else ''})" if self.redop == "PREMUL_SUM" else "")
            )
            parts.append(f"data={self.data}" + (f"x{self.scale}" if self.data == "real" else ""))
        if self.sizes:
            parts.append(f"sizes={self.sizes}")
        if self.splits:
            parts.append(f"splits={self.splits}")
        if self.messages:
            parts.append(f"messages={self.messages}")
        if self.kind in ("reduce", "broadcast", "gather", "scatter"):
            parts.append(f"root={ranks[self.root]}")
        parts += [f"group={list(ranks)}", f"layout={self.layout}", f"async={self.async_op}"]
        if self.coalesced:
            parts.append("coalesced")
        if self.shared:
            parts.append(f"shared={[r for i, r in enumerate(ranks) if self.shared >> i & 1]}({self.share_via})")
        return " ".join(parts)


def group_specs(world: int) -> list[list[int]]:
    """The default group first, then the subgroups every rank creates up front."""
    specs = [list(range(world))]
    if world >= 3:
        specs += [[0, 2], list(range(1, world)), [world - 1]]
    elif world == 2:
        specs += [[1]]
    return specs


def _pick_shape(rng: random.Random, big: bool = True) -> Shape:
    r = rng.random()
    if r < 0.08:
        return ()
    if r < 0.14:
        return rng.choice([(0,), (0, 3), (2, 0), (3, 0, 2)])
    if r < 0.55:
        return (rng.choice([1, 2, 3, 5, 7, 8, 13, 31, 64, 100, 127, 255]),)
    if r < 0.75 and big:
        return (rng.choice([1000, 1023, 4096, 4099, 8191, 16411, 70001]),)
    if r < 0.985 or not big:
        ndim = rng.choice([2, 2, 3])
        return tuple(rng.choice([1, 2, 3, 4, 5, 7, 9, 16, 33]) for _ in range(ndim))
    return (rng.choice([262147, 300001]),)  # over the default 1 MiB shared-memory chunk


def _pick_dtype(rng: random.Random) -> torch.dtype:
    dtypes = list(_DTYPE_WEIGHTS)
    return rng.choices(dtypes, weights=[_DTYPE_WEIGHTS[d] for d in dtypes])[0]


def generate_calls(seed: int, world: int, count: int, avoid: frozenset[str] = frozenset()) -> list[Call]:
    """The call sequence for ``seed``: the same on every rank and in the parent.
    ``avoid`` names EXCLUDED bugs to steer around (without changing other calls)."""
    rng = random.Random(seed)
    specs = group_specs(world)
    kinds = list(_KIND_WEIGHTS)
    calls: list[Call] = []
    pending = 0
    for index in range(count):
        kind = rng.choices(kinds, weights=[_KIND_WEIGHTS[k] for k in kinds])[0]
        eligible = [i for i, s in enumerate(specs) if len(s) >= 2 or kind not in P2P]
        if not eligible:
            kind, eligible = "all_reduce", list(range(len(specs)))
        weights = [6 if i == 0 else (1 if len(specs[i]) == 1 else 2) for i in eligible]
        group = rng.choices(eligible, weights=weights)[0]
        n = len(specs[group])
        dtype = _pick_dtype(rng)
        call = Call(
            index=index,
            kind=kind,
            variant="",
            group=group,
            dtype=dtype,
            shape=_pick_shape(rng, big=kind not in P2P),
            root=rng.randrange(n),
            async_op=rng.random() < 0.4,
            layout=rng.choice(LAYOUTS),
            fill=rng.randrange(4),
        )
        if kind in REDUCING:
            call.redop = rng.choice(valid_redops(kind, dtype))
            if call.redop == "PREMUL_SUM":
                call.factor = rng.choice(PREMUL_FACTORS)
                call.factor_tensor = dtype in FLOATS and rng.random() < 0.3
            if dtype in FLOATS or dtype in COMPLEX:
                exact = rng.random() < 0.5
                if call.redop == "PRODUCT":
                    call.data = "exact_prod" if exact else "prod"
                else:
                    call.data = "exact" if exact else "real"
                    call.scale = rng.choice([1.0, 1.0, 0.01, 100.0])
        elif dtype in FLOATS or dtype in COMPLEX:
            call.data = "bits" if rng.random() < 0.5 else "real"
        rest = call.shape[1:]
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            call.variant = rng.choice(["even", "uneven"])
            if call.variant == "uneven":
                if kind == "all_to_all":
                    call.splits = [[rng.randrange(6) for _ in range(n)] for _ in range(n)]
                else:
                    call.sizes = [rng.randrange(6) for _ in range(n)]
                call.shape = (1,) + rest if not call.shape else call.shape
        elif kind in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            call.variant = "stack" if not call.shape or rng.random() < 0.4 else "concat"
        elif kind == "all_to_all_single":
            call.variant = rng.choice(["even", "uneven"])
            if not call.shape:
                call.shape = (1,)
            if call.variant == "uneven":
                call.splits = [[rng.randrange(5) for _ in range(n)] for _ in range(n)]
        elif kind == "send_recv":
            call.variant = rng.choice(["blocking", "nonblocking"])
            a, b = rng.sample(range(n), 2)
            call.messages = [
                ((a, b) if rng.random() < 0.7 else (b, a)) + (_pick_shape(rng, big=False), rng.choice([0, 0, 5]))
                for _ in range(rng.randint(1, 3))
            ]
            if call.variant == "blocking":
                call.async_op = False
        elif kind == "batch_isend_irecv":
            call.messages = []
            for _ in range(rng.randint(1, 2 * n)):
                src, dst = rng.sample(range(n), 2)
                call.messages.append((src, dst, _pick_shape(rng, big=rng.random() < 0.2), rng.choice([0, 0, 3])))
        if "gloo-a2a-idle-rank" in avoid and call.splits:
            for r in range(n):  # give a rank that would send and receive nothing one element
                if not sum(call.splits[r]) and not sum(row[r] for row in call.splits):
                    call.splits[r][(r + 1) % n] = 1
        _draw_shared(seed, call, n)
        _draw_coalesced(seed, call)
        if call.async_op:
            pending += 1
        # async calls stay in flight (across later sync calls, other groups) until a flush
        call.flush = pending >= 4 or (pending > 0 and rng.random() < 0.35)
        if call.flush:
            pending = 0
        calls.append(call)
    return calls


def _draw_shared(seed: int, call: Call, n: int) -> None:
    """Which ranks' buffers lie in the group's shared memory, where the peers
    read them in place (large enough ones only; every mix of ranks in and out
    occurs). Drawn from its own stream, so the rest of a seed's sequence is
    the same as before this existed."""
    rng = random.Random(_mix(seed, call.index, 0x5EED))
    if rng.random() < 0.5:
        everyone = (1 << n) - 1
        call.shared = everyone if rng.random() < 0.3 else rng.randrange(1, 1 << n)
        call.share_via = rng.choice(["adopt", "alloc"])


# what torch turns a _coalescing_manager block of these into: one coalesced call to the backend
COALESCIBLE = {
    "all_reduce": dist.all_reduce,
    "all_gather_into_tensor": dist.all_gather_into_tensor,
    "reduce_scatter_tensor": dist.reduce_scatter_tensor,
}


def _draw_coalesced(seed: int, call: Call) -> None:
    """Whether our group issues the call through its coalesced form; drawn
    from its own stream, like ``_draw_shared``."""
    rng = random.Random(_mix(seed, call.index, 0xC0A1))
    call.coalesced = call.kind in COALESCIBLE and rng.random() < 0.3


# ---------------------------------------------------------------------------
# data


def _mix(*values: int) -> int:
    h = 0x243F6A8885A308D3
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


def make_data(seed: int, call: Call, rank: int, slot: int, shape: Shape) -> torch.Tensor:
    """Rank ``rank``'s input number ``slot`` for ``call``: deterministic, contiguous."""
    g = torch.Generator().manual_seed(_mix(seed, call.index, rank, slot))
    dtype, numel = call.dtype, math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in INTS or call.data == "bits":
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
        return raw.view(dtype).reshape(shape)
    cplx = dtype in COMPLEX
    if call.data == "exact":
        parts = [torch.randint(-4, 5, shape, generator=g).double() for _ in range(2 if cplx else 1)]
    elif call.data == "exact_prod":
        if cplx:  # components in {-1, 0, 1}, never both zero
            re = torch.randint(-1, 2, shape, generator=g).double()
            im = torch.randint(-1, 2, shape, generator=g).double()
            im = torch.where((re == 0) & (im == 0), torch.ones_like(im), im)
            parts = [re, im]
        else:
            mag = torch.randint(1, 3, shape, generator=g).double()
            parts = [mag * (torch.randint(0, 2, shape, generator=g).double() * 2 - 1)]
    elif call.data == "prod":  # magnitude in [0.5, 1.5]
        mag = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        if cplx:
            phase = torch.rand(shape, generator=g, dtype=torch.float64) * (2 * math.pi)
            parts = [mag * torch.cos(phase), mag * torch.sin(phase)]
        else:
            parts = [mag * (torch.randint(0, 2, shape, generator=g).double() * 2 - 1)]
    else:  # real: uniform in [-scale, scale]
        parts = [
            (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * call.scale for _ in range(2 if cplx else 1)
        ]
    value = torch.complex(parts[0], parts[1]) if cplx else parts[0]
    return value.to(dtype)


def _sentinel(call: Call, shape: Shape) -> torch.Tensor:
    """What output buffers hold before the op (so a missing write shows)."""
    if call.dtype == torch.bool:
        return torch.full(shape, bool(call.fill % 2))
    value = [77, -3, 0x5A, 1][call.fill] if call.dtype != torch.uint8 else [77, 3, 0x5A, 1][call.fill]
    return torch.full(shape, value, dtype=call.dtype)


# ---------------------------------------------------------------------------
# reference math


def reduce_ref(call: Call, xs: list[torch.Tensor]) -> torch.Tensor:
    """Reduce the ranks' inputs with plain torch math (README semantics)."""
    op, dtype, n = call.redop, call.dtype, len(xs)
    if dtype == torch.bool:
        fn = {
            "SUM": torch.logical_or,
            "MAX": torch.logical_or,
            "BOR": torch.logical_or,
            "PRODUCT": torch.logical_and,
            "MIN": torch.logical_and,
            "BAND": torch.logical_and,
            "BXOR": torch.logical_xor,
        }[op]
        return _fold(fn, xs)
    if op == "MIN":
        return _fold(torch.minimum, xs)
    if op == "MAX":
        return _fold(torch.maximum, xs)
    if dtype in INTS:
        fn = {
            "SUM": torch.add,
            "AVG": torch.add,
            "PRODUCT": torch.mul,
            "BAND": torch.bitwise_and,
            "BOR": torch.bitwise_or,
            "BXOR": torch.bitwise_xor,
        }[op]
        out = _fold(fn, xs)  # wraps in dtype
        return torch.div(out, n, rounding_mode="trunc") if op == "AVG" else out
    wide = [x.to(torch.complex128 if dtype in COMPLEX else torch.float64) for x in xs]
    if op == "PREMUL_SUM":
        wide = [w * call.factor for w in wide]
    out = _fold(torch.mul if op == "PRODUCT" else torch.add, wide)
    if op == "AVG":
        out = out / n
    return out.to(dtype)


def _fold(fn: Callable, xs: list[torch.Tensor]) -> torch.Tensor:
    out = xs[0].clone()
    for x in xs[1:]:
        out = fn(out, x)
    return out


def gloo_supports(call: Call) -> bool:
    """Whether gloo (torch 2.13) runs this call: probed, see the module docstring."""
    if call.dtype == torch.int16:  # gloo's collectives have no int16 ("Invalid scalar type")
        return call.kind in P2P
    if call.kind in REDUCING:
        if call.redop == "PREMUL_SUM":
            return False
        if call.redop == "AVG" and not (call.dtype in FLOATS or call.dtype in COMPLEX):
            return False
        if call.dtype in COMPLEX and call.redop not in ("SUM", "AVG"):
            return False
        return True
    if call.kind == "all_gather":
        return call.variant == "even"
    if call.kind == "all_to_all":
        return call.variant == "even"
    if call.kind == "gather":
        return call.dtype not in COMPLEX
    return True


# ---------------------------------------------------------------------------
# comparison


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.dtype.itemsize])


def _eps(dtype: torch.dtype) -> tuple[float, float]:
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)
    info = torch.finfo(real)
    return info.eps, info.tiny


def tolerance(call: Call, n: int) -> tuple[float, float] | None:
    """(atol, rtol) for a reduction's output, or None when it must be exact."""
    if call.kind not in REDUCING or call.redop in ("MIN", "MAX"):
        return None
    if not (call.dtype in FLOATS or call.dtype in COMPLEX):
        return None
    if call.data in ("exact", "exact_prod") and call.redop != "AVG":
        return None
    eps, tiny = _eps(call.dtype)
    if call.redop == "PRODUCT":  # "prod" data: magnitudes in [0.5, 1.5]
        bound = 1.5**n
    else:
        per = call.scale if call.data == "real" else 4.0
        bound = n * per * abs(call.factor or 1.0)
    c = 4.0 if (call.dtype in COMPLEX and call.redop == "PRODUCT") else 2.0
    return c * n * eps * bound + n * tiny, 2 * eps


def compare(got: torch.Tensor, want: torch.Tensor, mode: str, tol: tuple[float, float] | None) -> str | None:
    """None if ``got`` matches ``want``; else what differs (max difference, first element)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    if got.numel() == 0:
        return None
    g, w = got.detach().reshape(-1), want.detach().reshape(-1)
    if mode == "bits":
        bad = _bits(got) != _bits(want)
        if bad.any():
            if got.is_complex():
                bad = bad.view(-1, 2).any(1)
            i = int(bad.nonzero()[0])
            return (
                f"{int(bad.sum())}/{g.numel()} elements differ bitwise; first at flat index {i}: "
                f"got {g[i].item()!r} want {w[i].item()!r}"
            )
        return None
    if tol is None:
        if torch.equal(g, w):
            return None
        bad = g != w
        i = int(bad.nonzero()[0])
        if g.dtype == torch.bool:
            diff = "1"
        elif g.is_floating_point() or g.is_complex():
            diff = f"{(g.to(torch.complex128) - w.to(torch.complex128)).abs().max().item():.6g}"
        else:
            diff = str(int((g.long() - w.long()).abs().max()))
        return (
            f"{int(bad.sum())}/{g.numel()} elements differ (exact expected), max |diff| {diff}; "
            f"first at flat index {i}: got {g[i].item()!r} want {w[i].item()!r}"
        )
    atol, rtol = tol
    wide = torch.complex128 if g.is_complex() else torch.float64
    diff = (g.to(wide) - w.to(wide)).abs()
    allowed = atol + rtol * w.to(wide).abs()
    bad = ~(diff <= allowed)  # NaN in got counts as a mismatch
    if bad.any():
        i = int(bad.nonzero()[0])
        return (
            f"{int(bad.sum())}/{g.numel()} elements outside atol={atol:.3g} rtol={rtol:.3g}, "
            f"max |diff| {diff.max().item():.6g}; first at flat index {i}: "
            f"got {g[i].item()!r} want {w[i].item()!r}"
        )
    return None


# ---------------------------------------------------------------------------
# execution on one rank


@dataclasses.dataclass
class Issued:
    """One side of a call in flight: its works and the tensors to check afterwards."""

    works: list[Any] = dataclasses.field(default_factory=list)
    outputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    unchanged: list[tuple[str, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    gaps: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Pending:
    call: Call
    ours: Issued
    reference: dict[str, torch.Tensor]
    ref_name: str
    math: dict[str, torch.Tensor] | None  # torch math, when cross-checking gloo


def _layout_view(shape: Shape, layout: str) -> tuple[Shape, Callable[[torch.Tensor], torch.Tensor]]:
    """The allocation shape for ``layout`` and how to view it as ``shape``."""
    numel = math.prod(shape)
    if layout == "transpose" and len(shape) >= 2:
        alloc = shape[:-2] + (shape[-1], shape[-2])
        return alloc, lambda b: b.transpose(-1, -2)
    if layout == "stride" and len(shape) >= 1:
        alloc = shape[:-1] + (2 * shape[-1] + 1,)
        return alloc, lambda b: b[..., 1::2]
    if layout == "offset":
        return (numel + 5,), lambda b: b[3 : 3 + numel].view(shape)
    return shape, lambda b: b


_CPU = torch.device("cpu")


def _allocates_shared(group: Any) -> bool:
    """Whether ``group``'s CPU backend hands out buffers its peers read in
    place (torch 2.13's backend allocation hook, for FSDP2's opt-in)."""
    backend = group._get_backend(_CPU)
    return bool(getattr(backend, "supports_tensor_alloc", lambda _: False)(_CPU))


class RankRunner:
    """Runs the call list on one rank against groupcomm and gloo groups."""

    def __init__(
        self,
        seed: int,
        rank: int,
        world: int,
        cross_check: bool,
        max_failures: int,
        avoid: frozenset[str] = frozenset(),
        trace: bool = False,
    ) -> None:
        self.seed, self.rank, self.world, self.avoid, self.trace = seed, rank, world, avoid, trace
        self.cross_check, self.max_failures = cross_check, max_failures
        self.specs = group_specs(world)
        self.ours: list[Any] = []
        self.gloo: list[Any] = []
        for i, ranks in enumerate(self.specs):  # every rank makes every group, in order
            self.ours.append(dist.group.WORLD if i == 0 else dist.new_group(ranks))
            self.gloo.append(dist.new_group(ranks, backend="gloo"))
        self.failures: list[str] = []
        self.compared = 0
        self.shared_buffers = 0  # buffers that came to lie in a group's shared memory
        self.refs: collections.Counter = collections.Counter()

    # -- buffers -----------------------------------------------------------

    def _place(self, x: torch.Tensor, call: Call, ours: bool, issued: Issued, name: str) -> torch.Tensor:
        if not ours:
            return x.clone()
        alloc, view = _layout_view(tuple(x.shape), call.layout)
        base = self._shared(_sentinel(call, alloc), call)
        t = view(base)
        if (
            "contiguous-stride" in self.avoid
            and t.dim()
            and t.numel() <= 1
            and t.is_contiguous()
            and t.view(-1).stride(0) != 1
        ):
            return x.clone()
        t.copy_(x)
        if base.numel() != t.numel():
            mask = torch.ones(alloc, dtype=torch.bool)
            view(mask).fill_(False)
            issued.gaps.append((name, base, mask, base.clone()))
        return t

    def _shared(self, base: torch.Tensor, call: Call) -> torch.Tensor:
        """``base``, or a tensor equal to it in the group's shared memory if
        the call puts this rank's buffers there (and they are large enough)."""
        ranks = self.specs[call.group]
        if not call.shared >> ranks.index(self.rank) & 1:
            return base
        group = self.ours[call.group]
        if call.share_via == "alloc":
            if not _allocates_shared(group) or base.numel() * base.element_size() < 64 << 10:
                return base  # a plain tensor: no shared memory here, or too small to gain
            block = group._get_backend(_CPU).allocate_tensor(base.numel(), dtype=base.dtype, device=_CPU)
            moved = block.view(base.shape).copy_(base)
        else:
            from torch_groupcomm import get_coordinator

            moved = base
            if not get_coordinator(group).share_storage(base):
                return base
        self.shared_buffers += 1
        return moved

    def _input(self, x: torch.Tensor, call: Call, ours: bool, issued: Issued, name: str) -> torch.Tensor:
        t = self._place(x, call, ours, issued, name)
        issued.unchanged.append((name, t, x))
        return t

    def _output(self, shape: Shape, call: Call, ours: bool, issued: Issued, name: str) -> torch.Tensor:
        t = self._place(_sentinel(call, shape), call, ours, issued, name)
        issued.outputs[name] = t
        return t

    def data(self, call: Call, rank: int, slot: int = 0, shape: Shape | None = None) -> torch.Tensor:
        return make_data(self.seed, call, rank, slot, call.shape if shape is None else shape)

    def _redop(self, call: Call) -> Any:
        if call.redop == "PREMUL_SUM":
            factor = torch.tensor(call.factor, dtype=call.dtype) if call.factor_tensor else call.factor
            return dist._make_nccl_premul_sum(factor)
        return getattr(dist.ReduceOp, call.redop)

    # -- shapes shared by the issue and reference code ---------------------

    @staticmethod
    def _lead_rest(call: Call) -> tuple[int, Shape]:
        return (call.shape[0], call.shape[1:]) if call.shape else (1, ())

    def _list_shapes(self, call: Call, n: int) -> list[Shape]:
        """all_gather / reduce_scatter: the shape of each group rank's piece."""
        if call.variant == "uneven":
            return [(call.sizes[i],) + call.shape[1:] for i in range(n)]
        return [call.shape] * n

    def _a2a_shape(self, call: Call, src: int, dst: int) -> Shape:
        if call.variant == "uneven":
            return (call.splits[src][dst],) + call.shape[1:]
        return call.shape

    def _big_shape(self, call: Call, n: int) -> Shape:
        """all_gather_into_tensor output / reduce_scatter_tensor input."""
        if call.variant == "stack":
            return (n,) + call.shape
        return (n * call.shape[0],) + call.shape[1:]

    # -- issuing -----------------------------------------------------------

    def issue(self, call: Call, ours: bool) -> Issued:
        """Run ``call`` on our group (``ours``: drawn layout and async flag) or on gloo."""
        ranks = self.specs[call.group]
        group = self.ours[call.group] if ours else self.gloo[call.group]
        n, me = len(ranks), ranks.index(self.rank)
        async_op = call.async_op and ours
        iss = Issued()
        works: list[Any] = []
        k = call.kind

        def coalescible(*args, **kwargs) -> Any:
            """The call, or on our group maybe its coalesced form: the one op of a
            _coalescing_manager block (its manager stands for the Work)."""
            if not (call.coalesced and ours):
                return COALESCIBLE[k](*args, group=group, async_op=async_op, **kwargs)
            with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
                COALESCIBLE[k](*args, group=group, **kwargs)
            return cm if async_op else None

        if k in ("all_reduce", "reduce", "broadcast"):
            t = self._place(self.data(call, self.rank), call, ours, iss, "tensor")
            if k == "all_reduce":
                works.append(coalescible(t, op=self._redop(call)))
            elif k == "reduce":
                works.append(dist.reduce(t, dst=ranks[call.root], op=self._redop(call), group=group, async_op=async_op))
            else:
                works.append(dist.broadcast(t, src=ranks[call.root], group=group, async_op=async_op))
            if k != "reduce" or me == call.root:
                iss.outputs["tensor"] = t
        elif k == "all_gather":
            shapes = self._list_shapes(call, n)
            x = self._input(self.data(call, self.rank, 0, shapes[me]), call, ours, iss, "input")
            outs = [self._output(shapes[i], call, ours, iss, f"out[{i}]") for i in range(n)]
            works.append(dist.all_gather(outs, x, group=group, async_op=async_op))
        elif k == "all_gather_into_tensor":
            x = self._input(self.data(call, self.rank), call, ours, iss, "input")
            out = self._output(self._big_shape(call, n), call, ours, iss, "out")
            if not ours:  # gloo wants flat shapes for 0-d inputs; the values are what count
                x, out = x.reshape(-1), out.view(-1)
            works.append(coalescible(out, x))
        elif k == "reduce_scatter":
            shapes = self._list_shapes(call, n)
            ins = [
                self._input(self.data(call, self.rank, i, shapes[i]), call, ours, iss, f"input[{i}]") for i in range(n)
            ]
            out = self._output(shapes[me], call, ours, iss, "out")
            works.append(dist.reduce_scatter(out, ins, op=self._redop(call), group=group, async_op=async_op))
        elif k == "reduce_scatter_tensor":
            x = self._input(self.data(call, self.rank, 0, self._big_shape(call, n)), call, ours, iss, "input")
            out = self._output(call.shape, call, ours, iss, "out")
            if not ours:
                x, out = x.reshape(-1), out.view(-1)
            works.append(coalescible(out, x, op=self._redop(call)))
        elif k == "all_to_all_single":
            lead, rest = self._lead_rest(call)
            if call.variant == "even":
                in_shape = out_shape = (n * lead,) + rest
                in_splits = out_splits = None
            else:
                in_splits = call.splits[me]
                out_splits = [call.splits[s][me] for s in range(n)]
                in_shape, out_shape = (sum(in_splits),) + rest, (sum(out_splits),) + rest
            x = self._input(self.data(call, self.rank, 0, in_shape), call, ours, iss, "input")
            out = self._output(out_shape, call, ours, iss, "out")
            works.append(dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op))
        elif k == "all_to_all":
            ins = [
                self._input(self.data(call, self.rank, d, self._a2a_shape(call, me, d)), call, ours, iss, f"input[{d}]")
                for d in range(n)
            ]
            outs = [self._output(self._a2a_shape(call, s, me), call, ours, iss, f"out[{s}]") for s in range(n)]
            if ours or _GLOO_LIST_ALLTOALL:
                works.append(dist.all_to_all(outs, ins, group=group, async_op=async_op))
            else:
                sizes_in, sizes_out = [t.numel() for t in ins], [t.numel() for t in outs]
                flat = torch.empty(sum(sizes_out), dtype=call.dtype)
                works.append(
                    dist.all_to_all_single(
                        flat,
                        torch.cat([t.reshape(-1) for t in ins]),
                        sizes_out,
                        sizes_in,
                        group=group,
                        async_op=async_op,
                    )
                )
                iss.outputs.update(
                    {f"out[{s}]": piece.view(outs[s].shape) for s, piece in enumerate(flat.split(sizes_out))}
                )
        elif k == "gather":
            x = self._input(self.data(call, self.rank), call, ours, iss, "input")
            outs = (
                [self._output(call.shape, call, ours, iss, f"out[{i}]") for i in range(n)] if me == call.root else None
            )
            works.append(dist.gather(x, outs, dst=ranks[call.root], group=group, async_op=async_op))
        elif k == "scatter":
            pieces = None
            if me == call.root:
                pieces = [self._input(self.data(call, self.rank, i), call, ours, iss, f"input[{i}]") for i in range(n)]
            out = self._output(call.shape, call, ours, iss, "out")
            works.append(dist.scatter(out, pieces, src=ranks[call.root], group=group, async_op=async_op))
        elif k == "barrier":
            works.append(dist.barrier(group=group, async_op=async_op))
        elif k == "send_recv":
            for m, (src, dst, shape, tag) in enumerate(call.messages):
                if me == src:
                    t = self._input(self.data(call, self.rank, m, shape), call, ours, iss, f"send[{m}]")
                    if call.variant == "blocking":
                        dist.send(t, dst=ranks[dst], group=group, tag=tag)
                    else:
                        works.append(dist.isend(t, dst=ranks[dst], group=group, tag=tag))
                elif me == dst:
                    t = self._output(shape, call, ours, iss, f"msg[{m}]")
                    if call.variant == "blocking":
                        dist.recv(t, src=ranks[src], group=group, tag=tag)
                    else:
                        works.append(dist.irecv(t, src=ranks[src], group=group, tag=tag))
        elif k == "batch_isend_irecv":
            ops = []
            for m, (src, dst, shape, tag) in enumerate(call.messages):
                if me == src:
                    t = self._input(self.data(call, self.rank, m, shape), call, ours, iss, f"send[{m}]")
                    ops.append(dist.P2POp(dist.isend, t, ranks[dst], group=group, tag=tag))
                elif me == dst:
                    t = self._output(shape, call, ours, iss, f"msg[{m}]")
                    ops.append(dist.P2POp(dist.irecv, t, ranks[src], group=group, tag=tag))
            if ops:
                works.extend(dist.batch_isend_irecv(ops))
        else:
            raise ValueError(k)
        iss.works = [w for w in works if w is not None]
        if not async_op or not ours:
            for w in iss.works:
                w.wait()
            iss.works = []
        return iss

    # -- reference math ----------------------------------------------------

    def expected(self, call: Call) -> dict[str, torch.Tensor]:
        """This rank's outputs computed with torch math from every rank's input."""
        ranks = self.specs[call.group]
        n, me = len(ranks), ranks.index(self.rank)
        k = call.kind
        d = self.data
        if k in ("all_reduce", "reduce"):
            if k == "reduce" and me != call.root:
                return {}
            return {"tensor": reduce_ref(call, [d(call, r) for r in ranks])}
        if k == "broadcast":
            return {"tensor": d(call, ranks[call.root])}
        if k == "all_gather":
            shapes = self._list_shapes(call, n)
            return {f"out[{i}]": d(call, ranks[i], 0, shapes[i]) for i in range(n)}
        if k == "all_gather_into_tensor":
            xs = [d(call, r) for r in ranks]
            return {"out": torch.stack(xs) if call.variant == "stack" else torch.cat(xs)}
        if k == "reduce_scatter":
            shapes = self._list_shapes(call, n)
            return {"out": reduce_ref(call, [d(call, r, me, shapes[me]) for r in ranks])}
        if k == "reduce_scatter_tensor":
            big = self._big_shape(call, n)
            return {"out": reduce_ref(call, [d(call, r, 0, big).reshape(n, -1)[me].reshape(call.shape) for r in ranks])}
        if k == "all_to_all_single":
            lead, rest = self._lead_rest(call)
            pieces = []
            for s in range(n):
                if call.variant == "even":
                    x = d(call, ranks[s], 0, (n * lead,) + rest)
                    pieces.append(x.narrow(0, me * lead, lead))
                else:
                    row = call.splits[s]
                    x = d(call, ranks[s], 0, (sum(row),) + rest)
                    pieces.append(x.narrow(0, sum(row[:me]), row[me]))
            return {"out": torch.cat(pieces)}
        if k == "all_to_all":
            return {f"out[{s}]": d(call, ranks[s], me, self._a2a_shape(call, s, me)) for s in range(n)}
        if k == "gather":
            return {f"out[{i}]": d(call, ranks[i]) for i in range(n)} if me == call.root else {}
        if k == "scatter":
            return {"out": d(call, ranks[call.root], me)}
        if k in P2P:
            return {
                f"msg[{m}]": d(call, ranks[src], m, shape)
                for m, (src, dst, shape, _) in enumerate(call.messages)
                if dst == me
            }
        return {}

    # -- checking ----------------------------------------------------------

    def _mode(self, call: Call) -> str:
        return "value" if call.kind in REDUCING else "bits"

    def _fail(self, call: Call, what: str) -> None:
        if len(self.failures) < self.max_failures:
            ranks = self.specs[call.group]
            self.failures.append(f"seed={self.seed} call={call.index} rank={self.rank} {call.describe(ranks)}: {what}")

    def check(self, p: Pending) -> None:
        call, ours = p.call, p.ours
        n = len(self.specs[call.group])
        mode, tol = self._mode(call), tolerance(call, n)
        for w in ours.works:
            w.wait()
        ours.works = []
        if set(ours.outputs) != set(p.reference):
            self._fail(call, f"outputs {sorted(ours.outputs)} but reference has {sorted(p.reference)}")
        for name in ours.outputs:
            if name in p.reference:
                self.compared += 1
                err = compare(ours.outputs[name], p.reference[name], mode, tol)
                if err:
                    self._fail(call, f"output {name} vs {p.ref_name}: {err}")
            if p.math is not None and name in p.math:
                err = compare(p.reference[name], p.math[name], mode, tol)
                if err:
                    self._fail(call, f"REFERENCE DISAGREEMENT: gloo {name} vs torch math: {err}")
        for name, t, original in ours.unchanged:
            if not torch.equal(_bits(t), _bits(original)):
                self._fail(call, f"input {name} was modified by the op")
        for name, base, mask, saved in ours.gaps:
            if not torch.equal(_bits(base[mask]), _bits(saved[mask])):
                self._fail(call, f"{name}: elements outside the {call.layout} view were written")

    def _checked(self, p: Pending) -> None:
        if self.trace:
            print(f"[rank {self.rank}] wait {p.call.index}", file=sys.stderr, flush=True)
        try:
            self.check(p)
        except Exception as e:  # a failed wait: the group may be unusable, stop this rank
            raise RuntimeError(
                f"seed={self.seed} call={p.call.index} rank={self.rank} "
                f"{p.call.describe(self.specs[p.call.group])}: wait raised "
                f"{type(e).__name__}: {e}"
            ) from e

    def run(self, calls: Sequence[Call]) -> dict[str, Any]:
        """Issue every call this rank is part of, check each after its completion."""
        pending: list[Pending] = []
        executed: collections.Counter = collections.Counter()
        for call in calls:
            ranks = self.specs[call.group]
            if self.rank in ranks:
                if self.trace:
                    print(f"[rank {self.rank}] call {call.index} {call.describe(ranks)}", file=sys.stderr, flush=True)
                try:
                    ours = self.issue(call, ours=True)
                    if gloo_supports(call):
                        ref, ref_name = self.issue(call, ours=False).outputs, "gloo"
                        math_ref = self.expected(call) if self.cross_check else None
                    else:
                        ref, ref_name, math_ref = self.expected(call), "torch math", None
                except Exception as e:
                    raise RuntimeError(
                        f"seed={self.seed} call={call.index} rank={self.rank} "
                        f"{call.describe(ranks)}: raised {type(e).__name__}: {e}"
                    ) from e
                self.refs[ref_name] += 1
                executed[call.label] += 1
                p = Pending(call, ours, ref, ref_name, math_ref)
                if call.async_op:
                    pending.append(p)
                else:
                    self._checked(p)
            if call.flush:
                for p in pending:
                    self._checked(p)
                pending = []
        for p in pending:
            self._checked(p)
        dist.barrier()
        return {
            "rank": self.rank,
            "failures": self.failures,
            "compared": self.compared,
            "refs": dict(self.refs),
            "executed": dict(executed),
            "shared_buffers": self.shared_buffers,
            "shares": _allocates_shared(self.ours[0]),
        }


def rank_main(
    rank: int,
    world: int,
    seed: int,
    count: int,
    cross_check: bool = False,
    only: Sequence[int] | None = None,
    trace: bool = False,
    dump_after: float | None = None,
    max_failures: int = 20,
) -> dict[str, Any]:
    """Entry point inside a spawned rank (after init_process_group("groupcomm")).
    ``trace`` logs each call to stderr; ``dump_after`` seconds dumps every
    thread's stack to stderr (to locate a hang)."""
    if dump_after:
        faulthandler.dump_traceback_later(dump_after)
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor & co. are deprecated
    avoid = active_exclusions(os.environ)
    calls = generate_calls(seed, world, count, avoid)
    if only is not None:
        wanted = set(only)
        calls = [c for c in calls if c.index in wanted]
    try:
        return RankRunner(seed, rank, world, cross_check, max_failures, avoid, trace).run(calls)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------
# driver


@dataclasses.dataclass
class Summary:
    """What a run did and found."""

    world: int
    seed: int
    calls: int
    per_label: dict[str, int]
    per_dtype: dict[str, int]
    refs: dict[str, int]
    compared: int
    failures: list[str]
    seconds: float
    executed: dict[str, int] = dataclasses.field(default_factory=dict)  # label -> rank-calls run
    excluded: list[str] = dataclasses.field(default_factory=list)
    shared_buffers: int = 0  # buffers (all ranks) that lay in a group's shared memory, read there by the peers
    shares: bool = False  # every rank's default group could place buffers there
    coalesced: int = 0  # calls our groups issued through their coalesced form

    @property
    def passed(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [
            f"differential: world={self.world} seed={self.seed} calls={self.calls} "
            f"in {self.seconds:.1f}s, {self.compared} outputs compared "
            f"(references: " + ", ".join(f"{k} {v}" for k, v in sorted(self.refs.items())) + "), "
            f"{self.shared_buffers} buffers in shared memory, {self.coalesced} calls coalesced"
        ]
        lines.append("calls per op: " + ", ".join(f"{k}={v}" for k, v in sorted(self.per_label.items())))
        lines.append("calls per dtype: " + ", ".join(f"{k}={v}" for k, v in sorted(self.per_dtype.items())))
        for key in self.excluded:
            lines.append(f"steered around known bug {key}: {EXCLUDED[key][0]}")
        if self.passed:
            lines.append("RESULT: all passed")
        else:
            lines.append(f"RESULT: {len(self.failures)} mismatches; first:")
            lines += ["  " + f for f in self.failures[:10]]
        return "\n".join(lines)


def run(
    world: int,
    calls: int,
    seed: int,
    env: dict[str, Any] | None = None,
    cross_check: bool = False,
    only: Sequence[int] | None = None,
    timeout: float | None = None,
    trace: bool = False,
    dump_after: float | None = None,
) -> Summary:
    """Spawn ``world`` ranks, run the call sequence for ``seed``, collect a summary."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _harness import run_ranks

    env = dict(env or {})
    plan = generate_calls(seed, world, calls, active_exclusions(env))
    if only is not None:
        plan = [c for c in plan if c.index in set(only)]
    start = time.monotonic()
    kwargs = {} if timeout is None else {"timeout": timeout}
    results = run_ranks(rank_main, world, args=(seed, calls, cross_check, only, trace, dump_after), env=env, **kwargs)
    seconds = time.monotonic() - start
    failures = sorted((f for r in results for f in r["failures"]), key=lambda f: int(f.split(" call=")[1].split()[0]))
    refs: collections.Counter = collections.Counter()
    executed: collections.Counter = collections.Counter()
    for r in results:
        refs.update(r["refs"])
        executed.update(r["executed"])
    return Summary(
        world=world,
        seed=seed,
        calls=len(plan),
        per_label=dict(collections.Counter(c.label for c in plan)),
        per_dtype=dict(collections.Counter(str(c.dtype).replace("torch.", "") for c in plan)),
        refs=dict(refs),
        compared=sum(r["compared"] for r in results),
        failures=failures,
        seconds=seconds,
        executed=dict(executed),
        excluded=sorted(active_exclusions(env)),
        shared_buffers=sum(r["shared_buffers"] for r in results),
        shares=all(r["shares"] for r in results),
        coalesced=sum(c.coalesced for c in plan),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument(
        "--cross-check",
        action="store_true",
        help="also compare gloo's results with torch math (validates the references)",
    )
    parser.add_argument(
        "--only",
        type=lambda s: [int(x) for x in s.split(",")],
        help="replay only these call indices (comma separated) of the sequence",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the ranks, e.g. GROUPCOMM_CPU_COMMUNICATOR=gloo; a value "
        "with one comma-separated item per rank gives each rank its own "
        "(GROUPCOMM_HOST_ID=a,a,b,b)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds the ranks may take")
    parser.add_argument(
        "--no-exclusions", action="store_true", help="do not steer around the known bugs in EXCLUDED (to check a fix)"
    )
    parser.add_argument("--trace", action="store_true", help="log every call and wait to stderr")
    parser.add_argument(
        "--dump-after",
        type=float,
        metavar="S",
        help="dump every rank's Python stacks to stderr after S seconds (hang hunting)",
    )
    args = parser.parse_args(argv)
    env: dict[str, Any] = {}
    for item in args.env:
        key, value = item.split("=", 1)
        items = value.split(",")
        env[key] = items if len(items) == args.world > 1 else value
    if args.no_exclusions:
        env["DIFFERENTIAL_NO_EXCLUSIONS"] = "1"
    summary = run(
        args.world,
        args.calls,
        args.seed,
        env=env,
        cross_check=args.cross_check,
        only=args.only,
        timeout=args.timeout,
        trace=args.trace,
        dump_after=args.dump_after,
    )
    print(summary.format())
    return 0 if summary.passed else 1


if __name__ == "__main__":
    sys.exit(main())
