"""The sparse-attention kernel contract, implemented exactly and slowly in torch (runs on CPU).

``sparse_prefill_reference`` is the oracle every kernel (Triton, FlyDSL) is tested against, and the
CPU implementation behind the dispatcher.

Contract
--------
Inputs: ``q [T, H, 128]`` (bf16/fp16/fp32), one layer's ``cache`` (see :mod:`sglang_nvfp4.format`),
``block_ids [Hkv, T, K] int32`` logical block ids (``-1`` = none; any ``K >= 1``, the kernels are
tuned for ``K = TOPK = 16``),
``block_table [R, S] int32`` (logical block -> page, per request row), ``req [T] int32`` (request row
of each token), ``pos [T] int32`` (position of each token in its request), fp32 global
``k_scale``/``v_scale`` (float or one-element tensor), ``sm_scale``.

Semantics: query head ``i`` uses KV head ``i // (H // Hkv)``. For token ``t`` and KV head ``h`` the
distinct non-negative ids in ``block_ids[h, t]`` are logical blocks of request ``req[t]``; block ``b``
maps to page ``block_table[req[t], b]``; key ``j`` of that page has position ``128*b + j``; keys at
positions ``> pos[t]`` get no weight; duplicate ids count once; a token with no valid key outputs 0.
A selected block beyond the token's own block therefore contributes nothing. Keys that no token
can see never affect any output, whatever their bytes (the unwritten tail of a request's last page,
stale pages, NaN-coded scales): kernels zero V for keys that no row of a tile can see.

Preconditions (not checked, relied on by the fused kernels): a request's block table maps distinct
blocks to distinct pages, and the ``block_table`` entry of every selected block is a valid page.

Numerics (``mode="kernel"``, as the fused kernels compute): Q is rounded to fp16; K and V are
dequantized to fp16 *without* their global scales (``e2m1 * e4m3`` is exact in fp16); scores
``S = Q.K^T`` accumulate in fp32; base-2 logits ``S * c`` with ``c = sm_scale * log2(e) * k_scale``;
``p = exp2(S*c - max)``, ``l = sum(p)`` in fp32; ``p`` is rounded to fp16 before ``P.V`` (fp32
accumulation); ``out = (P.V) * (v_scale / l)``, cast to q's dtype. Kernels using an online softmax
round ``p`` against a running max, so they match this within fp16 rounding, not bitwise.
``mode="ideal"`` computes the same function in float64 with no intermediate rounding (K/V fully
dequantized), for accuracy measurement.

Batch invariance: a token's output depends on its own query, selection and keys only, never on which
other tokens share the call. The reference works page by page (products over one page's 128 keys), and
sums over pages in ascending page order, in which a token's own pages keep their order whatever the other
tokens select; pages it did not select add exact zeros. Kernels keep the same property (their tests
check a request alone against the same request batched with others).
"""

from __future__ import annotations

import math

import torch

from . import format as fmt

Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = math.log2(math.e)  # kernels run the softmax in exp2: logits are pre-scaled by sm_scale * LOG2E
_TOKENS_PER_CHUNK = 64  # tokens computed together on CPU (their pages visited one at a time)


