"""A small Llama-style decoder, sharded Megatron-style over a group, that
generates tokens greedily from a static key/value cache.

Every rank draws the same full weights from one seed and keeps its share:
attention's q/k/v projections are column-parallel by heads (each rank owns
``heads / world`` heads and their slice of the cache), ``o_proj`` is
row-parallel, its partial sums added up by ``all_reduce``; the MLP's gate and
up projections are column-parallel, ``down`` row-parallel with an
``all_reduce``; ``lm_head`` is row-parallel too (each rank multiplies its
slice of the hidden features, as DeepSpeed's AutoTP shards it) and the logits are
all-reduced, so every rank picks the same next token. The embedding and the
norms are replicated. A token thus costs ``2 * layers + 1`` all-reduces of
``batch x hidden`` (the last one ``batch x vocab``): small messages, where
what a backend spends per call decides the speed.

The cache is preallocated for ``max_seq`` positions and written at the step's
position; attention runs over all of it with the later positions masked out,
so every step has the same shapes and one compiled graph serves them all.
``all_reduce`` is any function from a tensor to its sum over the group
(``GroupCoordinator.all_reduce``, a functional collective, DeepSpeed's op):
the decoder knows nothing else of communication.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's shape; ``max_seq`` bounds prompt plus generated tokens."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    max_seq: int = 64
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.hidden // self.heads

    def describe(self) -> str:
        """One line for the bench's preamble."""
        return (
            f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads, ffn {self.ffn}, "
            f"vocab {self.vocab}, cache {self.max_seq} positions"
        )


DECODERS = {
    "small": DecoderConfig(vocab=8192, hidden=512, layers=4, heads=8, ffn=1408),
    "tiny": DecoderConfig(vocab=256, hidden=64, layers=2, heads=4, ffn=128),
}


def check_shardable(config: DecoderConfig, world: int) -> None:
    """Raise ValueError unless heads, ffn and hidden split evenly over ``world`` ranks."""
    if config.hidden % config.heads:
        raise ValueError(f"hidden {config.hidden} is not a multiple of heads {config.heads}")
    for name in ("heads", "ffn", "hidden"):
        if getattr(config, name) % world:
            raise ValueError(f"{name} {getattr(config, name)} does not split evenly over {world} ranks")


