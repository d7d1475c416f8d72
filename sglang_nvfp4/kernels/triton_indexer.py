"""Triton kernels of the block indexer (the rules they follow: :mod:`sglang_nvfp4.indexer`).

* :func:`summarize_pages` (``_summarize_kernel``): one program per (written slot, KV head); only the
  slot holding the highest row written to its page in the call does work: it decodes the page's K
  with the attention kernels' tile loader (:func:`.triton_common.load_k_tile`, exact) and stores the
  mean / max / min of rows ``0..row`` (fp16) and the fill count.
* :func:`select_top_blocks` (``_select_kernel``): one program per (tile of tokens, KV head). It
  streams the blocks of the tile's request in steps of ``BLOCKS``: gathers their summaries through
  the block table, scores them against the tile's aggregated queries (one ``tl.dot``; elementwise
  for one-token tiles), applies visibility and forcing, and merges the step into a per-token running
  top-k held in registers (repeatedly moving each row's best candidate of the step into the slot of its
  current worst while it ranks higher, until no row's does). A tile whose tokens belong to several requests
  (decode batches, request boundaries) is processed one token per pass. Scores for all blocks are never stored.
* :func:`select_learned_blocks` (MiniMax-M3's learned indexer) and :func:`select_proxy_blocks` (the proxy
  indexer): ``_key_scores_kernel`` scores every visible key on the tensor cores (``q . k^T`` per block of
  128 keys: the model's index keys, or the K tiles of the NVFP4 cache decoded as attention does) and
  max-reduces per block into fp32 block scores, in token chunks of at most ``LEARNED_SCORE_BYTES``; then
  ``_select_scored_kernel`` applies the rule and the running top-k (the helpers ``_ranked_scores``,
  ``_merge_top_k`` and ``_store_top_k`` it shares with ``_select_kernel``).
* :func:`write_fp8_index_keys` (``_write_fp8_index_keys_kernel``): the learned indexer's fp8 index keys, each
  key quantized and stored at its slot in one launch (the rule of
  :func:`sglang_nvfp4.indexer.fp8.quantize_rows`, bit for bit).

All are launched without host synchronisation (CUDA-graph safe) and take plain tensors; their
arguments are checked by :mod:`sglang_nvfp4.indexer`. Under ``TRITON_INTERPRET=1`` they run on CPU
tensors (the tests use that); the variable must be set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as fmt
from ..indexer.proxy import FP8_KEY_FACTOR
from ..indexer.rules import max_into_runs
from .triton_common import (BLOCK_WORDS, HEAD_DIM, INTERPRETED, PAGE, TILE_SCALE, decode_k_tile, load_k_codes,
                            load_k_tile, uses_ptx)

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
def _ranked_scores(score, block, own, active, sink_blocks, local_blocks):
    """The selection rule (:mod:`sglang_nvfp4.indexer.rules`) on a step of scores ``[ROWS, BLOCKS]``:
    NaN ranks as -FLT_MAX and +-inf as +-FLT_MAX, forced blocks as +inf, invisible ones as -inf."""
    score = tl.where(score != score, -_FLT_MAX, tl.minimum(tl.maximum(score, -_FLT_MAX), _FLT_MAX))
    visible = active[:, None] & (block[None, :] <= own[:, None])
    forced = (block[None, :] == own[:, None]) | (block[None, :] < sink_blocks) | \
             (block[None, :] >= own[:, None] - local_blocks)
    return tl.where(visible, tl.where(forced, float("inf"), score), -float("inf"))


@triton.jit
def _empty_top_k(ROWS: tl.constexpr, TOPK: tl.constexpr, KPAD: tl.constexpr):
    """A running top-k of ``ROWS`` rows with no entry: scores and ids ``[ROWS, KPAD]``."""
    slot = tl.arange(0, KPAD)[None, :]
    real_slot = slot < TOPK
    best_score = tl.where(real_slot, -float("inf"), float("inf")) + tl.zeros((ROWS, KPAD), tl.float32)
    best_id = tl.where(real_slot, _EMPTY_ID + slot, _PAD_ID) + tl.zeros((ROWS, KPAD), tl.int32)
    return best_score, best_id


@triton.jit
def _best_candidate(score, block):
    """Each row's best remaining candidate of ``score [ROWS, BLOCKS]``: its score and (among equal scores) the
    lowest block id."""
    top = tl.max(score, axis=1)
    return top, tl.min(tl.where(score == top[:, None], block[None, :], _PAD_ID), axis=1)


@triton.jit
def _entry_to_replace(best_score, best_id, real_slot):
    """Each row's current worst entry of the running top-k (lowest score, then highest id): score and id."""
    worst = tl.min(tl.where(real_slot, best_score, float("inf")), axis=1)
    return worst, tl.max(tl.where(real_slot & (best_score == worst[:, None]), best_id, -1), axis=1)


@triton.jit
def _ranks_above(top, top_id, worst, worst_id):
    return (top > -float("inf")) & ((top > worst) | ((top == worst) & (top_id < worst_id)))


