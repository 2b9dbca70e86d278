"""Tensor-parallel decoding on the ``groupcomm`` backend, compiled.

    torchrun --nproc-per-node 2 examples/tp_decode.py [--backend gloo] [--batch 4] [--tokens 32]

A small Llama-style decoder (``torch_groupcomm/bench/decoder.py``) is
sharded over the ranks Megatron-style: each rank holds its share of the
attention heads and of the MLP, and the row-parallel layers' partial sums are
added up by an all-reduce, here the coordinator's
``get_coordinator().all_reduce`` (a torch custom op, so
``torch.compile(fullgraph=True)`` traces through it). With ``--backend gloo``
the same model uses torch's functional all-reduce over gloo instead. Every
rank draws the same weights and prompts, so both backends must generate the
same tokens. Only rank 0 prints: the first sequence's tokens, then one
result line, e.g.

    result: 4 x 32 tokens generated greedily on 2 ranks (groupcomm), compiled: 1234.5 tokens/s; tokens 0123456789ab
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torch_groupcomm import get_coordinator
from torch_groupcomm.bench.decoder import DECODERS, ShardedWeights, TPDecoder, digest, generate, prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="groupcomm")
    parser.add_argument("--decoder", default="small", choices=sorted(DECODERS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "groupcomm":
        all_reduce = get_coordinator().all_reduce
    else:
        group = dist.group.WORLD
        all_reduce = lambda x: funcol.all_reduce(x, "sum", group)
    weights = ShardedWeights(DECODERS[args.decoder], rank, world, torch.float32)
    model = torch.compile(TPDecoder(weights, args.batch, all_reduce), fullgraph=True, dynamic=False)
    prompts = prompt(args.batch, 8, weights.config.vocab)

    start = time.perf_counter()
    tokens, _ = generate(model, prompts, args.tokens)  # the first call compiles
    compiled_s = time.perf_counter() - start
    again, seconds = generate(model, prompts, args.tokens)
    if not torch.equal(tokens, again):
        raise RuntimeError(f"rank {rank}: a second generation gave other tokens")
    every = [None] * world
    dist.all_gather_object(every, digest(tokens))
    if rank == 0:  # one process prints, so lines from several ranks never interleave
        if len(set(every)) != 1:
            raise RuntimeError(f"the ranks generated different tokens: {every}")
        print(f"backend={args.backend} world={world}: {args.decoder} decoder, compiled in {compiled_s:.1f} s")
        print(f"sequence 0: prompt {prompts[0].tolist()} -> {tokens[0].tolist()}")
        print(
            f"result: {args.batch} x {args.tokens} tokens generated greedily on {world} ranks ({args.backend}), "
            f"compiled: {args.batch * args.tokens / seconds:.1f} tokens/s; tokens {every[0]}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