class ShardedWeights(nn.Module):
    """Rank ``rank``'s share of the decoder's weights (out of ``world``),
    from the same full weights on every rank (seed ``seed``). One set serves
    several :class:`TPDecoder` (one per backend and batch size)."""

    def __init__(self, config: DecoderConfig, rank: int, world: int, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        check_shardable(config, world)
        self.config = config
        self.local_heads = config.heads // world
        # lm_head's share of the hidden features, which every rank holds whole
        self.hidden_slice = slice(rank * config.hidden // world, (rank + 1) * config.hidden // world)
        gen = torch.Generator().manual_seed(seed)

        def full(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen) / cols**0.5

        def rows_of(w: torch.Tensor) -> torch.Tensor:  # column-parallel: this rank's output features
            return w.chunk(world, 0)[rank].to(dtype).contiguous()

        def cols_of(w: torch.Tensor) -> torch.Tensor:  # row-parallel: this rank's input features
            return w.chunk(world, 1)[rank].to(dtype).contiguous()

        h = config.hidden
        self.embed = nn.Parameter(torch.randn(config.vocab, h, generator=gen).to(dtype), requires_grad=False)
        self.layers = nn.ModuleList()
        for _ in range(config.layers):
            layer = nn.Module()
            # q, k and v stacked: one matmul gives this rank's heads of all three
            qkv = [rows_of(full(h, h)) for _ in range(3)]
            layer.qkv = nn.Parameter(torch.cat(qkv), requires_grad=False)
            layer.o = nn.Parameter(cols_of(full(h, h)), requires_grad=False)
            layer.gate_up = nn.Parameter(
                torch.cat([rows_of(full(config.ffn, h)), rows_of(full(config.ffn, h))]), requires_grad=False
            )
            layer.down = nn.Parameter(cols_of(full(h, config.ffn)), requires_grad=False)
            layer.attn_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
            layer.mlp_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.lm_head = nn.Parameter(cols_of(full(config.vocab, h)), requires_grad=False)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).double() / config.head_dim)
        angles = torch.outer(torch.arange(config.max_seq).double(), inv_freq)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * scale).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves of each head's features (x: batch, heads, head_dim)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class TPDecoder(nn.Module):
    """One decode step of ``batch`` sequences on this rank's ``weights``,
    with its own key/value cache; ``all_reduce`` sums the row-parallel
    layers' partial outputs over the group."""

    def __init__(self, weights: ShardedWeights, batch: int, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weights = weights
        self.all_reduce = all_reduce
        config = weights.config
        dtype = weights.embed.dtype
        shape = (config.layers, batch, weights.local_heads, config.max_seq, config.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("positions", torch.arange(config.max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The next token of each sequence (``tokens``: batch int64, the
        tokens at position ``pos``, a 0-d int64 tensor)."""
        w, config = self.weights, self.weights.config
        batch, heads, dim = tokens.shape[0], w.local_heads, config.head_dim
        at = pos.view(1)
        cos, sin = w.cos.index_select(0, at), w.sin.index_select(0, at)
        visible = (self.positions <= pos).view(1, 1, 1, -1)
        x = w.embed[tokens]
        for i, layer in enumerate(w.layers):
            a = _rms_norm(x, layer.attn_norm, config.eps)
            q, k, v = F.linear(a, layer.qkv).view(batch, 3, heads, dim).unbind(1)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.k_cache[i].index_copy_(2, at, k.unsqueeze(2))
            self.v_cache[i].index_copy_(2, at, v.unsqueeze(2))
            out = F.scaled_dot_product_attention(q.unsqueeze(2), self.k_cache[i], self.v_cache[i], attn_mask=visible)
            x = x + self.all_reduce(F.linear(out.reshape(batch, heads * dim), layer.o))
            m = _rms_norm(x, layer.mlp_norm, config.eps)
            gate, up = F.linear(m, layer.gate_up).chunk(2, dim=-1)
            x = x + self.all_reduce(F.linear(F.silu(gate) * up, layer.down))
        x = _rms_norm(x, w.norm, config.eps)[:, w.hidden_slice]
        logits = self.all_reduce(F.linear(x, w.lm_head))
        return logits.argmax(dim=-1)


def prompt(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """``batch`` prompts of ``length`` random tokens, the same on every rank."""
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(step: nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy decoding: feed ``prompt`` (batch x length) one position per
    ``step`` (a :class:`TPDecoder`, compiled or not), then ``new_tokens``
    more. Returns the new tokens (batch x new_tokens) and the seconds the
    new tokens took (the prompt's first ``length - 1`` steps excluded)."""
    batch, length = prompt.shape
    positions = step.weights.config.max_seq  # a compiled module forwards attributes to its own
    if length < 1 or length - 1 + new_tokens > positions:
        raise ValueError(
            f"a prompt of {length} tokens and {new_tokens} new ones do not fit in {positions} cache positions"
        )
    for pos in range(length - 1):
        step(prompt[:, pos].contiguous(), torch.tensor(pos))
    tokens = prompt[:, -1].contiguous()
    out = []
    start = time.perf_counter()
    for pos in range(length - 1, length - 1 + new_tokens):
        tokens = step(tokens, torch.tensor(pos))
        out.append(tokens)
    seconds = time.perf_counter() - start
    return torch.stack(out, dim=1), seconds


def digest(tokens: torch.Tensor) -> str:
    """A short fingerprint of generated token ids, to compare runs by eye."""
    return hashlib.sha256(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:12]