@triton.jit
def _merge_top_k(score, block, best_score, best_id, TOPK: tl.constexpr, KPAD: tl.constexpr):
    """Merge ranked scores of ``block [BLOCKS]`` into each row's running top-k: while a row's best remaining
    candidate ranks above its current worst entry (score desc, then id asc), it takes the worst's slot.

    The loop ends as soon as no row's candidate enters: a row that takes none now never will in this step (its
    best remaining candidate only falls, its worst entry stays), so the result is that of ``TOPK`` passes. Past
    the first steps few candidates enter (with random scores, a row's step ``j`` brings about ``TOPK / (j + 1)``),
    and most steps end after a pass or two. Each pass removes each row's candidate, so at most ``BLOCKS`` run."""
    real_slot = tl.arange(0, KPAD)[None, :] < TOPK
    top, top_id = _best_candidate(score, block)
    worst, worst_id = _entry_to_replace(best_score, best_id, real_slot)
    enters = _ranks_above(top, top_id, worst, worst_id)
    while tl.max(enters.to(tl.int32), axis=0) > 0:
        replace = enters[:, None] & (best_id == worst_id[:, None])
        best_score = tl.where(replace, top[:, None], best_score)
        best_id = tl.where(replace, top_id[:, None], best_id)
        score = tl.where(block[None, :] == top_id[:, None], -float("inf"), score)
        top, top_id = _best_candidate(score, block)
        worst, worst_id = _entry_to_replace(best_score, best_id, real_slot)
        enters = _ranks_above(top, top_id, worst, worst_id)
    return best_score, best_id


@triton.jit
def _store_top_k(best_id, out_ptr, row_ok, TOPK: tl.constexpr, KPAD: tl.constexpr):
    """Store each row's ids ascending, then -1, at ``out_ptr [ROWS]`` (row starts) + slot."""
    slot = tl.arange(0, KPAD)[None, :]
    ids = tl.sort(best_id, dim=1)  # selected ids ascending, then empty slots, then padding
    ids = tl.where(ids >= _EMPTY_ID, -1, ids)
    tl.store(out_ptr[:, None] + slot, ids, mask=row_ok[:, None] & (slot < TOPK))


@triton.jit
def _one_request(req, in_range):
    """Whether the tile's tokens all belong to one request (then one pass serves them all)."""
    return tl.min(tl.where(in_range, req, 2147483647), axis=0) == tl.max(tl.where(in_range, req, -1), axis=0)


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
    best_score, best_id = _empty_top_k(TOKENS, TOPK, KPAD)
    one_request = _one_request(req, in_range)  # one pass; else one pass per token
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
            score = _ranked_scores(score, block, own, active, sink_blocks, local_blocks)
            best_score, best_id = _merge_top_k(score, block, best_score, best_id, TOPK, KPAD)
    _store_top_k(best_id, block_ids_ptr + (h * num_tokens + tok.to(tl.int64)) * TOPK, in_range, TOPK, KPAD)


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


# ---- the learned indexer (MiniMax-M3): index-key scores per block, then the same top-k ----------------
LEARNED_SCORE_BYTES = 1 << 28  # fp32 block scores held at once; longer prefills are scored in token chunks
LEARNED_DECODE_STEP = 256  # blocks per merge step of a one-token selection program (decode: few programs)
# Prefill launches of the learned indexer, from the sweeps of bench/bench_m3.py --score-sweep on the H200
# (bench/results/m3_h200.md; 2026-12-03 16:01 and 2026-12-04 17:14 UTC, the same order in both; per layer, 4 index
# heads): scores in programs of 128 (token, head) rows (32 tokens), 16 blocks, 8 warps, 2 pipeline stages: 16.17 ms
# at 128K against 16.89 with 256 rows (1.00 against 1.12 at 32K; 4 warps: 25.4). Selection over stored scores in
# programs of 32 tokens, 16 blocks per merge step, 4 warps: 1.92 ms at 128K against 2.28 with 32-block steps (0.20
# against 0.24 at 32K); the proxy indexer's selection is the same kernel on the same [heads, T, S] scores and takes
# it too.
LEARNED_PREFILL_ROWS, LEARNED_PREFILL_STAGES = 128, 2
# The proxy's score programs (each decodes its key tiles from NVFP4): prefill tiles of 256 (token, query group) rows
# on 4 warps, from a sweep on the H200 (bench/results/selection_h200_proxy_launch.json, 2026-12-03; 32K tokens, 64/4
# heads, every head, top-16 selection): 17.45 ms against 20.58 (128 rows, 8 warps, the launch before) and 20.61
# (256 rows, 8 warps); Triton's pipeline stages (1, 2, 3) moved it by under 1%. fp8 programs also load the next
# page's code words while the current page decodes (``PREFETCH``): 12.40 ms against 13.22 without (fp16: 19.59,
# slower than without). Not in decode programs (one token, 4 blocks each, memory-bound): there the page loaded past
# the last one cost 1950 against 1417 us at batch 256 (bench_selection.py, same file).
PROXY_PREFILL_ROWS, PROXY_WARPS = 256, 4
# fp8 proxy scores: decoded key tiles (value / TILE_SCALE, at most 42) times this are the keys times the proxy's
# FP8_KEY_FACTOR (at most 336 of E4M3's 448), the rounding of indexer.proxy.round_keys_fp8
FP8_KEY_SCALE = tl.constexpr(TILE_SCALE.value * FP8_KEY_FACTOR)
SCORED_SELECT_TOKENS, SCORED_SELECT_STEP = 32, 16


