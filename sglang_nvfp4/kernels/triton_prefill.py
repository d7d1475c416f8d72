"""Triton sparse prefill over the NVFP4 cache (contract: :mod:`sglang_nvfp4.reference`); entry
point :func:`launch`, called by the dispatcher :mod:`sglang_nvfp4.kernels`.

The selection is ``block_ids [Hkv, T, K]`` int32 (logical block ids per KV head and token). Work is
split into tiles of ``BLOCK_T`` consecutive tokens x the query heads of one KV head, so a tile is
``M = BLOCK_T * GROUP`` rows (64-128 rows let ``tl.dot`` use Hopper's wgmma). Two launches:

1. ``_plan_tiles_kernel`` (one program per tile and KV head): gathers the tile's selected blocks,
   drops ``-1`` ids and blocks that start after the selecting token's position, sorts the entries by
   ``(block, page)`` (one ``tl.sort`` of int64 keys), merges equal pairs with a segmented scan and
   writes the tile's union in that order as three int32 lists plus its length: the page, the logical
   block (key positions are ``128 * block + j``) and a bitmask of the tile's tokens that selected it
   (int32: at most ``MAX_TILE_TOKENS`` tokens per tile).
2. ``_sparse_prefill_kernel`` (one program per tile and KV head, deepest tiles first): for each
   union entry it decodes the page's K and V^T tiles once (:mod:`.triton_common`), computes
   ``S = Q.K^T`` for all rows, masks rows whose token did not select the page and keys past each
   token's position, and takes an online-softmax step in exp2 (``online_softmax_step``) with ``P``
   rounded to fp16 before ``P.V``. Rows that see no key write 0 (``normalize_and_store``).

Batch invariance: a page that a row did not select is an exact no-op for that row (``alpha = 1``,
``p = 0``), and the union's ``(block, page)`` order visits every row's own pages in ascending block
order whoever shares its tile. So a token's output does not depend on the other tokens of the call.

The Gluon prefill (:mod:`.gluon_prefill`) plans its tiles with ``plan_tiles`` too, over consecutive tokens or over
a token order from :func:`group_tokens` (``_group_tokens_kernel``: per 64-token window and KV head, tiles of tokens
whose selections overlap); this module's own kernel keeps consecutive tiles.

Every union entry costs a page decode and a full ``M x 128 x 128`` pair of products, so the tile size
trades the decode shared by the tile's tokens against products spent on rows that did not select a
page; ``PREFILL_CONFIGS`` lists the shapes bench/bench_kernels.py sweeps (results and the choice of
the default: bench/results/kernels_h200.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_common import (
    BLOCK_WORDS,
    HEAD_DIM,
    LOG2E,
    PAGE,
    TILE_SCALE,
    global_scale,
    load_k_tile,
    load_vt_tile,
    normalize_and_store,
    online_softmax_step,
    uses_ptx,
)


class PrefillConfig(NamedTuple):
    tokens_per_tile: int  # BLOCK_T
    num_warps: int
    num_stages: int


# Swept by bench/bench_kernels.py at T=32K (H200, Triton 3.6, 2026-11-29). A first sweep also had
# 1 and 2 tokens per tile and 4 tokens with 8 warps: slower for every selection pattern.
PREFILL_CONFIGS = (PrefillConfig(4, 4, 2), PrefillConfig(8, 8, 2))
TILE_ROWS = 64  # default tile: 64 rows (4 tokens x 16 heads), 4 warps: best or within 3% for every pattern
# (a layer of one query head per KV head gets MAX_TILE_TOKENS tokens, 32 rows)
MAX_TILE_TOKENS = 32  # a tile's member bitmasks are int32


def default_prefill_config(group: int) -> PrefillConfig:
    """The tile shape used when none is given, for ``group`` query heads per KV head."""
    rows_per_token = triton.next_power_of_2(group)
    return PrefillConfig(min(MAX_TILE_TOKENS, max(1, TILE_ROWS // rows_per_token)), 4, 2)


@triton.jit
def _token_entries(block_ids_ptr, block_table_ptr, req_ptr, pos_ptr, kv_head, token, slot,
                   T, K, stride_ih, stride_it, stride_ik, stride_br, stride_bs):
    """Slot ``slot`` of token ``token``'s selection (tensors of one shape; tokens at or past ``T`` select nothing):
    ``(block, page, selected)``, where a block counts as selected when it is an id >= 0 that starts at or before
    its token's position (later blocks contribute nothing)."""
    live = (token < T) & (slot < K)
    block = tl.load(block_ids_ptr + kv_head * stride_ih + token.to(tl.int64) * stride_it + slot * stride_ik,
                    mask=live, other=-1)
    req = tl.load(req_ptr + token, mask=live, other=0)
    pos = tl.load(pos_ptr + token, mask=live, other=-1)
    selected = (block >= 0) & (block * PAGE <= pos)
    page = tl.load(block_table_ptr + req.to(tl.int64) * stride_br + block * stride_bs, mask=selected, other=-1)
    return block, page, selected


