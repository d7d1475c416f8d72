"""Random multi-request sparse-attention problems shared by the test modules (seeded, CPU or GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_nvfp4 import format as fmt


@dataclass
class Problem:
    cache: torch.Tensor  # [pages, 2*Hkv, 128, 72] uint8
    block_table: torch.Tensor  # [R, S] int32, -1 past each request's last block
    seq_lens: list[int]
    q: torch.Tensor  # [T, H, 128]
    req: torch.Tensor  # [T] int32
    pos: torch.Tensor  # [T] int32
    k_scale: float
    v_scale: float
    sm_scale: float

    @property
    def hkv(self) -> int:
        return self.cache.shape[1] // 2


def shuffled_block_table(gen: torch.Generator, seq_lens: list[int], spare_pages: int) -> tuple[torch.Tensor, int]:
    """Requests of ``seq_lens`` tokens on pages drawn at random from ``sum(blocks) + spare_pages``: int32
    ``[R, max blocks + 2]``, -1 past each request's last block; returns ``(table, num_pages)``."""
    blocks = [-(-n // fmt.PAGE_SIZE) for n in seq_lens]
    num_pages = sum(blocks) + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), max(blocks) + 2), -1, dtype=torch.int32)
    used = 0
    for r, b in enumerate(blocks):
        table[r, :b] = perm[used : used + b].int()
        used += b
    return table, num_pages


def make_problem(
    seed: int,
    seq_lens: list[int],
    extend_lens: list[int],
    num_heads: int = 16,
    num_kv_heads: int = 1,
    spare_pages: int = 3,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dtype=torch.bfloat16,
    device="cpu",
) -> Problem:
    """Requests of ``seq_lens`` tokens on shuffled pages; queries are each request's last
    ``extend_lens[r]`` tokens (so chunk starts are generally not page aligned)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // fmt.PAGE_SIZE) for n in seq_lens]
    num_pages = sum(blocks) + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    cache = fmt.alloc_cache(num_pages, num_kv_heads)
    cache.random_(0, 256, generator=gen)  # garbage in unused rows and pages
    used = 0
    for r, n in enumerate(seq_lens):
        bt[r, : blocks[r]] = perm[used : used + blocks[r]].int()
        used += blocks[r]
        slots = bt[r].long()[torch.arange(n) // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + torch.arange(n) % fmt.PAGE_SIZE
        # Heavy-ish tails: per-channel scales so blocks differ in magnitude.
        chan = torch.exp(torch.randn(num_kv_heads, fmt.HEAD_DIM, generator=gen) * 0.5)
        k = torch.randn(n, num_kv_heads, fmt.HEAD_DIM, generator=gen) * chan * k_scale
        v = torch.randn(n, num_kv_heads, fmt.HEAD_DIM, generator=gen) * v_scale
        fmt.write_kv(cache, slots, k, v, k_scale, v_scale)
    req = torch.cat([torch.full((e,), r, dtype=torch.int32) for r, e in enumerate(extend_lens)])
    pos = torch.cat([torch.arange(n - e, n, dtype=torch.int32) for n, e in zip(seq_lens, extend_lens)])
    q = (torch.randn(len(req), num_heads, fmt.HEAD_DIM, generator=gen) * 0.3).to(dtype)
    return Problem(
        cache.to(device), bt.to(device), list(seq_lens), q.to(device), req.to(device), pos.to(device),
        k_scale, v_scale, fmt.HEAD_DIM**-0.5,
    )


def all_block_ids(p: Problem, width: int = fmt.TOPK) -> torch.Tensor:
    """Every block up to each token's own, padded with -1: dense causal attention."""
    own = (p.pos.cpu() // fmt.PAGE_SIZE).long()
    if int(own.max()) + 1 > width:
        raise ValueError("too many blocks for a dense selection of this width")
    ids = torch.arange(width)[None, :].expand(len(own), width)
    sel = torch.where(ids <= own[:, None], ids, torch.full_like(ids, -1)).int()
    return sel[None].expand(p.hkv, -1, -1).contiguous().to(p.q.device)


def random_block_ids(p: Problem, seed: int, width: int = fmt.TOPK, dup_prob: float = 0.1) -> torch.Tensor:
    """Per KV head and token: the own block plus random earlier (and occasionally later, or
    duplicated) blocks, padded with -1 in random slots."""
    gen = torch.Generator().manual_seed(seed)
    own = (p.pos.cpu() // fmt.PAGE_SIZE).long()
    req = p.req.cpu().long()
    nblk = torch.tensor([-(-n // fmt.PAGE_SIZE) for n in p.seq_lens])[req]
    out = torch.full((p.hkv, len(own), width), -1, dtype=torch.int32)
    for h in range(p.hkv):
        for t in range(len(own)):
            cand = torch.randperm(int(nblk[t]), generator=gen)[: width - 1]
            n_keep = int(torch.randint(0, len(cand) + 1, (1,), generator=gen))
            row = torch.cat([own[t : t + 1], cand[:n_keep]])
            if len(row) < width and torch.rand(1, generator=gen).item() < dup_prob:
                row = torch.cat([row, row[:1]])
            slots = torch.randperm(width, generator=gen)[: len(row)]
            out[h, t, slots] = row.int()
    return out.to(p.q.device)


def dense_attention_f64(p: Problem, head_map=None) -> torch.Tensor:
    """Independent float64 causal attention over each request's dequantized K/V."""
    hkv, h = p.hkv, p.q.shape[1]
    out = torch.zeros(p.q.shape, dtype=torch.float64)
    cache, bt = p.cache.cpu(), p.block_table.cpu()
    for t in range(p.q.shape[0]):
        r, n = int(p.req[t]), int(p.pos[t]) + 1
        pages = bt[r, : -(-n // fmt.PAGE_SIZE)].long()
        k, v = fmt.read_kv(cache, pages, p.k_scale, p.v_scale)  # [P, Hkv, 128, 128]
        k = k.transpose(0, 1).reshape(hkv, -1, fmt.HEAD_DIM)[:, :n].double()
        v = v.transpose(0, 1).reshape(hkv, -1, fmt.HEAD_DIM)[:, :n].double()
        for i in range(h):
            kvh = i // (h // hkv) if head_map is None else head_map(i)
            s = (k[kvh] @ p.q[t, i].cpu().double()) * p.sm_scale
            out[t, i] = torch.softmax(s, dim=0) @ v[kvh]
    return out


def call_args(p: Problem, block_ids: torch.Tensor, tokens=None) -> tuple:
    """The contract's positional arguments for problem ``p``, or for only ``tokens`` (an index tensor) of it:
    the same cache and block table, those tokens' queries, selections and metadata."""
    if tokens is None:
        return (p.q, p.cache, block_ids, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, p.sm_scale)
    return (p.q[tokens].contiguous(), p.cache, block_ids[:, tokens].contiguous(), p.block_table,
            p.req[tokens].contiguous(), p.pos[tokens].contiguous(), p.k_scale, p.v_scale, p.sm_scale)


def assert_batch_invariant(attend, p: Problem, block_ids: torch.Tensor, groups) -> None:
    """``attend(*args) -> out``: each group of tokens (index tensors) attended alone gives, bit for bit, the
    rows it gets when attended with every other token of ``p`` (batch invariance)."""
    whole = attend(*call_args(p, block_ids))
    for tokens in groups:
        alone = attend(*call_args(p, block_ids, tokens))
        diff = (alone.double() - whole[tokens].double()).abs().max().item()
        assert torch.equal(alone, whole[tokens]), f"tokens {tokens.tolist()[:8]}...: alone differs by {diff:.3g}"