def check_queries(q: torch.Tensor, num_kv_heads: int, name: str = "q") -> tuple[int, int]:
    """``q``: bf16/fp16/fp32 ``[T, H, 128]`` with ``H`` a multiple of ``num_kv_heads``; returns ``(T, H)``."""
    if q.dim() != 3 or q.shape[2] != fmt.HEAD_DIM or q.dtype not in Q_DTYPES:
        raise ValueError(f"{name}: expected bf16/fp16/fp32 [T, H, {fmt.HEAD_DIM}], got {q.dtype} {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"{name}: {q.shape[1]} query heads is not a multiple of the cache's {num_kv_heads} KV heads")
    return q.shape[0], q.shape[1]


def check_token_metadata(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, num_tokens: int,
                         device: torch.device) -> None:
    """The metadata every layer of a forward shares: ``block_table`` int32 ``[R, S]``, ``req`` and ``pos``
    int32 ``[num_tokens]``, all on ``device``. Shapes, dtypes and devices only (no device sync)."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table: expected int32 [R, S], got {block_table.dtype} {tuple(block_table.shape)}")
    for name, x in (("req", req), ("pos", pos)):
        if x.dtype != torch.int32 or x.shape != (num_tokens,):
            raise ValueError(f"{name}: expected int32 [{num_tokens}], got {x.dtype} {tuple(x.shape)}")
    for name, x in (("block_table", block_table), ("req", req), ("pos", pos)):
        if x.device != device:
            raise ValueError(f"{name}: on {x.device}, expected {device}")


def check_block_ids(block_ids: torch.Tensor, num_kv_heads: int, num_tokens: int, device: torch.device) -> int:
    """``block_ids``: int32 ``[Hkv, T, K]`` with ``K >= 1`` on ``device``; returns ``K``."""
    if (block_ids.dtype != torch.int32 or block_ids.dim() != 3 or block_ids.shape[:2] != (num_kv_heads, num_tokens)
            or block_ids.shape[2] < 1):
        raise ValueError(f"block_ids: expected int32 [{num_kv_heads}, {num_tokens}, K], got {block_ids.dtype} "
                         f"{tuple(block_ids.shape)}")
    if block_ids.device != device:
        raise ValueError(f"block_ids: on {block_ids.device}, expected {device}")
    return block_ids.shape[2]


def validate_sparse_args(q, cache, block_ids, block_table, req, pos) -> tuple[int, int, int]:
    """Check shapes, dtypes and devices of the contract's tensors; returns ``(T, H, Hkv)``.

    Raises ``ValueError`` naming the offending argument. Data-dependent checks (id ranges) are in
    :func:`validate_sparse_values`, which needs a device sync."""
    hkv = fmt.check_cache(cache)
    t, h = check_queries(q, hkv)
    if q.device != cache.device:
        raise ValueError(f"q: on {q.device}, cache on {cache.device}")
    check_block_ids(block_ids, hkv, t, cache.device)
    check_token_metadata(block_table, req, pos, t, cache.device)
    return t, h, hkv


def validate_sparse_values(block_ids, block_table, req, pos) -> None:
    """Range checks on the index tensors (syncs with the device)."""
    if req.numel():
        if int(req.min()) < 0 or int(req.max()) >= block_table.shape[0]:
            raise ValueError(f"req: rows must be in [0, {block_table.shape[0]}), got {req.min()}..{req.max()}")
        if int(pos.min()) < 0:
            raise ValueError(f"pos: positions must be >= 0, got min {int(pos.min())}")
    if block_ids.numel() and int(block_ids.max()) >= block_table.shape[1]:
        raise ValueError(f"block_ids: block id {int(block_ids.max())} is beyond the block table's "
                         f"{block_table.shape[1]} columns")
    if block_ids.numel() and int(block_ids.min()) < -1:
        raise ValueError(f"block_ids: ids must be >= -1, got {int(block_ids.min())}")


def sparse_prefill_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    k_scale,
    v_scale,
    sm_scale: float,
    *,
    mode: str = "kernel",
) -> torch.Tensor:
    """Sparse attention over the NVFP4 cache; ``out [T, H, 128]`` in q's dtype (float64 in ideal mode)."""
    if mode not in ("kernel", "ideal"):
        raise ValueError(f"mode: expected 'kernel' or 'ideal', got {mode!r}")
    t_all, h, hkv = validate_sparse_args(q, cache, block_ids, block_table, req, pos)
    validate_sparse_values(block_ids, block_table, req, pos)
    ideal = mode == "ideal"
    out = torch.zeros(t_all, h, fmt.HEAD_DIM, dtype=torch.float64 if ideal else q.dtype, device=q.device)
    if t_all == 0:
        return out
    group = h // hkv
    blocks = block_ids.long()  # [Hkv, T, K]
    valid = blocks >= 0
    pages = block_table.long()[req.long()[None, :, None], blocks.clamp(min=0)]  # [Hkv, T, K]
    bad = valid & ((pages < 0) | (pages >= cache.shape[0]))
    if bool(bad.any()):
        raise ValueError(f"block_table: selected blocks map to pages outside [0, {cache.shape[0]})")

    # Dequantize each referenced page once; without global scales in kernel mode (exact in fp16).
    used, inverse = torch.unique(pages[valid], return_inverse=True)
    slot = torch.full_like(pages, -1)
    slot[valid] = inverse
    if ideal:
        k_all, v_all = fmt.read_kv(cache, used, k_scale, v_scale)
        k_all, v_all = k_all.double(), v_all.double()
        qf, c, v_gs = q.double(), sm_scale, 1.0
    else:
        k_all, v_all = fmt.read_kv(cache, used, 1.0, 1.0)
        k_all, v_all = k_all.half().float(), v_all.half().float()
        qf = q.half().float()
        c = sm_scale * LOG2E * float(fmt.global_scale(k_scale, name="k_scale"))
        v_gs = float(fmt.global_scale(v_scale, name="v_scale"))

    offsets = torch.arange(fmt.PAGE_SIZE, device=q.device)
    for kvh in range(hkv):
        heads = slice(kvh * group, (kvh + 1) * group)
        for start in range(0, t_all, _TOKENS_PER_CHUNK):
            tok = slice(start, min(start + _TOKENS_PER_CHUNK, t_all))
            out[tok, heads] = _attend_chunk(qf[tok, heads], slot[kvh, tok], blocks[kvh, tok], pos[tok].long(),
                                            k_all[:, kvh], v_all[:, kvh], c, v_gs, ideal, offsets).to(out.dtype)
    return out


def _attend_chunk(q, slot, blocks, pos, k_all, v_all, c, v_gs, ideal, offsets):
    """``C`` tokens of any requests: ``q [C, G, 128]``, their selections as dequantized-page ``slot`` and
    logical ``blocks [C, K]`` (-1: none), ``pos [C]``, one KV head's ``k_all``/``v_all [pages, 128, 128]``.

    The chunk's union of pages is visited in slot order (ascending page), one page at a time: ``Q.K^T`` and
    ``P.V`` are products over the 128 dims / 128 keys of that page only, and the sums over pages (``l``,
    ``P.V``) run in union order, in which a token's own pages keep their relative order whatever the other
    tokens select; a page the token did not select adds exact zeros. So every token's bits are its own."""
    ok = slot >= 0
    if not bool(ok.any()):
        return torch.zeros_like(q)
    union, member = torch.unique(slot[ok], return_inverse=True)
    # member_block[t, u]: the logical block under which token t selected union page u (-1: not selected).
    member_block = torch.full((slot.shape[0], union.numel()), -1, dtype=torch.long, device=q.device)
    member_block[ok.nonzero()[:, 0], member] = blocks[ok]
    key_pos = member_block[:, :, None] * fmt.PAGE_SIZE + offsets  # [C, U, 128]
    visible = (member_block[:, :, None] >= 0) & (key_pos <= pos[:, None, None])  # [C, U, 128]
    logits = [torch.matmul(q, k_all[u].T) * c for u in union.tolist()]  # U x [C, G, 128]
    logits = [s.masked_fill(~visible[:, i, None, :], float("-inf")) for i, s in enumerate(logits)]
    m = torch.stack([s.amax(dim=-1) for s in logits]).amax(dim=0)[..., None]  # [C, G, 1]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for i, (u, s) in enumerate(zip(union.tolist(), logits)):
        p = torch.exp(s - m) if ideal else torch.exp2(s - m)
        l_sum = l_sum + p.sum(dim=-1, keepdim=True)
        if not ideal:
            p = p.half().float()
        # Keys no token of the chunk sees may hold any bytes (NaN codes too): keep them out of P.V entirely.
        v = torch.where(visible[:, i].any(dim=0)[:, None], v_all[u], 0.0)  # [128 keys, 128 dims]
        acc = acc + torch.matmul(p, v)
    scale = torch.where(l_sum > 0, v_gs / l_sum, torch.zeros_like(l_sum))
    return acc * scale