@triton.jit
def _same_class_members(a_key, a_members, b_key, b_members):
    """Scan combine over entries sorted by class: the member bits of the trailing run of one class so far.
    Associative only when each class's entries are contiguous (sorted keys), as the GPU scan combines in a tree."""
    return b_key, b_members | tl.where(a_key == b_key, a_members, 0)


@triton.jit
def _tile_tokens(order_ptr, kv_head, tile, tile_token, num_tiles, BLOCK_T: tl.constexpr, ORDERED: tl.constexpr):
    """The tokens at places ``tile_token`` of ``tile`` (KV head ``kv_head``): ``tile * BLOCK_T + tile_token``, or
    with ``ORDERED`` those places of the token order (:func:`group_tokens`, ``[Hkv, num_tiles * BLOCK_T]``; the
    Gluon prefill's twin: ``gluon_prefill._tile_tokens``)."""
    place = tile * BLOCK_T + tile_token
    if ORDERED:
        return tl.load(order_ptr + kv_head.to(tl.int64) * num_tiles * BLOCK_T + place)
    return place


@triton.jit
def _plan_tiles_kernel(
    block_ids_ptr, block_table_ptr, req_ptr, pos_ptr,  # int32 [Hkv, T, K], [R, S], [T], [T]
    order_ptr,  # int32 [Hkv, tiles * BLOCK_T] with ORDERED (the tiles' tokens, group_tokens), else None
    plan_len_ptr, plan_page_ptr, plan_block_ptr, plan_members_ptr,  # int32 [Hkv, tiles], [Hkv, tiles, WIDTH] x 3
    T, K, stride_ih, stride_it, stride_ik, stride_br, stride_bs,  # block_ids strides, block_table strides
    BLOCK_T: tl.constexpr, K_POW2: tl.constexpr, ENTRY_BITS: tl.constexpr, ORDERED: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_tiles = tl.num_programs(0)
    WIDTH: tl.constexpr = BLOCK_T * K_POW2
    entry = tl.arange(0, WIDTH)
    token = _tile_tokens(order_ptr, kv_head, tile, entry // K_POW2, num_tiles, BLOCK_T, ORDERED)
    block, page, selected = _token_entries(block_ids_ptr, block_table_ptr, req_ptr, pos_ptr, kv_head, token,
                                           entry % K_POW2, T, K, stride_ih, stride_it, stride_ik, stride_br, stride_bs)
    # One sort puts the tile's entries in (block, page) order, each class's entries together: the key is
    # block | page (31 bits) | entry (ENTRY_BITS), unselected entries last (plan_tiles keeps block ids below the
    # sentinel). A token's own pages then come in ascending block order whatever its tile-mates selected (batch
    # invariance, see the module docstring).
    unselected: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    key = (block.to(tl.int64) << (31 + ENTRY_BITS)) | (page.to(tl.int64) << ENTRY_BITS) | entry
    key = tl.sort(tl.where(selected, key, unselected))
    klass = key >> ENTRY_BITS
    member_bit = (1 << ((key & (WIDTH - 1)) // K_POW2)).to(tl.int32)
    # A class's last entry (in sorted order) holds the bits of the whole class and owns its union slot,
    # numbered by the classes before it.
    _, members = tl.associative_scan((klass, member_bit), 0, _same_class_members)
    next_klass = tl.gather(klass, tl.minimum(entry + 1, WIDTH - 1), 0)
    last = (key != unselected) & ((klass != next_klass) | (entry == WIDTH - 1))
    base = (kv_head * num_tiles + tile).to(tl.int64) * WIDTH + tl.cumsum(last.to(tl.int32), axis=0) - 1
    tl.store(plan_page_ptr + base, (klass & 0x7FFFFFFF).to(tl.int32), mask=last)
    tl.store(plan_block_ptr + base, (klass >> 31).to(tl.int32), mask=last)
    tl.store(plan_members_ptr + base, members, mask=last)
    tl.store(plan_len_ptr + kv_head * num_tiles + tile, tl.sum(last.to(tl.int32), axis=0))


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _group_tokens_kernel(
    block_ids_ptr, req_ptr, pos_ptr,  # int32 [Hkv, T, K], [T], [T]
    order_ptr,  # int32 [Hkv, places]: the tokens of each tile, tile after tile (T: no token)
    T, K, places, stride_ih, stride_it, stride_ik,
    BLOCK_T: tl.constexpr, K_POW2: tl.constexpr, WINDOW: tl.constexpr, WORDS: tl.constexpr,
):
    """One window of ``WINDOW`` tokens and one KV head of :func:`group_tokens`: its ``WINDOW`` places of ``order``
    (tiles of ``BLOCK_T``), ``WORDS`` int64 words of bitset covering the block ids."""
    window = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = window * WINDOW
    tok = tl.arange(0, WINDOW)
    slot = tl.arange(0, K_POW2)
    live = first + tok < T
    req = tl.load(req_ptr + first + tok, mask=live, other=-1)
    pos = tl.load(pos_ptr + first + tok, mask=live, other=-1)
    block = tl.load(block_ids_ptr + kv_head * stride_ih + (first + tok).to(tl.int64)[:, None] * stride_it
                    + slot[None, :] * stride_ik, mask=live[:, None] & (slot[None, :] < K), other=-1)
    selected = (block >= 0) & (block * PAGE <= pos[:, None])  # as plan_tiles counts them
    block = tl.where(selected, block, 0)
    word = block // 64  # each selected id's bit in a bitset of its request's blocks: [WINDOW, K_POW2]
    bit = tl.where(selected, tl.full([WINDOW, K_POW2], 1, tl.int64) << (block % 64).to(tl.int64), 0)
    words = tl.arange(0, WORDS)

    # Greedy, one place at a time: a tile starts with the earliest token left; each next place takes the token with
    # the fewest selected ids outside the tile's union so far (the earliest on ties). The union is a bitset of the
    # blocks of the tile's tokens of the first token's request; a token of another request adds all its ids.
    NONE: tl.constexpr = (K_POW2 + 2) * WINDOW
    taken = ~live  # past the prompt: never placed
    union = tl.zeros([WORDS], tl.int64)
    tile_req = -1
    out = order_ptr + kv_head.to(tl.int64) * places + first
    for place in range(WINDOW):
        starts_tile = place % BLOCK_T == 0
        union = tl.where(starts_tile, 0, union)
        held = tl.reshape(tl.gather(union, tl.reshape(word, [WINDOW * K_POW2]), 0), [WINDOW, K_POW2]) & bit
        added = tl.sum((selected & ((held == 0) | (req != tile_req)[:, None])).to(tl.int32), axis=1)
        score = tl.where(taken, NONE, tl.where(starts_tile, 0, added) * WINDOW + tok)
        best = tl.min(score, axis=0)
        pick = best % WINDOW
        picked = tok == pick
        taken = taken | picked
        pick_req = tl.max(tl.where(picked, req, -1), axis=0)
        tile_req = tl.where(starts_tile, pick_req, tile_req)
        # The pick's blocks join the union when it is of the tile's request.
        pick_word = tl.max(tl.where(picked[:, None], word, -1), axis=0)
        # (OR, not max: a block's bit 63 is the int64 sign bit)
        pick_bit = tl.reduce(tl.where(picked[:, None] & (pick_req == tile_req), bit, 0), 0, _bitwise_or)
        union |= tl.reduce(tl.where(pick_word[:, None] == words[None, :], pick_bit[:, None], 0), 0, _bitwise_or)
        tl.store(out + place, tl.where(best < NONE, first + pick, T), mask=first + place < places)


@triton.jit
def _sparse_prefill_kernel(
    q_ptr, out_ptr, cache_ptr, pos_ptr,  # [T, H, 128], [T, H, 128], uint8 cache, int32 [T]
    plan_len_ptr, plan_page_ptr, plan_block_ptr, plan_members_ptr,
    k_scale, v_scale, sm_scale,
    T, stride_qt, stride_qh, stride_ot, stride_oh,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, BLOCK_T: tl.constexpr, WIDTH: tl.constexpr,
    K_SCALE_BY_POINTER: tl.constexpr, V_SCALE_BY_POINTER: tl.constexpr, USE_PTX: tl.constexpr,
):
    num_tiles = tl.num_programs(0)
    tile = num_tiles - 1 - tl.program_id(0)  # deepest tokens (largest unions) first
    kv_head = tl.program_id(1)
    M: tl.constexpr = BLOCK_T * GROUP_POW2

    rows = tl.arange(0, M)
    row_token = rows // GROUP_POW2  # token of the tile each row belongs to
    token = tile * BLOCK_T + row_token
    head = kv_head * GROUP + rows % GROUP_POW2
    live = (token < T) & (rows % GROUP_POW2 < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=live[:, None], other=0.0).to(tl.float16)
    pos = tl.load(pos_ptr + token, mask=live, other=-1)
    logit_scale = sm_scale * LOG2E * TILE_SCALE * global_scale(k_scale, K_SCALE_BY_POINTER)
    out_scale = TILE_SCALE * global_scale(v_scale, V_SCALE_BY_POINTER)

    keys = tl.arange(0, PAGE)
    m_i = tl.full((M,), float("-inf"), tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, HEAD_DIM), tl.float32)
    plan = (kv_head * num_tiles + tile).to(tl.int64) * WIDTH
    union_len = tl.load(plan_len_ptr + kv_head * num_tiles + tile)
    for u in range(union_len):
        page = tl.load(plan_page_ptr + plan + u).to(tl.int64)
        block = tl.load(plan_block_ptr + plan + u)
        members = tl.load(plan_members_ptr + plan + u)
        page_base = page * (2 * HKV * BLOCK_WORDS)  # in 4-byte words
        k = load_k_tile(cache_ptr, page_base + kv_head * BLOCK_WORDS, USE_PTX)
        s = tl.dot(q, tl.trans(k))
        row_selected = ((members >> row_token) & 1) != 0
        key_pos = block * PAGE + keys
        visible = row_selected[:, None] & (key_pos[None, :] <= pos[:, None])
        p, alpha, m_i, l_i = online_softmax_step(s, visible, logit_scale, m_i, l_i,
                                                 KEY_AXIS=1, ROWS_MAY_SEE_NOTHING=True)
        key_live = key_pos <= tl.max(tl.where(row_selected, pos, -1), axis=0)  # seen by some row
        vt = load_vt_tile(cache_ptr, page_base + (HKV + kv_head) * BLOCK_WORDS, key_live, USE_PTX)
        acc = tl.dot(p.to(tl.float16), tl.trans(vt), acc * alpha[:, None])

    normalize_and_store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh, acc, l_i, out_scale, live,
                            tl.arange(0, HEAD_DIM))


def plan_tiles(block_ids, block_table, req, pos, tokens_per_tile: int, order=None):
    """The planning pass alone, for int32 ``block_ids [Hkv, T, K]``: ``(union_len int32 [Hkv, tiles],
    plan int32 [3, Hkv, tiles, width])``, the union entries' pages, blocks and member bitmasks
    (``width = tokens_per_tile * K_POW2``). Tile ``i`` holds tokens ``i * tokens_per_tile ..`` in order, or with
    ``order`` (:func:`group_tokens`) the tokens ``order[h, i * tokens_per_tile ..]``, and member bit ``j`` is the
    tile's ``j``-th token. ``ValueError`` for more than ``MAX_TILE_TOKENS`` tokens per tile or a block table too wide
    for the sort key (``2**(32 - log2(width))`` block slots and up)."""
    hkv, t, width_k = block_ids.shape
    if not 1 <= tokens_per_tile <= MAX_TILE_TOKENS:
        raise ValueError(f"tokens_per_tile={tokens_per_tile}: a tile's member bitmask (int32) holds 1 to "
                         f"{MAX_TILE_TOKENS} tokens")
    k_pow2 = triton.next_power_of_2(width_k)
    entry_bits = (tokens_per_tile * k_pow2 - 1).bit_length()
    if block_table.shape[1] >= 1 << (32 - entry_bits):  # block ids < 2**(32 - entry_bits) - 1: keys below the sentinel
        raise ValueError(f"block_table has {block_table.shape[1]} block slots: the planner's sort key holds block ids "
                         f"up to {(1 << (32 - entry_bits)) - 2} at {tokens_per_tile} tokens x {k_pow2} ids per tile")
    num_tiles = triton.cdiv(t, tokens_per_tile)
    if order is not None and (order.shape != (hkv, num_tiles * tokens_per_tile) or order.dtype != torch.int32
                              or not order.is_contiguous()):
        raise ValueError(f"order: expected contiguous int32 {(hkv, num_tiles * tokens_per_tile)}, got {order.dtype} "
                         f"{tuple(order.shape)}")
    req, pos = req.contiguous(), pos.contiguous()
    union_len = torch.empty((hkv, num_tiles), dtype=torch.int32, device=block_ids.device)
    plan = torch.empty((3, hkv, num_tiles, tokens_per_tile * k_pow2), dtype=torch.int32, device=block_ids.device)
    _plan_tiles_kernel[(num_tiles, hkv)](
        block_ids, block_table, req, pos, order, union_len, plan[0], plan[1], plan[2],
        t, width_k, *block_ids.stride(), *block_table.stride(),
        BLOCK_T=tokens_per_tile, K_POW2=k_pow2, ENTRY_BITS=entry_bits, ORDERED=order is not None,
        num_warps=8 if tokens_per_tile * k_pow2 >= 256 else 4,
    )
    return union_len, plan


GROUP_WINDOW = 64  # consecutive tokens group_tokens regroups together


def group_warps(width: int) -> int:
    """Warps of a :func:`group_tokens` program for ``width`` ids per token. Its 64 greedy steps run one after the
    other, each with reductions over the window: up to 16 ids per token one warp reduces within itself (no spills up
    to 128 bitset words, Triton 3.6, sm_90). On one H100 that took the regrouping from 0.47 to 0.24 ms per 32K layer
    at 64/4 and from 0.125 to 0.082 ms at 16/1 (``bench/results/consumer_overlap_h100.md``, before the bit-63 fix of
    the union's bitset); with the fix it took 0.200 / 0.067 ms on an H200 (``bench/results/consumer_operands_h200.md``).
    Wider selections keep 8 warps, so that the window's ids fit their registers (one warp spills at 32 ids: 144-176
    bytes of stack, Triton 3.8 and 3.6)."""
    return 1 if width <= 16 else 8


def group_tokens(block_ids, block_table, req, pos, tokens_per_tile: int) -> torch.Tensor:
    """Regroups the tokens of each window of ``GROUP_WINDOW`` consecutive tokens into tiles of ``tokens_per_tile``
    whose selections overlap, per KV head, so that :func:`plan_tiles` visits fewer union pages per tile. Returns
    ``order`` int32 ``[Hkv, tiles * tokens_per_tile]`` (``tiles = ceil(T / tokens_per_tile)``): tile ``i`` takes
    tokens ``order[h, i * tokens_per_tile ..]``, each token exactly once, ``T`` where a last tile has no token; tile
    ``i``'s tokens come from the window of token ``i * tokens_per_tile``.

    The rule (deterministic): a tile starts with the earliest token of its window left, and each next place takes
    the token with the fewest selected ids (>= 0, starting at or before its position, as :func:`plan_tiles` counts
    them) whose block the tile's tokens so far lack, the earliest on ties. Blocks are compared within the request of
    the tile's first token: a token of another request counts all its ids (only windows across a request boundary
    have one; a prefix page two requests share is not seen as shared). On ``bench_prefill_variants.py``'s problems
    (T = 32K, 64/4, top-16, one H100) the mean union of 8-token tiles went from 71.6 to 61.7 pages (per-token random)
    and from 29.7 to 26.1 (quest indexer): ``bench/results/consumer_overlap_h100.md``. A token's output does not
    depend on its tile-mates (module docstring), so the order changes no output bit. ``block_table`` gives the block
    ids' range (its width); ``ValueError`` for a tile size that does not divide the window."""
    hkv, t, width_k = block_ids.shape
    if not 1 <= tokens_per_tile <= GROUP_WINDOW or GROUP_WINDOW % tokens_per_tile:
        raise ValueError(f"tokens_per_tile={tokens_per_tile}: must divide the {GROUP_WINDOW}-token window")
    places = triton.cdiv(t, tokens_per_tile) * tokens_per_tile
    order = torch.empty((hkv, places), dtype=torch.int32, device=block_ids.device)
    if t == 0:
        return order
    _group_tokens_kernel[(triton.cdiv(t, GROUP_WINDOW), hkv)](
        block_ids, req.contiguous(), pos.contiguous(), order, t, width_k, places, *block_ids.stride(),
        BLOCK_T=tokens_per_tile, K_POW2=triton.next_power_of_2(width_k), WINDOW=GROUP_WINDOW,
        WORDS=triton.next_power_of_2(triton.cdiv(max(1, block_table.shape[1]), 64)),
        num_warps=group_warps(width_k),
    )
    return order


def launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out,
           config: PrefillConfig | None = None):
    """Sparse prefill (:func:`sglang_nvfp4.kernels.sparse_prefill`): launch the plan and attention
    kernels; arguments as validated by the dispatcher.

    ``q``, ``out``: ``[T, H, 128]`` (bf16/fp16/fp32) with unit stride in the last dim; ``cache``: uint8
    ``[pages, 2 * Hkv, 128, 72]``; ``block_ids``: int32 ``[Hkv, T, K]`` logical block ids (-1: none);
    ``block_table``: int32 ``[R, S]``; ``req``, ``pos``: int32 ``[T]``; ``k_scale``/``v_scale``: a float or
    a one-element fp32 tensor on ``q``'s device; ``config``: the tile shape (default
    :func:`default_prefill_config`). Returns ``out``."""
    t, h, _ = q.shape
    hkv = cache.shape[1] // 2
    group = h // hkv
    if t == 0:
        return out
    cfg = config or default_prefill_config(group)
    group_pow2 = triton.next_power_of_2(group)
    if cfg.tokens_per_tile * group_pow2 < 16:
        raise ValueError(f"tokens_per_tile={cfg.tokens_per_tile} gives {cfg.tokens_per_tile * group_pow2} rows "
                         "per tile; tl.dot needs 16")
    pos = pos.contiguous()
    union_len, plan = plan_tiles(block_ids, block_table, req, pos, cfg.tokens_per_tile)
    _sparse_prefill_kernel[(union_len.shape[1], hkv)](
        q, out, cache, pos, union_len, plan[0], plan[1], plan[2],
        k_scale, v_scale, float(sm_scale),
        t, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HKV=hkv, GROUP=group, GROUP_POW2=group_pow2, BLOCK_T=cfg.tokens_per_tile, WIDTH=plan.shape[3],
        K_SCALE_BY_POINTER=isinstance(k_scale, torch.Tensor), V_SCALE_BY_POINTER=isinstance(v_scale, torch.Tensor),
        USE_PTX=uses_ptx(q.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
