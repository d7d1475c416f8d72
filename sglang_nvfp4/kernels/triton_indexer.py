"""Triton kernels of the block indexer (the rules they follow: :mod:`sglang_nvfp4.indexer`).

* :func:`summarize_pages` (``_summarize_kernel``): one program per (written slot, KV head); only the
  slot holding the highest row written to its page in the call does work: it decodes the page's K
  with the attention kernels' tile loader (:func:`.triton_common.load_k_tile`, exact) and stores the
  mean / max / min of rows ``0..row`` (fp16) and the fill count.
* :func:`select_top_blocks` (``_select_kernel``): one program per (tile of tokens, KV head). It
  streams the blocks of the tile's request in steps of ``BLOCKS``: gathers their summaries through
  the block table, scores them against the tile's aggregated queries (one ``tl.dot``; elementwise
  for one-token tiles), applies visibility and forcing, and merges the step into a per-token running
  top-k held in registers (repeatedly moving the step's best candidate into the slot of the current
  worst while it ranks higher). A tile whose tokens belong to several requests (decode batches,
  request boundaries) is processed one token per pass. Scores for all blocks are never stored.

Both are launched without host synchronisation (CUDA-graph safe) and take plain tensors; their
arguments are checked by :mod:`sglang_nvfp4.indexer`. Under ``TRITON_INTERPRET=1`` they run on CPU
tensors (the tests use that); the variable must be set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as fmt
from .triton_common import BLOCK_WORDS, HEAD_DIM, PAGE, TILE_SCALE, load_k_tile, uses_ptx

_EMPTY_ID = tl.constexpr(1 << 30)  # ids >= this mark empty slots of the running top-k (slot j holds _EMPTY_ID + j)
_PAD_ID = tl.constexpr((1 << 31) - 1)  # slots past topk when the slot count is padded to a power of two
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_NAN_BITS = tl.constexpr(0x7FC00000)  # a quiet NaN, as fp32 bits
BLOCKS_PER_STEP = 64  # blocks scored per step of the selection


@triton.jit
def _summarize_kernel(cache_ptr, slots_ptr, last_row_ptr, mean_ptr, bounds_ptr, fill_ptr,
                      HKV: tl.constexpr, MINMAX: tl.constexpr, USE_PTX: tl.constexpr):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    page = slot // PAGE
    row = (slot % PAGE).to(tl.int32)
    if row == tl.load(last_row_ptr + page):
        # e2m1 * e4m3 of every row of the page, fp32 [keys, dims] (exact: tiles hold value / TILE_SCALE)
        k = load_k_tile(cache_ptr, (page * (2 * HKV) + kv_head) * BLOCK_WORDS, USE_PTX).to(tl.float32) * TILE_SCALE
        written = (tl.arange(0, PAGE) <= row)[:, None]  # rows past `row` are stale or garbage (NaN codes too)
        count = row + 1
        dims = tl.arange(0, HEAD_DIM)
        summary = page * HKV + kv_head
        total = tl.sum(tl.where(written, k, 0.0), axis=0)
        tl.store(mean_ptr + summary * HEAD_DIM + dims, (total / count.to(tl.float32)).to(tl.float16))
        if MINMAX:  # NaN propagates, as in torch.amax/amin (tl.max/tl.min would skip it)
            has_nan = tl.max((written & (k != k)).to(tl.int32), axis=0) > 0
            nan = tl.full(has_nan.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
            hi = tl.max(tl.where(written, k, -float("inf")), axis=0)
            lo = tl.min(tl.where(written, k, float("inf")), axis=0)
            bound = bounds_ptr + summary * (2 * HEAD_DIM) + dims
            tl.store(bound, tl.where(has_nan, nan, hi).to(tl.float16))
            tl.store(bound + HEAD_DIM, tl.where(has_nan, nan, lo).to(tl.float16))
        if kv_head == 0:
            tl.store(fill_ptr + page, count)


def summarize_pages(cache: torch.Tensor, slots: torch.Tensor, last_row: torch.Tensor, mean: torch.Tensor,
                    bounds: torch.Tensor | None, fill: torch.Tensor) -> None:
    """Recompute the summaries of the pages written at ``slots`` (the Triton path of
    :meth:`sglang_nvfp4.indexer.BlockSummaries.update`, whose rules it follows; arguments checked there).

    ``cache``: uint8 ``[pages, 2 * Hkv, 128, 72]``; ``slots``: int32/int64 ``[N]``, ``page * 128 + row``,
    ``N >= 1``; ``last_row``: int32 ``[pages]`` scratch, all -1 between calls (restored on return);
    ``mean``: fp16 ``[pages, Hkv, 128]``; ``bounds``: fp16 ``[pages, Hkv, 2, 128]`` (max, min) or None;
    ``fill``: int32 ``[pages]``. Updated in place."""
    slots = slots.contiguous()
    page = slots.long() // fmt.PAGE_SIZE
    last_row.scatter_reduce_(0, page, (slots % fmt.PAGE_SIZE).int(), reduce="amax")
    hkv = mean.shape[1]
    _summarize_kernel[(slots.numel(), hkv)](
        cache, slots, last_row, mean, mean if bounds is None else bounds, fill,  # bounds unused without MINMAX
        HKV=hkv, MINMAX=bounds is not None, USE_PTX=uses_ptx(cache.device),
    )
    last_row.index_fill_(0, page, -1)


@triton.jit
def _select_kernel(queries_ptr, keys_ptr, block_table_ptr, req_ptr, pos_ptr, block_ids_ptr,
                   num_tokens, stride_br, stride_bs, sink_blocks, local_blocks,
                   HKV: tl.constexpr, DQ: tl.constexpr, TOPK: tl.constexpr, KPAD: tl.constexpr,
                   TOKENS: tl.constexpr, BLOCKS: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    lane = tl.arange(0, TOKENS)
    tok = tile * TOKENS + lane
    in_range = tok < num_tokens
    req = tl.load(req_ptr + tok, mask=in_range, other=0)
    own = tl.load(pos_ptr + tok, mask=in_range, other=0) // PAGE
    dims = tl.arange(0, DQ)
    q = tl.load(queries_ptr + (tok[:, None].to(tl.int64) * HKV + h) * DQ + dims[None, :],
                mask=in_range[:, None], other=0.0)

    slot = tl.arange(0, KPAD)[None, :]
    real_slot = slot < TOPK
    best_score = tl.where(real_slot, -float("inf"), float("inf")) + tl.zeros((TOKENS, KPAD), tl.float32)
    best_id = tl.where(real_slot, _EMPTY_ID + slot, _PAD_ID) + tl.zeros((TOKENS, KPAD), tl.int32)

    req_lo = tl.min(tl.where(in_range, req, 2147483647), axis=0)
    req_hi = tl.max(tl.where(in_range, req, -1), axis=0)
    one_request = req_lo == req_hi
    passes = tl.where(one_request, 1, tl.sum(in_range.to(tl.int32), axis=0))
    for p in range(0, passes):
        active = in_range & (one_request | (lane == p))
        r = tl.max(tl.where(active, req, -1), axis=0).to(tl.int64)
        num_blocks = tl.max(tl.where(active, own, -1), axis=0) + 1
        for start in range(0, num_blocks, BLOCKS):
            block = start + tl.arange(0, BLOCKS)
            page = tl.load(block_table_ptr + r * stride_br + block * stride_bs, mask=block < num_blocks, other=0)
            keys = tl.load(keys_ptr + (page[None, :].to(tl.int64) * HKV + h) * DQ + dims[:, None],
                           mask=(block < num_blocks)[None, :], other=0.0)
            if TOKENS == 1:  # decode: one token per program, products on the CUDA cores
                score = tl.reshape(tl.sum(tl.reshape(q, (DQ, 1)).to(tl.float32) * keys.to(tl.float32), axis=0),
                                   (1, BLOCKS))
            else:
                score = tl.dot(q, keys)  # fp32 [TOKENS, BLOCKS]
            score = tl.where(score != score, -_FLT_MAX, tl.minimum(tl.maximum(score, -_FLT_MAX), _FLT_MAX))
            visible = active[:, None] & (block[None, :] <= own[:, None])
            forced = (block[None, :] == own[:, None]) | (block[None, :] < sink_blocks) | \
                     (block[None, :] >= own[:, None] - local_blocks)
            score = tl.where(visible, tl.where(forced, float("inf"), score), -float("inf"))
            worst = tl.min(tl.where(real_slot, best_score, float("inf")), axis=1)
            may_enter = (score >= worst[:, None]) & (score > -float("inf"))
            if tl.sum(may_enter.to(tl.int32)) > 0:
                for _ in range(TOPK):
                    top = tl.max(score, axis=1)
                    top_id = tl.min(tl.where(score == top[:, None], block[None, :], _PAD_ID), axis=1)
                    worst = tl.min(tl.where(real_slot, best_score, float("inf")), axis=1)
                    worst_id = tl.max(tl.where(real_slot & (best_score == worst[:, None]), best_id, -1), axis=1)
                    enters = (top > -float("inf")) & ((top > worst) | ((top == worst) & (top_id < worst_id)))
                    replace = enters[:, None] & (best_id == worst_id[:, None])
                    best_score = tl.where(replace, top[:, None], best_score)
                    best_id = tl.where(replace, top_id[:, None], best_id)
                    score = tl.where(block[None, :] == top_id[:, None], -float("inf"), score)

    ids = tl.sort(best_id, dim=1)  # selected ids ascending, then empty slots, then padding
    ids = tl.where(ids >= _EMPTY_ID, -1, ids)
    out = block_ids_ptr + (h * num_tokens + tok[:, None].to(tl.int64)) * TOPK + slot
    tl.store(out, ids, mask=in_range[:, None] & real_slot)


def select_top_blocks(queries: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
                      pos: torch.Tensor, topk: int, sink_blocks: int, local_blocks: int, *,
                      tokens_per_tile: int | None = None, blocks_per_step: int = BLOCKS_PER_STEP,
                      num_warps: int | None = None) -> torch.Tensor:
    """Triton path of :func:`sglang_nvfp4.indexer.select_blocks`: the ``topk`` blocks of each token and
    KV head, int32 ``block_ids [Hkv, T, topk]`` (ascending ids, then -1).

    ``queries``: aggregated queries, fp16 ``[T, Hkv, D]``; ``keys``: the summaries they score against,
    fp16 ``[pages, Hkv, D]``; ``block_table`` int32 ``[R, S]``, ``req``, ``pos`` int32 ``[T]``. A program
    takes one token when ``T <= R`` (decode-like: about one token per request, so every token gets its
    own program), else a tile of 64 tokens scored with ``tl.dot`` (1 or >= 16); the keyword arguments
    are tuning knobs for the benchmark."""
    t, hkv, dq = queries.shape
    if tokens_per_tile is None:
        tokens_per_tile = 1 if t <= block_table.shape[0] else 64
    if tokens_per_tile != 1 and tokens_per_tile < 16:
        raise ValueError(f"tokens_per_tile: must be 1 or >= 16 (tl.dot), got {tokens_per_tile}")
    if num_warps is None:
        num_warps = 4 if tokens_per_tile <= 32 else 8
    block_ids = torch.empty(hkv, t, topk, dtype=torch.int32, device=queries.device)
    grid = (triton.cdiv(t, tokens_per_tile), hkv)
    _select_kernel[grid](
        queries, keys, block_table, req.contiguous(), pos.contiguous(), block_ids,
        t, block_table.stride(0), block_table.stride(1), sink_blocks, local_blocks,
        HKV=hkv, DQ=dq, TOPK=topk, KPAD=triton.next_power_of_2(topk), TOKENS=tokens_per_tile, BLOCKS=blocks_per_step,
        num_warps=num_warps,
    )
    return block_ids