@triton.jit
def _key_scores_kernel(idx_q_ptr, query_rows_ptr, keys_ptr, key_exponents_ptr, block_table_ptr, req_ptr, pos_ptr,
                           scores_ptr, num_tokens, num_cols, stride_qt, stride_qh, stride_br, stride_bs,
                           QUERY_ROWS: tl.constexpr, HEADS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                           TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr, HKV: tl.constexpr,
                           FROM_CACHE: tl.constexpr, MAX_OVER_HEADS: tl.constexpr, FP8: tl.constexpr,
                           FP8_KEYS: tl.constexpr, USE_PTX: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (token tile, group of BLOCKS blocks, KV head): per block ``S = q . k^T`` on the tensor cores,
    the max over the block's 128 keys written to ``scores [heads, T, num_cols]`` (visible blocks only). A row's
    own block is scored over all its keys, those past the row's position too: the rule forces that block, so
    its score is never read (the selections equal those of scores masked at the position). Two key sources:

    * index keys (``FROM_CACHE`` false; MiniMax-M3): rows are (token, index head) pairs, ``idx_q [T, HEADS,
      D]``, all sharing the index keys ``keys [slots, D]``; one KV-head program (``HKV`` 1). The keys are in
      ``idx_q``'s dtype (bf16/fp16), or with ``FP8_KEYS`` E4M3 codes and uint8 E8M0 exponents
      ``key_exponents [slots]`` (:func:`sglang_nvfp4.indexer.fp8.quantize_rows`): the codes convert to fp16
      exactly, the query rows to fp16 times a power of two per row (:func:`_fp16_query_rows`: exact but for
      elements below 2**-31 of their row's largest), and each key's products are multiplied by its power of two;
    * the NVFP4 cache's K (``FROM_CACHE``; the proxy indexer): rows are (token, query group) pairs, ``idx_q``
      the aggregated queries ``[T, HKV * HEADS, 128]`` (``HEADS`` groups per KV head; fp16, or bf16 / fp32
      rounded to fp16 as they load), ``keys`` the cache; program_id(2) is the KV head. Decoded tiles hold value /
      TILE_SCALE, a power of two, which changes no ranking.

    Row (token ``t``, head ``h``) of KV head ``kv`` reads the query at ``t * stride_qt + (kv * HEADS + h) *
    stride_qh`` (with ``QUERY_ROWS``, token row ``query_rows[t]`` instead of ``t``) and writes score row
    ``kv * HEADS + h``; with ``MAX_OVER_HEADS`` the max over a token's ``HEADS`` rows goes to score row
    ``kv`` instead (``scores [HKV, T, num_cols]``: the proxy's query groups merged in registers).

    ``FP8`` (the proxy's ``precision="fp8"``, :mod:`sglang_nvfp4.indexer.proxy`): each query row and each decoded
    key tile is rounded to E4M3 (:func:`_fp8_query_rows`, ``FP8_KEY_SCALE``) and the products run on the fp8
    tensor cores (twice the fp16 rate); each block's max is scaled back, so scores keep the fp16 path's units.
    ``PREFETCH`` (``FROM_CACHE`` only): the next block's code words load while this block's decode and products
    run (:func:`.triton_common.load_k_codes`, then :func:`.triton_common.decode_k_tile`)."""
    tl.static_assert(FROM_CACHE or not FP8, "FP8 products need FROM_CACHE: the key factor is applied by decode_k_tile")
    KEY_FACTOR: tl.constexpr = FP8_KEY_SCALE if FP8 else 1.0  # on the key scales (decode_k_tile): the same bits
    tile = tl.program_id(0)
    first = tl.program_id(1) * BLOCKS
    kv_head = tl.program_id(2)
    row = tl.arange(0, ROWS)
    lane = row // HP
    head = row % HP
    tok = tile * TOKENS + lane
    in_range = (lane < TOKENS) & (head < HEADS) & (tok < num_tokens)
    req = tl.load(req_ptr + tok, mask=in_range, other=0)
    pos = tl.load(pos_ptr + tok, mask=in_range, other=0)
    own = pos // PAGE
    if first <= tl.max(tl.where(in_range, own, -1), axis=0):  # else no row sees a block of this group
        dims = tl.arange(0, D)
        keyrow = tl.arange(0, PAGE)
        col = tl.arange(0, BLOCKS)
        q_tok = tok.to(tl.int64)
        if QUERY_ROWS:
            q_tok = tl.load(query_rows_ptr + tok, mask=in_range, other=0).to(tl.int64)
        q = tl.load(idx_q_ptr + (q_tok * stride_qt + (kv_head * HEADS + head) * stride_qh)[:, None] + dims[None, :],
                    mask=in_range[:, None], other=0.0)
        if FROM_CACHE:
            q = q.to(tl.float16)  # the proxy's queries are fp16 (the decoded keys' dtype)
        if FP8:
            q, row_unscale = _fp8_query_rows(q)
        if FP8_KEYS:
            q, row_unscale = _fp16_query_rows(q)
        one_request = _one_request(req, in_range)  # one pass; else one pass per token
        passes = tl.where(one_request, 1, tl.minimum(TOKENS, num_tokens - tile * TOKENS))
        for p in range(0, passes):
            active = in_range & (one_request | (lane == p))
            r = tl.max(tl.where(active, req, -1), axis=0).to(tl.int64)
            num_blocks = tl.max(tl.where(active, own, -1), axis=0) + 1
            score = tl.full((ROWS, BLOCKS), -float("inf"), tl.float32)
            end = tl.minimum(first + BLOCKS, num_blocks)
            if PREFETCH:
                page = tl.load(block_table_ptr + r * stride_br + first * stride_bs, mask=first < end, other=0)
                words, scale_codes = load_k_codes(keys_ptr, (page.to(tl.int64) * (2 * HKV) + kv_head) * BLOCK_WORDS)
            for b in range(first, end):
                if PREFETCH:
                    cur_words, cur_scales = words, scale_codes
                    page = tl.load(block_table_ptr + r * stride_br + (b + 1) * stride_bs, mask=b + 1 < end, other=0)
                    words, scale_codes = load_k_codes(keys_ptr, (page.to(tl.int64) * (2 * HKV) + kv_head) * BLOCK_WORDS)
                    k = decode_k_tile(cur_words, cur_scales, USE_PTX, KEY_FACTOR)
                elif FROM_CACHE:
                    page = tl.load(block_table_ptr + r * stride_br + b * stride_bs).to(tl.int64)
                    k = load_k_tile(keys_ptr, (page * (2 * HKV) + kv_head) * BLOCK_WORDS, USE_PTX, KEY_FACTOR)
                else:
                    page = tl.load(block_table_ptr + r * stride_br + b * stride_bs).to(tl.int64)
                    k = tl.load(keys_ptr + (page * PAGE + keyrow)[:, None] * D + dims[None, :])  # [128, D]
                    if FP8_KEYS:
                        k = k.to(tl.float16)  # exact, and one unpacking instruction per two codes
                if FP8:
                    k = to_e4m3(k)  # decoded times FP8_KEY_SCALE: at most 336, no saturation
                # No causal mask: keys past a row's position lie in the row's own block, which the rule always
                # selects (forced), so its score never counts, and later blocks are not stored.
                s = tl.dot(q, tl.trans(k))  # fp32 [ROWS, 128]
                if FP8_KEYS:  # each key's power of two, from its E8M0 byte
                    exponent = tl.load(key_exponents_ptr + page * PAGE + keyrow).to(tl.int32)
                    s = s * _power_of_two(exponent)[None, :]
                score = tl.where(col[None, :] == b - first, tl.max(s, axis=1)[:, None], score)
            if FP8 or FP8_KEYS:  # max(c * s) = c * max(s) for c > 0: one product per block and row
                score = score * row_unscale[:, None]
            block = first + col
            if MAX_OVER_HEADS:
                _store_max_over_heads(score, active, own, tok, block, scores_ptr + kv_head.to(tl.int64) * num_tokens
                                      * num_cols, num_cols, ROWS // HP, HP, BLOCKS)
            else:
                out_head = (kv_head * HEADS + head).to(tl.int64)
                out = scores_ptr + (out_head * num_tokens + tok)[:, None] * num_cols + block[None, :]
                tl.store(out, score, mask=active[:, None] & (block[None, :] <= own[:, None]))


@triton.jit
def _row_exponents(x):
    """E8M0 bytes ``e`` (int32 ``[ROWS]``) of the rows of fp32 ``x [ROWS, D]``, the rule of
    :func:`sglang_nvfp4.indexer.fp8.quantize_rows`: ``2**(127 - e)`` takes a row's largest magnitude into
    ``[128, 256)``, from its fp32 exponent field ``b`` (``e = b - 7``, clamped to ``1..254``; 119 for a zero row, as
    ``torch.frexp`` gives). Finite rows give ``e <= 247``."""
    largest = tl.max(tl.abs(x), axis=1)
    biased = (largest.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(largest == 0, 119, tl.minimum(tl.maximum(biased - 7, 1), 254))


@triton.jit
def _power_of_two(e):
    """fp32 ``2**(e - 127)`` of int32 ``e`` in ``1..254`` (an E8M0 byte's value), from the exponent bits."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_query_rows(q):
    """bf16/fp16 queries ``[ROWS, D]`` -> fp16 ``q * 2**j`` per row, and the fp32 ``2**-j`` ``[ROWS]`` that map the
    row's products back. ``2**j`` takes the row's largest magnitude into ``[2**14, 2**15)`` (:func:`_row_exponents`
    rule, 2**7 higher), so a bf16 element of at least 2**-31 of it keeps its 8 significant bits (fp16's subnormals
    step by 2**-24); a smaller one moves by under 2**-39 of the largest. The products with the fp16 key codes are
    exact in fp32, as bf16 products are. Why fp16: on sm_90 E4M3 codes convert to fp16 in one instruction per two,
    to bf16 only through fp16 and one more conversion per value (SASS of Triton 3.6: 96 instead of 32 per thread and
    key tile); with bf16, fp8 keys' prefill scores took twice as long as bf16 keys' on the H200 (m3_h200.md)."""
    q = q.to(tl.float32)
    exponent = _row_exponents(q)  # 1..247 for finite rows: 2**j = 2**(134 - exponent), at most 2**126
    return (q * _power_of_two(tl.minimum(261 - exponent, 253))[:, None]).to(tl.float16), \
        _power_of_two(tl.maximum(exponent - 7, 1))


@triton.jit
def _fp8_query_rows(q):
    """fp16 queries ``[ROWS, D]`` -> E4M3 ``q * 2**j`` per row (round to nearest even) and fp32 ``[ROWS]`` factors
    that map a row's products with ``FP8_KEY_SCALE``-scaled key tiles back to fp16 tile units. ``2**j`` takes the
    row's largest magnitude into ``[128, 256)``, inside E4M3's 448 (:func:`_row_exponents`, the rule of
    :func:`sglang_nvfp4.indexer.proxy.round_queries_fp8`)."""
    q = q.to(tl.float32)
    exponent = _row_exponents(q)
    return to_e4m3(q * _power_of_two(254 - exponent)[:, None]), _power_of_two(exponent) / FP8_KEY_SCALE


@triton.jit
def to_e4m3(x):
    """fp16 or fp32 -> E4M3, round to nearest even (``x`` within +-448). Compiled: the hardware conversion. Triton's
    interpreter (3.8) rounds wrongly where the rounding carries into the next power of two (127.6 -> 64) and
    breaks ties away from zero, so there ``x`` is first rounded to E4M3's grid in fp32 (adding and subtracting
    ``1.5 * 2**23`` times the grid step, which is 2**-9 below 2**-6 and else 2**-3 of ``x``'s power of two); that
    value it converts exactly."""
    if INTERPRETED:
        x = x.to(tl.float32)
        biased = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # 121: E4M3's smallest normal
        magic = (((biased + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2**(23 + step exponent)
        x = tl.where(x < 0, -((-x + magic) - magic), (x + magic) - magic)
    return x.to(tl.float8e4nv)


@triton.jit
def _store_max_over_heads(score, active, own, tok, block, out_ptr, num_cols,
                          LANES: tl.constexpr, HP: tl.constexpr, BLOCKS: tl.constexpr):
    """Store the max over each token's ``HP`` consecutive rows of ``score [LANES * HP, BLOCKS]`` (rows of inactive
    or padding heads excluded: their zero queries would score 0) at ``out_ptr + token * num_cols + block``."""
    score = tl.where(active[:, None], score, -float("inf"))
    merged = tl.max(tl.reshape(score, (LANES, HP, BLOCKS)), axis=1)
    lane_active = tl.max(tl.reshape(active.to(tl.int32), (LANES, HP)), axis=1) > 0
    lane_own = tl.max(tl.reshape(own, (LANES, HP)), axis=1)  # padding heads hold 0, real ones the position's
    lane_tok = tl.max(tl.reshape(tok, (LANES, HP)), axis=1)
    out = out_ptr + lane_tok.to(tl.int64)[:, None] * num_cols + block[None, :]
    tl.store(out, merged, mask=lane_active[:, None] & (block[None, :] <= lane_own[:, None]))


@triton.jit
def _select_scored_kernel(scores_ptr, pos_ptr, block_ids_ptr, num_tokens, num_cols, tok0, total_tokens,
                          sink_blocks, local_blocks,
                          TOPK: tl.constexpr, KPAD: tl.constexpr, TOKENS: tl.constexpr, BLOCKS: tl.constexpr):
    """Program (token tile, head): the selection rule and running top-k over stored block scores."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    tok = tile * TOKENS + tl.arange(0, TOKENS)
    in_range = tok < num_tokens
    own = tl.load(pos_ptr + tok, mask=in_range, other=0) // PAGE
    best_score, best_id = _empty_top_k(TOKENS, TOPK, KPAD)
    num_blocks = tl.max(tl.where(in_range, own, -1), axis=0) + 1
    row = scores_ptr + (h.to(tl.int64) * num_tokens + tok) * num_cols
    for start in range(0, num_blocks, BLOCKS):
        block = start + tl.arange(0, BLOCKS)
        visible = in_range[:, None] & (block[None, :] <= own[:, None])
        score = tl.load(row[:, None] + block[None, :], mask=visible, other=-float("inf"))
        score = _ranked_scores(score, block, own, in_range, sink_blocks, local_blocks)
        best_score, best_id = _merge_top_k(score, block, best_score, best_id, TOPK, KPAD)
    out = block_ids_ptr + (h.to(tl.int64) * total_tokens + tok0 + tok) * TOPK
    _store_top_k(best_id, out, in_range, TOPK, KPAD)


def learned_tiling(num_tokens: int, num_rows: int, heads: int, prefill_rows: int = 128) -> tuple[int, int]:
    """(tokens per program, blocks per score program): decode-like batches (``T <= R``, about one token per
    request) take one token per program and 4 blocks per program (more programs per token); prefill
    tiles take ``prefill_rows`` rows of (token, head) and 16 blocks: the learned indexer 128 rows, 32 tokens of
    4 index heads (``LEARNED_PREFILL_ROWS``); the proxy indexer ``PROXY_PREFILL_ROWS`` rows of (token, query
    group) (its programs serve one KV head each, and decode each key tile from NVFP4)."""
    if num_tokens <= num_rows:
        return 1, 4
    return max(1, prefill_rows // triton.next_power_of_2(heads)), 16


def learned_launch(num_tokens: int, num_rows: int, heads: int) -> tuple[int, int, int | None]:
    """(tokens per program, blocks per program, pipeline stages or ``None`` for Triton's default) of the
    learned indexer's score launch: :func:`learned_tiling` with ``LEARNED_PREFILL_ROWS``, and
    ``LEARNED_PREFILL_STAGES`` for prefill tiles."""
    tokens, blocks = learned_tiling(num_tokens, num_rows, heads, LEARNED_PREFILL_ROWS)
    return tokens, blocks, None if tokens == 1 else LEARNED_PREFILL_STAGES


def learned_score_chunks(num_tokens: int, heads: int, cols: int, tokens: int,
                         score_bytes: int = LEARNED_SCORE_BYTES) -> list[tuple[int, int]]:
    """``(first token, count)`` of each chunk whose fp32 block scores ``[heads, count, cols]`` fit
    ``score_bytes`` (a multiple of ``tokens`` per chunk, at least one tile)."""
    chunk = max(tokens, score_bytes // (4 * heads * cols) // tokens * tokens)
    return [(c0, min(chunk, num_tokens - c0)) for c0 in range(0, num_tokens, chunk)]


def learned_block_scores(idx_q, keys, block_table, req, pos, scores, tokens: int, blocks: int, *,
                         key_exponents: torch.Tensor | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, max_registers: int | None = None) -> None:
    """Block scores of the tokens of ``idx_q [n, Hi, D]`` (contiguous; the dtype of ``keys``, or bf16/fp16 for fp8
    keys with their ``key_exponents``), ``req`` and ``pos [n]``, into ``scores`` fp32 ``[Hi, n, S]`` (visible
    blocks only; contiguous). ``num_warps``, ``num_stages`` and ``max_registers`` (per thread, CUDA's ``maxnreg``)
    override the launch defaults (``bench/bench_m3.py`` sweeps them)."""
    n, heads, d = idx_q.shape
    if not (scores.is_contiguous() and idx_q.is_contiguous() and keys.is_contiguous()):
        raise ValueError("learned_block_scores: idx_q, keys and scores must be contiguous")
    fp8_keys = keys.dtype == torch.float8_e4m3fn
    if fp8_keys != (key_exponents is not None) or (not fp8_keys and idx_q.dtype != keys.dtype):
        raise ValueError(f"learned_block_scores: {keys.dtype} keys with{'' if key_exponents is not None else 'out'} "
                         f"exponents and {idx_q.dtype} queries (fp8 keys need their exponents, others idx_q's dtype)")
    hp = triton.next_power_of_2(heads)
    rows = max(16, tokens * hp)  # tl.dot needs 16 rows
    cols = block_table.shape[1]
    _key_scores_kernel[(triton.cdiv(n, tokens), triton.cdiv(cols, blocks), 1)](
        # pos stands in for query_rows, which QUERY_ROWS=False leaves unread
        idx_q, pos, keys, keys if key_exponents is None else key_exponents, block_table, req, pos, scores, n, cols,
        idx_q.stride(0), idx_q.stride(1), block_table.stride(0), block_table.stride(1), QUERY_ROWS=False,
        HEADS=heads, HP=hp, D=d, TOKENS=tokens, ROWS=rows, BLOCKS=blocks, HKV=1, FROM_CACHE=False,
        MAX_OVER_HEADS=False, FP8=False, FP8_KEYS=fp8_keys, USE_PTX=False, PREFETCH=False,
        num_warps=num_warps or (4 if rows <= 64 else 8), **({"num_stages": num_stages} if num_stages else {}),
        **({"maxnreg": max_registers} if max_registers else {}),
    )


def proxy_block_scores(queries, cache, block_table, req, pos, scores, tokens: int, blocks: int,
                       groups: int = 1, fp8: bool = False, query_rows: torch.Tensor | None = None) -> None:
    """Block scores of the proxy indexer for the ``n`` tokens of ``req``, ``pos [n]``: aggregated queries
    ``[n, Hkv * groups, 128]`` (``groups`` per KV head; fp16, or bf16 / fp32 rounded to fp16 in the kernel; unit
    stride in the last dim), or with ``query_rows`` (int32 ``[n]``) token ``i``'s queries at row ``query_rows[i]`` of
    ``queries``, against the K of the NVFP4 ``cache``, max-pooled per block and over the KV head's groups, into
    ``scores`` fp32 ``[Hkv, n, S]`` (visible blocks only; contiguous); ``fp8``: products of E4M3-rounded queries and
    keys."""
    n, hkv = pos.shape[0], cache.shape[1] // 2
    check_query_rows(queries, hkv * groups, n, query_rows, "proxy_block_scores")
    if not scores.is_contiguous():
        raise ValueError("proxy_block_scores: scores must be contiguous")
    hp = triton.next_power_of_2(groups)
    rows = max(16, tokens * hp)
    cols = block_table.shape[1]
    _key_scores_kernel[(triton.cdiv(n, tokens), triton.cdiv(cols, blocks), hkv)](
        queries, pos if query_rows is None else query_rows, cache, cache, block_table, req, pos, scores, n, cols,
        queries.stride(0), queries.stride(1), block_table.stride(0), block_table.stride(1),
        QUERY_ROWS=query_rows is not None, HEADS=groups, HP=hp, D=queries.shape[2], TOKENS=tokens, ROWS=rows,
        BLOCKS=blocks, HKV=hkv, FROM_CACHE=True, MAX_OVER_HEADS=True, FP8=fp8, FP8_KEYS=False,
        USE_PTX=uses_ptx(cache.device), PREFETCH=fp8 and tokens > 1,
        num_warps=PROXY_WARPS,
    )


def check_query_rows(queries: torch.Tensor, rows_per_token: int, n: int, query_rows: torch.Tensor | None,
                     caller: str) -> None:
    """The proxy score kernels' query operands: ``queries [rows, rows_per_token, 128]`` fp16 / bf16 / fp32 with unit
    stride in the last dim, one row per scored token (``n``), or ``query_rows`` int32 ``[n]`` on its device picking
    them (the caller guarantees them in range). ``ValueError`` naming ``caller`` otherwise."""
    if (queries.dim() != 3 or queries.shape[1:] != (rows_per_token, fmt.HEAD_DIM)
            or queries.dtype not in (torch.float16, torch.bfloat16, torch.float32) or queries.stride(2) != 1):
        raise ValueError(f"{caller}: queries fp16/bf16/fp32 [rows, {rows_per_token}, {fmt.HEAD_DIM}] with unit "
                         f"stride in the last dim expected, got {queries.dtype} {tuple(queries.shape)} strides "
                         f"{queries.stride()}")
    if query_rows is None:
        if queries.shape[0] != n:
            raise ValueError(f"{caller}: {queries.shape[0]} query rows for {n} tokens (no query_rows)")
    elif (query_rows.dtype != torch.int32 or query_rows.shape != (n,) or not query_rows.is_contiguous()
          or query_rows.device != queries.device):
        raise ValueError(f"{caller}: query_rows: contiguous int32 [{n}] on {queries.device} expected, got "
                         f"{query_rows.dtype} {tuple(query_rows.shape)} on {query_rows.device}")


def _select_warps(tokens: int) -> int:
    """Warps of a selection program of ``tokens`` rows. A one-token program (decode) is a chain of small
    reductions, which one warp does without cross-warp barriers: 35.3 against 36.8 us (4 warps) for scores and
    selection at batch 8, 32K context, on the H200 (``bench/results/m3_h200.md``)."""
    return 1 if tokens == 1 else 4 if tokens <= 32 else 8


def select_scored_blocks(scores, pos, block_ids, tok0: int, topk: int, sink_blocks: int, local_blocks: int,
                         tokens: int, blocks_per_step: int = BLOCKS_PER_STEP, *, num_warps: int | None = None) -> None:
    """The selection rule over ``scores [Hi, n, S]`` of the tokens with positions ``pos [n]``, written to
    ``block_ids [Hi, T, topk]`` from column ``tok0``; ``tokens`` per program, ``blocks_per_step`` blocks
    merged into the running top-k at a time; ``num_warps`` overrides :func:`_select_warps`."""
    heads, n, cols = scores.shape
    if not (scores.is_contiguous() and block_ids.is_contiguous()):
        raise ValueError("select_scored_blocks: scores and block_ids must be contiguous")
    _select_scored_kernel[(triton.cdiv(n, tokens), heads)](
        scores, pos, block_ids, n, cols, tok0, block_ids.shape[1], sink_blocks, local_blocks,
        TOPK=topk, KPAD=triton.next_power_of_2(topk), TOKENS=tokens, BLOCKS=blocks_per_step,
        num_warps=num_warps or _select_warps(tokens),
    )


def _select_in_chunks(score_chunk, heads: int, block_table, req, pos, topk: int, sink_blocks: int,
                      local_blocks: int, tokens: int, score_bytes: int, decode_blocks_per_step: int,
                      runs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """int32 ``block_ids [heads, T, topk]``: per chunk of tokens (:func:`learned_score_chunks`), the block
    scores of ``score_chunk(part, scores)`` (fills fp32 ``scores [heads, n, S]`` for tokens ``part``), then the
    selection; a decode-like batch (``tokens == 1``: one token per program) merges
    ``decode_blocks_per_step`` blocks at a time: fewer, wider merges. With ``runs`` (``(run, run_pos)`` of
    :func:`sglang_nvfp4.indexer.rules.token_runs`) each chunk's scores are max-reduced into their runs' rows
    (fp32 ``[heads, runs, S]``, next to the chunk's), the rule selects once per run, and each token takes its
    run's row."""
    t, cols = pos.shape[0], block_table.shape[1]
    block_ids = torch.empty(heads, t, topk, dtype=torch.int32, device=pos.device)
    select_tokens, step = (1, decode_blocks_per_step) if tokens == 1 else (SCORED_SELECT_TOKENS, SCORED_SELECT_STEP)
    if runs is not None:
        run, run_pos = runs
        # Blocks past a run's own block hold whatever its tokens' rows held there (the score kernels store nothing
        # past a token's own block): the rule never reads them.
        run_scores = torch.full((heads, run_pos.shape[0], cols), float("-inf"), device=pos.device)
    for c0, n in learned_score_chunks(t, heads, cols, tokens, score_bytes):
        scores = torch.empty(heads, n, cols, dtype=torch.float32, device=pos.device)
        part = slice(c0, c0 + n)
        score_chunk(part, scores)
        if runs is None:
            select_scored_blocks(scores, pos[part], block_ids, c0, topk, sink_blocks, local_blocks, select_tokens,
                                 step)
        else:
            max_into_runs(run_scores, run[part], scores)
    if runs is not None:
        run_ids = torch.empty(heads, run_pos.shape[0], topk, dtype=torch.int32, device=pos.device)
        select_scored_blocks(run_scores, run_pos, run_ids, 0, topk, sink_blocks, local_blocks, select_tokens, step)
        torch.index_select(run_ids, 1, run, out=block_ids)
    return block_ids


def select_learned_blocks(idx_q: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
                          pos: torch.Tensor, topk: int, sink_blocks: int, local_blocks: int, *,
                          key_exponents: torch.Tensor | None = None, score_bytes: int = LEARNED_SCORE_BYTES,
                          decode_blocks_per_step: int = LEARNED_DECODE_STEP) -> torch.Tensor:
    """Triton path of :func:`sglang_nvfp4.indexer.select_blocks_learned` (arguments checked there):
    int32 ``block_ids [Hi, T, topk]``.

    ``idx_q``: ``[T, Hi, D]``, cast to the keys' dtype (fp8 keys: kept bf16/fp16); ``keys``: bf16/fp16, or fp8
    with ``key_exponents`` uint8 ``[slots]`` (:class:`sglang_nvfp4.indexer.IndexKeys`), ``[slots, D]`` (row =
    cache slot); ``block_table`` int32 ``[R, S]``, ``req``, ``pos`` int32 ``[T]``. Block scores, then the
    selection, per chunk of tokens (:func:`_select_in_chunks`)."""
    t, heads, _ = idx_q.shape
    if key_exponents is None:
        idx_q = idx_q.to(keys.dtype)
    idx_q = idx_q.contiguous()
    req, pos = req.contiguous(), pos.contiguous()
    tokens, blocks, stages = learned_launch(t, block_table.shape[0], heads)

    def score_chunk(part, scores):
        learned_block_scores(idx_q[part], keys, block_table, req[part], pos[part], scores, tokens, blocks,
                             key_exponents=key_exponents, num_stages=stages)

    return _select_in_chunks(score_chunk, heads, block_table, req, pos, topk, sink_blocks, local_blocks, tokens,
                             score_bytes, decode_blocks_per_step)


def select_proxy_blocks(queries: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
                        pos: torch.Tensor, topk: int, sink_blocks: int, local_blocks: int, *, groups: int = 1,
                        fp8: bool = False, prefill_rows: int = PROXY_PREFILL_ROWS,
                        score_bytes: int = LEARNED_SCORE_BYTES,
                        decode_blocks_per_step: int = LEARNED_DECODE_STEP,
                        runs: tuple[torch.Tensor, torch.Tensor] | None = None,
                        query_rows: torch.Tensor | None = None,
                        key_tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Triton path of :func:`sglang_nvfp4.indexer.select_blocks_proxy` (arguments checked there): int32
    ``block_ids [Hkv, T, topk]`` for the ``T`` tokens of ``req``, ``pos``. ``queries``: aggregated queries
    ``[T, Hkv * groups, 128]`` (``groups`` per KV head; fp16, or bf16 / fp32 that the score kernels round to fp16 as
    they load them, so a caller passes the layer's queries as they are; unit stride in the last dim), or with
    ``query_rows`` (int32 ``[T]``) token ``i``'s at row ``query_rows[i]``; ``cache`` the NVFP4 cache. As
    :func:`select_learned_blocks`, with one KV head per score program (prefill tiles of ``prefill_rows`` (token,
    group) rows); a block's score is the max over the KV head's groups, taken in the score kernel; ``fp8``: the
    products on E4M3-rounded queries and keys. fp8 prefill scores on Hopper run the warp-specialized Gluon kernel
    (:mod:`.gluon_proxy`) where it serves the call. ``runs``: select once per run of tokens
    (:func:`_select_in_chunks`). ``key_tiles``: the forward's predecoded E4M3 key tiles over ``block_table``
    (:mod:`.triton_predecode`), which the Gluon scores copy instead of decoding pages (the same scores; the Triton
    kernel ignores them)."""
    t = pos.shape[0]
    hkv = cache.shape[1] // 2
    check_query_rows(queries, hkv * groups, t, query_rows, "select_proxy_blocks")
    req, pos = req.contiguous(), pos.contiguous()
    tokens, blocks = learned_tiling(t, block_table.shape[0], groups, prefill_rows)
    gluon_scores = _gluon_proxy_scores(queries.device, t, block_table.shape[0], groups) if fp8 else None

    def score_chunk(part, scores):
        # A chunk's queries: a view of its rows, or the chunk's row indices into all of them.
        chunk_queries, chunk_rows = (queries[part], None) if query_rows is None else (queries, query_rows[part])
        if gluon_scores is not None:
            gluon_scores(chunk_queries, cache, block_table, req[part], pos[part], scores, groups,
                         query_rows=chunk_rows, key_tiles=key_tiles)
        else:
            proxy_block_scores(chunk_queries, cache, block_table, req[part], pos[part], scores, tokens, blocks,
                               groups, fp8, query_rows=chunk_rows)

    return _select_in_chunks(score_chunk, hkv, block_table, req, pos, topk, sink_blocks, local_blocks, tokens,
                             score_bytes, decode_blocks_per_step, runs)


def _gluon_proxy_scores(device: torch.device, num_tokens: int, num_rows: int, groups: int):
    """:func:`.gluon_proxy.block_scores` when it serves these fp8 scores (:func:`.gluon_proxy.supports`), else
    ``None`` (no Gluon in this Triton, another device, a decode-like batch)."""
    from . import gluon_unavailable

    if device.type != "cuda" or gluon_unavailable():
        return None
    from . import gluon_proxy  # an import error here is a bug: raised, not taken for "no Gluon"

    return gluon_proxy.block_scores if gluon_proxy.supports(device, num_tokens, num_rows, groups) else None


# ---- fp8 index keys (the learned indexer, NVFP4_SPARSE_INDEX_KEYS=fp8) -----------------------------------
FP8_WRITE_ROWS = 16  # keys per program of the fp8 index-key write


@triton.jit
def _write_fp8_index_keys_kernel(idx_k_ptr, slots_ptr, codes_ptr, exponents_ptr, num_keys,
                                 D: tl.constexpr, ROWS: tl.constexpr):
    """Program (``ROWS`` keys): each key's E8M0 exponent byte ``e`` (:func:`_row_exponents`), then E4M3 codes of
    ``k * 2**(127 - e)`` (exact products, round to nearest even), stored at the key's slot."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = row < num_keys
    dims = tl.arange(0, D)
    k = tl.load(idx_k_ptr + row.to(tl.int64)[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
    k = k.to(tl.float32)
    exponent = _row_exponents(k)
    slot = tl.load(slots_ptr + row, mask=ok, other=0).to(tl.int64)
    codes = to_e4m3(k * _power_of_two(254 - exponent)[:, None])
    tl.store(codes_ptr + slot[:, None] * D + dims[None, :], codes, mask=ok[:, None])
    tl.store(exponents_ptr + slot, exponent.to(tl.uint8), mask=ok)


def write_fp8_index_keys(codes: torch.Tensor, exponents: torch.Tensor, slots: torch.Tensor,
                         idx_k: torch.Tensor) -> None:
    """Quantize ``idx_k [N, D]`` (bf16/fp16/fp32, contiguous) into fp8 index keys: E4M3 ``codes [slots, D]`` and
    uint8 ``exponents [slots]`` at ``slots [N]`` (int32/int64), as
    :func:`sglang_nvfp4.indexer.fp8.quantize_rows` does (no host sync: CUDA-graph safe)."""
    n, d = idx_k.shape
    if n:
        _write_fp8_index_keys_kernel[(triton.cdiv(n, FP8_WRITE_ROWS),)](
            idx_k, slots, codes, exponents, n, D=d, ROWS=FP8_WRITE_ROWS, num_warps=4)
