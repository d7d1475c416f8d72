"""Warp-specialized fp8 block scores of the proxy indexer for Hopper (sm_90), in Gluon; the same scores as
:func:`.triton_indexer.proxy_block_scores` with ``fp8=True`` (entry point :func:`block_scores`).

Why a second score kernel. In the Triton kernel one warpgroup loads a key page, decodes it to E4M3, runs the
16 fp8 wgmma of a 256-row tile and reduces the block maxima, in turn: its 255 registers cannot hold the four
64-row accumulators at once, so ptxas waits for each wgmma before the next (sm_90 SASS of Triton 3.6: 16
``WARPGROUP.DEPBAR`` for 16 ``QGMMA``), and the tensor cores idle while the warps decode and reduce. At the
default (top-16 proxy over every query head) that selection costs 13.2 ms per layer at 32K (64/4 heads) on the
H200, as much as the attention. Here one program (CTA) serves a tile of ``2 * SUBTILES * TOKENS`` consecutive
tokens x the query groups of one KV head (1,024 rows at the default 4 subtiles) over up to
:func:`blocks_per_program` blocks, in three partitions of one warpgroup each:

* **producer**: for each block the tile's tokens can see, loads the KV head's key page, decodes it (E2M1 times
  its E4M3 scale times ``FP8_KEY_SCALE``, exact in fp16, by :mod:`.gluon_common`'s decoders) and rounds it to
  E4M3 into a ring of ``STAGES`` shared-memory slots, then signals ``ready``;
* **two consumers** (the default partition and one worker): each owns ``SUBTILES`` subtiles of ``TOKENS`` tokens (128
  rows each: ``HP`` per token, its query groups padded to a power of two) and rounds their query rows to E4M3
  once (a power of two per row). Per slot, subtile by subtile (one 128 x 128 fp32 accumulator fits the
  registers), it runs ``S = Q.K^T`` on the fp8 tensor cores, takes each row's max over the block's keys, scales
  it back, keeps the max over each token's groups and stores it for the tokens that can see the block.

Scores are those of the Triton kernel: the same E4M3 operands, fp32 accumulation (in the tensor cores' order,
so they differ by the accumulation's rounding), a row's own block scored over all its keys (the rule forces that
block, so its score is never read), nothing stored past a token's own block. A tile whose tokens belong to
several requests is served token by token, as in the Triton kernel.

Why several subtiles per consumer. With one (256 rows per decoded page) the kernel gave the Triton kernel's
scores bit for bit and was only 6.5% faster (11.2 against 12.0 ms at 32K, 64/4, H100,
``bench/results/kernels_v2_h100.md``), not the 2x its instruction counts allowed: the producer, one warp per
scheduler decoding each page (455 instructions per thread), set the pace, about 2,800 cycles per page against the
tensor cores' 1,100 for 256 rows. Two subtiles per consumer halve the decoding per row: 8.7 ms against the Triton
kernel's 12.1 at 32K (0.72x; one subtile: 11.3), the same scores bit for bit (H200,
``bench/results/proxy_scores_h200.md``). Four subtiles halve it again: 7.9 against 8.3 ms at 32K and 3.5 against
3.6 for an 8K chunk (H100, same bits), though their query tiles take 181 KB of shared memory and each thread spills
136 bytes (sm_90, Triton 3.6; ``bench/gluon_resources.py``). With 1-4 groups per KV head the tiles hold 4x-16x the
tokens and their bookkeeping spills more; those settings are checked on the GPU but were not timed. A tile
spanning requests is scored token by token, each pass with all subtiles' products for one token: batches of many
short extends over long prefixes were not timed. A producer of 8 warps (each decoding half of every page) was
1.03x-1.22x slower (H100, ``bench/results/proxy_scores_h200.md``).

Scope (:func:`supports`): NVIDIA sm_90, prefill tiles (more tokens than requests), 1 to 16 query groups per KV
head; the caller keeps the Triton kernel otherwise. It runs only compiled: ``tests/test_gluon_proxy.py`` compiles it
for sm_90 on any host, ``tests/test_proxy_indexer.py`` checks its scores against float64 ones on a Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_common import decode_words, k_scale_operand, times_f16x2
from .gluon_prefill import _flat_tile, _load_k, k_layout
from .triton_common import BLOCK_WORDS, HEAD_DIM, PAGE
from .triton_indexer import FP8_KEY_SCALE, check_query_rows
from .triton_predecode import check_key_tiles

ROWS = gl.constexpr(128)  # (token, group) rows per subtile: two 64-row wgmma tiles of one warpgroup
STAGES = gl.constexpr(3)  # decoded key pages in flight between the producer and the consumers
# Blocks one program scores (grid axis 1, :func:`blocks_per_program`): each program converts its queries and fills
# and drains its ring once for that many pages, so the most that still fills the GPU.
MAX_BLOCKS_PER_PROGRAM, MIN_BLOCKS_PER_PROGRAM = 256, 16
PROGRAMS_PER_SM = 2  # the fewest programs per multiprocessor a launch aims for (one fits at a time)
# 128-row subtiles per consumer: a decoded page serves 2 * SUBTILES * 128 rows. 4 against 2 (H100, 2026-12-05,
# bench/results/proxy_scores_h200.md): 7.89 / 8.31 ms at 32K, 3.51 / 3.61 on an 8K chunk, the same scores; 4 takes
# 64 KB more shared memory (181 KB) and spills at 168 registers: 136 bytes of stack per thread with the GPU host's
# Triton 3.6, 344 with 3.8 (bench/gluon_resources.py; 2 subtiles: none).
SUBTILES = 4
MAX_REGS = 168
PRODUCER_REGS = gl.constexpr(120)
KEY_TILE_PRODUCER_REGS = gl.constexpr(48)  # with predecoded key tiles the producer only issues copies
CONSUMER_REGS = gl.constexpr(192)
# The ring's key slots (128 x 128 E4M3, 128-byte swizzle), in which the key-tile mode's TMA copies land too.
KEY_TILE_LAYOUT = gl.NVMMASharedLayout.get_default_for([PAGE.value, HEAD_DIM.value], gl.float8e4nv)
# FP8_KEY_SCALE as fp16 bits in both halves of a word: the operand that scales each key scale.
_KEY_FACTOR_F16X2 = gl.constexpr(
    int(torch.tensor(FP8_KEY_SCALE.value, dtype=torch.float16).view(torch.int16).item()) * 0x10001)


def supports(device: torch.device, num_tokens: int, num_rows: int, groups: int) -> bool:
    """Whether this kernel scores a call: an sm_90 GPU with Gluon where the kernels resolve to ``gluon`` (not
    ``NVFP4_SPARSE_KERNEL=triton``), a prefill-like batch (more tokens than requests) and at most 16 query groups
    per KV head (128 rows hold a whole token)."""
    if num_tokens <= num_rows or not 1 <= groups <= 16:
        return False
    from . import _gluon_serves, resolve_implementation

    return resolve_implementation(device) == "gluon" and _gluon_serves(device)


def blocks_per_program(num_tiles: int, num_cols: int, kv_heads: int, multiprocessors: int) -> int:
    """Blocks per program for a grid of ``num_tiles`` tiles x ``kv_heads`` over a block table ``num_cols`` wide:
    ``MAX_BLOCKS_PER_PROGRAM`` (a whole row up to 32K tokens: 11.2 ms at 32K against 12.3 with 32 and 16.1 with 8
    with one subtile per consumer, H100; 8.7 against 9.0 with 64 with two, H200), halved while the grid would hold
    fewer than ``PROGRAMS_PER_SM`` programs per multiprocessor (a short extend over a long prefix), down to
    ``MIN_BLOCKS_PER_PROGRAM``. Powers of two: at most 5 compiled variants."""
    blocks = MAX_BLOCKS_PER_PROGRAM
    while (blocks > MIN_BLOCKS_PER_PROGRAM
           and num_tiles * kv_heads * triton.cdiv(num_cols, blocks) < PROGRAMS_PER_SM * multiprocessors):
        blocks //= 2
    return blocks


def tokens_per_subtile(groups: int) -> int:
    """Tokens per subtile (128 rows) for ``groups`` query groups per KV head."""
    return ROWS.value // triton.next_power_of_2(groups)


def tokens_per_tile(groups: int, subtiles: int) -> int:
    """Tokens per program (two consumers of ``subtiles`` subtiles) for ``groups`` query groups per KV head."""
    return 2 * subtiles * tokens_per_subtile(groups)


@gluon.jit
def _decode_fp8_k(codes, scales, factor):
    """:func:`.gluon_prefill._load_k`'s page -> E4M3 ``[128 keys, 128 dims]`` of the values / TILE_SCALE times
    ``FP8_KEY_SCALE`` (at most 336: no saturation), round to nearest even."""
    # Each key scale times FP8_KEY_SCALE (a power of two: the products stay exact), once for its group's words.
    scale = gl.expand_dims(times_f16x2(k_scale_operand(scales.to(gl.uint32)), factor), 2)
    return _flat_tile(decode_words(codes, (scale, scale, scale, scale))).to(gl.float8e4nv)


@gluon.jit
def _tile_passes(req_ptr, pos_ptr, tile, T, TILE_T: gl.constexpr, layout: gl.constexpr):
    """The tile's tokens (int32 ``[TILE_T]`` in ``layout``), whether they are live (``< T``), their requests and
    positions, and the number of passes: 1 when every live token belongs to one request, else one per token."""
    token = tile * TILE_T + gl.arange(0, TILE_T, layout=layout)
    live = token < T
    req = gl.load(req_ptr + token, mask=live, other=0)
    pos = gl.load(pos_ptr + token, mask=live, other=0)
    one_request = gl.max(gl.where(live, req, -1), axis=0) == gl.min(gl.where(live, req, 2147483647), axis=0)
    passes = gl.where(one_request, 1, gl.minimum(TILE_T, T - tile * TILE_T))
    return token, live, req, pos, one_request, passes


@gluon.jit
def _pass_bounds(p, live, req, pos, one_request, first, BLOCKS: gl.constexpr, TILE_T: gl.constexpr,
                 layout: gl.constexpr):
    """Pass ``p`` (all live tokens, or token ``p``): its request (int64) and the end of this program's blocks
    ``first .. end - 1`` that some token of the pass can see."""
    active = live & (one_request | (gl.arange(0, TILE_T, layout=layout) == p))
    r = gl.max(gl.where(active, req, -1), axis=0).to(gl.int64)
    num_blocks = gl.max(gl.where(active, pos // PAGE, -1), axis=0) + 1
    return r, gl.minimum(first + BLOCKS, num_blocks)


@gluon.jit
def _program_item(num_cols, HKV: gl.constexpr, BLOCKS: gl.constexpr):
    """``(tile, first block, KV head)`` of this program. Program ids run over the KV heads first, then the chunks of
    ``BLOCKS`` blocks, then the tiles, from the last tile (the most visible blocks) to the first: the hardware starts
    programs in id order, so the longest start first, every KV head's together, and the last wave holds the shortest.
    That matters on grids of few waves, e.g. 512 programs for a 32K prefill scored once per run of 8 tokens."""
    chunks = gl.cdiv(num_cols, BLOCKS)
    num_tiles = gl.num_programs(0) // (chunks * HKV)
    pid = gl.program_id(0)
    rest = pid // HKV
    return num_tiles - 1 - rest // chunks, (rest % chunks) * BLOCKS, pid % HKV


@gluon.jit
def _producer(item, ptrs, bufs, sizes, HKV: gl.constexpr, TILE_T: gl.constexpr, BLOCKS: gl.constexpr):
    """Decodes the key page of every block the tile's passes visit into the ring (one warpgroup).

    Each page's loads are issued right after the previous page's hand-off, so they land while the producer waits
    for a free slot (a fence before a hand-off waits for every load the thread has in flight, so loads issued
    before it would stall it)."""
    cache_ptr, block_table_ptr, req_ptr, pos_ptr = ptrs
    k_bufs, ready, empty = bufs
    T, stride_br, stride_bs = sizes
    tile, first, kv_head = item
    WARPS: gl.constexpr = gl.num_warps()
    token_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    token, live, req, pos, one_request, passes = _tile_passes(req_ptr, pos_ptr, tile, T, TILE_T, token_layout)
    # No pass when the tile sees none of these blocks (the consumers skip them too).
    passes = gl.where(first < gl.max(gl.where(live, pos // PAGE, -1), axis=0) + 1, passes, 0)
    scale_layout: gl.constexpr = gl.SliceLayout(2, k_layout(WARPS))
    factor = gl.full([PAGE, 8], _KEY_FACTOR_F16X2, gl.uint32, scale_layout)
    page_words = 2 * HKV * BLOCK_WORDS
    u = 0
    for p in range(passes):
        r, end = _pass_bounds(p, live, req, pos, one_request, first, BLOCKS, TILE_T, token_layout)
        row = block_table_ptr + r * stride_br
        # Past the pass's last block these read page 0 (in bounds) and decode nothing.
        page = gl.load(row + first * stride_bs, mask=first < end, other=0).to(gl.int64)
        codes, scales = _load_k(cache_ptr, page * page_words + kv_head * BLOCK_WORDS, WARPS)
        for b in range(first, end):
            stage = u % STAGES
            phase = (u // STAGES) & 1
            mbarrier.wait(empty.index(stage), phase ^ 1)  # both consumers are done with this slot
            k_bufs.index(stage).store(_decode_fp8_k(codes, scales, factor))
            fence_async_shared()  # order the generic-proxy stores before the consumers' wgmma reads
            mbarrier.arrive(ready.index(stage), count=1)
            page = gl.load(row + (b + 1) * stride_bs, mask=b + 1 < end, other=0).to(gl.int64)
            codes, scales = _load_k(cache_ptr, page * page_words + kv_head * BLOCK_WORDS, WARPS)
            u += 1


@gluon.jit
def _key_tile_producer(keys_desc, item, ptrs, bufs, sizes, HKV: gl.constexpr, TILE_T: gl.constexpr,
                       BLOCKS: gl.constexpr):
    """With predecoded key tiles (:mod:`.triton_predecode`, slot ``r * S + b`` for block ``b`` of request ``r``):
    copies each block's E4M3 key tile into the ring with the TMA instead of decoding its page (the same values as
    :func:`_producer`'s)."""
    req_ptr, pos_ptr = ptrs
    k_bufs, ready, empty = bufs
    T, num_cols = sizes
    tile, first, kv_head = item
    WARPS: gl.constexpr = gl.num_warps()
    token_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    token, live, req, pos, one_request, passes = _tile_passes(req_ptr, pos_ptr, tile, T, TILE_T, token_layout)
    passes = gl.where(first < gl.max(gl.where(live, pos // PAGE, -1), axis=0) + 1, passes, 0)
    u = 0
    for p in range(passes):
        r, end = _pass_bounds(p, live, req, pos, one_request, first, BLOCKS, TILE_T, token_layout)
        for b in range(first, end):
            stage = u % STAGES
            phase = (u // STAGES) & 1
            row = ((r.to(gl.int32) * num_cols + b) * HKV + kv_head) * PAGE  # the slot's rows for this KV head
            mbarrier.wait(empty.index(stage), phase ^ 1)  # both consumers are done with this slot
            mbarrier.expect(ready.index(stage), PAGE * HEAD_DIM)
            tma.async_copy_global_to_shared(keys_desc, [row, 0], ready.index(stage), k_bufs.index(stage))
            u += 1


@gluon.jit
def _subtile_queries(q_smem, queries, token0, T, kv_head, HEADS: gl.constexpr, HP: gl.constexpr,
                     QUERY_ROWS: gl.constexpr, rows_layout: gl.constexpr):
    """Rounds the query rows of the ``ROWS // HP`` tokens from ``token0`` to E4M3 into ``q_smem``, after a power
    of two per row that takes the row's largest magnitude into [128, 256) (the rule of
    indexer.proxy.round_queries_fp8). ``queries``: ``(pointer, query_rows pointer, token stride, head stride)`` as
    :func:`block_scores` takes them; the values are rounded to fp16 first (the proxy's queries). Returns, in
    ``rows_layout``, what turns a row's products back into the fp16 key tiles' units (as the Triton kernel's
    scores)."""
    queries_ptr, query_rows_ptr, stride_qt, stride_qh = queries
    q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    q_token = token0 + q_rows // HP
    q_live = (q_token < T) & (q_rows % HP < HEADS)
    q_token_row = q_token.to(gl.int64)
    if QUERY_ROWS:
        q_token_row = gl.load(query_rows_ptr + q_token, mask=q_live, other=0).to(gl.int64)
    q_offset = q_token_row * stride_qt + (kv_head * HEADS + q_rows % HP) * stride_qh
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(queries_ptr + q_offset[:, None] + dims[None, :], mask=q_live[:, None], other=0.0)
    q = q.to(gl.float16).to(gl.float32)
    largest = gl.max(gl.abs(q), axis=1)
    biased = (largest.to(gl.int32, bitcast=True) >> 23) & 0xFF
    exponent = gl.where(largest == 0, 119, gl.minimum(gl.maximum(biased - 7, 1), 254))
    q_smem.store((q * ((254 - exponent) << 23).to(gl.float32, bitcast=True)[:, None]).to(gl.float8e4nv))
    return gl.convert_layout((exponent << 23).to(gl.float32, bitcast=True) / FP8_KEY_SCALE, rows_layout)


@gluon.jit
def _own_blocks(pos_ptr, token0, T, TOKENS: gl.constexpr, lane_layout: gl.constexpr):
    """The own block of each of the ``TOKENS`` tokens from ``token0`` (one per lane group; 0 past ``T``)."""
    lane_token = token0 + gl.arange(0, TOKENS, layout=lane_layout)
    return gl.load(pos_ptr + lane_token, mask=lane_token < T, other=0) // PAGE


@gluon.jit
def _store_block_maxima(s, b, unscale, own, token0, scores_ptr, T, kv_head, num_cols, pass_token,
                        HEADS: gl.constexpr, HP: gl.constexpr, TOKENS: gl.constexpr, lane_layout: gl.constexpr):
    """Block ``b``'s score of the ``TOKENS`` tokens of a subtile from ``token0``: each row's max over the block's
    keys (``s``, fp32 ``[ROWS, 128]``), times its ``unscale`` (:func:`_subtile_queries`), then each token's max over
    its groups, stored for the tokens of the pass (``pass_token``: -1 for all) that can see the block (``own``:
    their own blocks, :func:`_own_blocks`). Token indices are recomputed here rather than kept in registers."""
    rows = gl.arange(0, ROWS, layout=unscale.type.layout)
    row_live = (token0 + rows // HP < T) & (rows % HP < HEADS)
    best = gl.where(row_live, gl.max(s, axis=1) * unscale, float("-inf"))
    best = gl.convert_layout(gl.max(gl.reshape(best, [TOKENS, HP]), axis=1), lane_layout)
    lane_token = token0 + gl.arange(0, TOKENS, layout=lane_layout)
    active = (lane_token < T) & ((pass_token < 0) | (lane_token == pass_token)) & (b <= own)
    gl.store(scores_ptr + (kv_head.to(gl.int64) * T + lane_token) * num_cols + b, best, mask=active)


@gluon.jit
def _consumer(half, item, ptrs, bufs, sizes, HEADS: gl.constexpr, HP: gl.constexpr, TOKENS: gl.constexpr,
              BLOCKS: gl.constexpr, SUBTILES: gl.constexpr, QUERY_ROWS: gl.constexpr):
    """Consumer ``half`` (0 or 1): tokens ``half * SUBTILES * TOKENS ..`` of the tile, as ``SUBTILES`` (2 or 4)
    subtiles of ``TOKENS`` tokens (``ROWS`` rows each), one warpgroup. The subtiles take the products of each key
    page in turn, so the producer decodes a page once for ``2 * SUBTILES * ROWS`` rows; one accumulator at a time
    fits the registers."""
    queries, scores_ptr, req_ptr, pos_ptr = ptrs
    q_smem, k_bufs, ready, empty = bufs
    T, num_cols = sizes
    tile, first, kv_head = item
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    token_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane_layout: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, HP], [32 // HP, HP], [4, 1], [1, 0]))

    tile_t: gl.constexpr = 2 * SUBTILES * TOKENS
    token, live, req, pos, one_request, passes = _tile_passes(req_ptr, pos_ptr, tile, T, tile_t, token_layout)
    if first < gl.max(gl.where(live, pos // PAGE, -1), axis=0) + 1:  # else the tile sees none of these blocks
        token0 = tile * tile_t + half * (SUBTILES * TOKENS)
        # Per subtile, its rows' unscale and its tokens' own blocks: tuples indexed by the unrolled subtile loop
        # below (only these stay in registers).
        unscales = (_subtile_queries(q_smem.index(0), queries, token0, T, kv_head, HEADS, HP, QUERY_ROWS,
                                     rows_layout),
                    _subtile_queries(q_smem.index(1), queries, token0 + TOKENS, T, kv_head, HEADS, HP,
                                     QUERY_ROWS, rows_layout))
        owns = (_own_blocks(pos_ptr, token0, T, TOKENS, lane_layout),
                _own_blocks(pos_ptr, token0 + TOKENS, T, TOKENS, lane_layout))
        if SUBTILES == 4:
            unscales = unscales + (
                _subtile_queries(q_smem.index(2), queries, token0 + 2 * TOKENS, T, kv_head, HEADS, HP,
                                 QUERY_ROWS, rows_layout),
                _subtile_queries(q_smem.index(3), queries, token0 + 3 * TOKENS, T, kv_head, HEADS, HP,
                                 QUERY_ROWS, rows_layout))
            owns = owns + (_own_blocks(pos_ptr, token0 + 2 * TOKENS, T, TOKENS, lane_layout),
                           _own_blocks(pos_ptr, token0 + 3 * TOKENS, T, TOKENS, lane_layout))
        fence_async_shared()

        s_init = gl.zeros([ROWS, PAGE], gl.float32, mma)
        u = 0
        for p in range(passes):
            _, end = _pass_bounds(p, live, req, pos, one_request, first, BLOCKS, tile_t, token_layout)
            pass_token = gl.where(one_request, -1, tile * tile_t + p)
            for b in range(first, end):
                stage = u % STAGES
                phase = (u // STAGES) & 1
                mbarrier.wait(ready.index(stage), phase)
                keys_t = k_bufs.index(stage).permute((1, 0))
                for sub in gl.static_range(SUBTILES):
                    s = warpgroup_mma(q_smem.index(sub), keys_t, s_init, use_acc=False)
                    if sub == SUBTILES - 1:  # the last read of the slot
                        mbarrier.arrive(empty.index(stage), count=1)
                    _store_block_maxima(s, b, unscales[sub], owns[sub], token0 + sub * TOKENS, scores_ptr, T, kv_head,
                                        num_cols, pass_token, HEADS, HP, TOKENS, lane_layout)
                u += 1


@gluon.jit
def _consumer_worker(item, ptrs, bufs, sizes, HEADS: gl.constexpr, HP: gl.constexpr, TOKENS: gl.constexpr,
                     BLOCKS: gl.constexpr, SUBTILES: gl.constexpr, QUERY_ROWS: gl.constexpr):
    """The second consumer, as a worker partition (the first is the default partition)."""
    _consumer(1, item, ptrs, bufs, sizes, HEADS, HP, TOKENS, BLOCKS, SUBTILES, QUERY_ROWS)


@gluon.jit
def _ws_proxy_scores_kernel(
    queries_ptr, query_rows_ptr, cache_ptr, block_table_ptr, req_ptr, pos_ptr, scores_ptr,  # see block_scores
    keys_desc,  # with predecoded key tiles: their TMA descriptor, [slots * Hkv * 128, 128] E4M3; else None
    T, num_cols, stride_qt, stride_qh, stride_br, stride_bs,
    HKV: gl.constexpr, HEADS: gl.constexpr, HP: gl.constexpr, TOKENS: gl.constexpr, BLOCKS: gl.constexpr,
    SUBTILES: gl.constexpr, QUERY_ROWS: gl.constexpr, KEY_TILES: gl.constexpr,
):
    item = _program_item(num_cols, HKV, BLOCKS)
    ring_layout: gl.constexpr = KEY_TILE_LAYOUT
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], gl.float8e4nv)
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, HEAD_DIM], ring_layout)
    q0_smem = gl.allocate_shared_memory(gl.float8e4nv, [SUBTILES, ROWS, HEAD_DIM], q_layout)  # a consumer's subtiles
    q1_smem = gl.allocate_shared_memory(gl.float8e4nv, [SUBTILES, ROWS, HEAD_DIM], q_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer

    consumer_ptrs = ((queries_ptr, query_rows_ptr, stride_qt, stride_qh), scores_ptr, req_ptr, pos_ptr)
    consumer_sizes = (T, num_cols)
    # (The partitions are listed in each call: a function cannot be a value in Gluon.)
    if KEY_TILES:
        gl.warp_specialize([
            (_consumer, (0, item, consumer_ptrs, (q0_smem, k_bufs, ready, empty), consumer_sizes, HEADS, HP, TOKENS,
                         BLOCKS, SUBTILES, QUERY_ROWS)),
            (_consumer_worker, (item, consumer_ptrs, (q1_smem, k_bufs, ready, empty), consumer_sizes, HEADS, HP,
                                TOKENS, BLOCKS, SUBTILES, QUERY_ROWS)),
            (_key_tile_producer, (keys_desc, item, (req_ptr, pos_ptr), (k_bufs, ready, empty), (T, num_cols), HKV,
                                  2 * SUBTILES * TOKENS, BLOCKS)),
        ], [4, 4], [CONSUMER_REGS, KEY_TILE_PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, item, consumer_ptrs, (q0_smem, k_bufs, ready, empty), consumer_sizes, HEADS, HP, TOKENS,
                         BLOCKS, SUBTILES, QUERY_ROWS)),
            (_consumer_worker, (item, consumer_ptrs, (q1_smem, k_bufs, ready, empty), consumer_sizes, HEADS, HP,
                                TOKENS, BLOCKS, SUBTILES, QUERY_ROWS)),
            (_producer, (item, (cache_ptr, block_table_ptr, req_ptr, pos_ptr), (k_bufs, ready, empty),
                         (T, stride_br, stride_bs), HKV, 2 * SUBTILES * TOKENS, BLOCKS)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def key_tiles_descriptor(key_tiles: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of predecoded E4M3 key tiles (``[slots, Hkv, 128, 128]``, :mod:`.triton_predecode`) as the
    producer copies them: one 128 x 128 tile per copy."""
    return TensorDescriptor.from_tensor(key_tiles.view(-1, HEAD_DIM.value), [PAGE.value, HEAD_DIM.value],
                                        KEY_TILE_LAYOUT)


def block_scores(queries, cache, block_table, req, pos, scores, groups: int, blocks: int | None = None,
                 subtiles: int | None = None, query_rows: torch.Tensor | None = None,
                 key_tiles: torch.Tensor | None = None) -> None:
    """:func:`.triton_indexer.proxy_block_scores` with ``fp8=True``, on this kernel (a chunk :func:`supports`), for
    the ``n`` tokens of ``req``, ``pos``: aggregated queries ``[n, Hkv * groups, 128]`` (fp16, or bf16 / fp32 rounded
    to fp16 as they load; unit stride in the last dim), or with ``query_rows`` (int32 ``[n]``) token ``i``'s at row
    ``query_rows[i]``, against the K of the NVFP4 ``cache``, block maxima over each KV head's groups into ``scores``
    fp32 ``[Hkv, n, S]`` (contiguous; visible blocks only); ``blocks``: blocks per program (default
    :func:`blocks_per_program`), ``subtiles``: 128-row subtiles per consumer, 2 or 4 (default ``SUBTILES``);
    benchmarks sweep both. ``key_tiles``: the forward's predecoded E4M3 key tiles over ``block_table``
    (:mod:`.triton_predecode`, holding this layer's pages), which the producer copies instead of decoding pages:
    the same scores."""
    n, hkv = pos.shape[0], cache.shape[1] // 2
    check_query_rows(queries, hkv * groups, n, query_rows, "gluon_proxy.block_scores")
    if not scores.is_contiguous():
        raise ValueError("gluon_proxy.block_scores: scores must be contiguous")
    subtiles = SUBTILES if subtiles is None else subtiles
    if subtiles not in (2, 4):
        raise ValueError(f"gluon_proxy.block_scores: subtiles: 2 or 4, got {subtiles!r}")
    tiles, cols = triton.cdiv(n, tokens_per_tile(groups, subtiles)), block_table.shape[1]
    if blocks is None:
        multiprocessors = torch.cuda.get_device_properties(queries.device).multi_processor_count
        blocks = blocks_per_program(tiles, cols, hkv, multiprocessors)
    if key_tiles is not None:
        check_key_tiles(key_tiles, block_table.numel(), hkv, "gluon_proxy.block_scores")
    _ws_proxy_scores_kernel[(tiles * triton.cdiv(cols, blocks) * hkv,)](
        queries, pos if query_rows is None else query_rows, cache, block_table, req, pos, scores,
        None if key_tiles is None else key_tiles_descriptor(key_tiles), n, cols,
        queries.stride(0), queries.stride(1), block_table.stride(0), block_table.stride(1),
        HKV=hkv, HEADS=groups, HP=triton.next_power_of_2(groups), TOKENS=tokens_per_subtile(groups),
        BLOCKS=blocks, SUBTILES=subtiles, QUERY_ROWS=query_rows is not None, KEY_TILES=key_tiles is not None,
        num_warps=4, maxnreg=MAX_REGS,
    )
