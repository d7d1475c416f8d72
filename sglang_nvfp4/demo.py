"""The README's main job (until the SGLang server lands): the reference on a small random problem.

Writes two requests' K/V into an NVFP4 cache on shuffled pages, runs sparse attention with the
kernel contract's numerics and in float64, and prints a summary. ``python -m sglang_nvfp4.demo``
"""

from __future__ import annotations

import time

import torch

from . import format as fmt
from .reference import sparse_prefill_reference


def main(seq_lens=(3000, 1700), heads=16, kv_heads=1, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // fmt.PAGE_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(blocks), generator=gen).int()
    block_table = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32)
    cache = fmt.alloc_cache(sum(blocks), kv_heads)
    start = 0
    for r, n in enumerate(seq_lens):
        block_table[r, : blocks[r]] = perm[start : start + blocks[r]]
        start += blocks[r]
        slots = block_table[r].long()[torch.arange(n) // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + torch.arange(n) % fmt.PAGE_SIZE
        k, v = torch.randn(2, n, kv_heads, fmt.HEAD_DIM, generator=gen)
        fmt.write_kv(cache, slots, k, v, 1.0, 1.0)

    req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(seq_lens)])
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in seq_lens])
    q = torch.randn(len(req), heads, fmt.HEAD_DIM, generator=gen).bfloat16()
    # Selection: own block, first block, and random earlier blocks up to TOPK.
    own = pos.long() // fmt.PAGE_SIZE
    scores = torch.rand(kv_heads, len(req), max(blocks), generator=gen)
    scores = scores.masked_fill(torch.arange(max(blocks)) > own[:, None], -1.0)
    scores[:, torch.arange(len(req)), own] = 2.0
    scores[:, :, 0] = torch.where(scores[:, :, 0] >= 0, 1.5, scores[:, :, 0])
    val, idx = scores.topk(min(fmt.TOPK, max(blocks)), dim=-1)
    topk = torch.where(val >= 0, idx, -1).int()

    t0 = time.perf_counter()
    out = sparse_prefill_reference(q, cache, topk, block_table, req, pos, 1.0, 1.0, fmt.HEAD_DIM**-0.5)
    elapsed = time.perf_counter() - t0
    ideal = sparse_prefill_reference(q, cache, topk, block_table, req, pos, 1.0, 1.0, fmt.HEAD_DIM**-0.5, mode="ideal")
    err = ((out.double() - ideal).norm() / ideal.norm()).item()
    selected = (topk >= 0).sum(-1).float().mean().item()
    print(f"tokens {len(req)} in {len(seq_lens)} requests, {heads} query / {kv_heads} KV heads, head_dim {fmt.HEAD_DIM}")
    print(f"cache: {tuple(cache.shape)} uint8 = {cache.numel() / 2**20:.2f} MiB "
          f"({fmt.BYTES_PER_TOKEN_PER_HEAD} B per token per KV head vs {fmt.BF16_BYTES_PER_TOKEN_PER_HEAD} B in bf16: "
          f"{fmt.BF16_BYTES_PER_TOKEN_PER_HEAD / fmt.BYTES_PER_TOKEN_PER_HEAD:.2f}x the tokens)")
    print(f"blocks selected per token and KV head: {selected:.1f} of up to {fmt.TOPK}")
    print(f"reference sparse prefill: {elapsed * 1e3:.0f} ms on {out.device}; "
          f"kernel numerics vs float64: relative error {err:.2e}")


if __name__ == "__main__":
    main()
