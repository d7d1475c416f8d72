"""Warp-specialized sparse prefill for Hopper (sm_90), in Gluon; same contract and plan as
:mod:`.triton_prefill` (contract: :mod:`sglang_nvfp4.reference`), entry point :func:`launch`.

Why a second prefill kernel. The Triton kernel decodes each page it visits in the warps that then run
the tensor-core products and the softmax, so decoding (CUDA cores) and wgmma (tensor cores) take turns
and the kernel is bound by issued instructions (``bench/results/kernels_h200.md``). Plain Triton 3.6
cannot split those roles between warps; Gluon (``triton.experimental.gluon``) can. One program (CTA)
serves a tile of ``2 * TOKENS`` tokens x the query heads of one KV head, in three partitions. A tile's tokens are
consecutive, or with a token order (:func:`group_tokens`) tokens of a 64-token window whose selections overlap:

* **producer** (worker, ``PRODUCER_WARPS`` warps with few registers): for each entry of the tile's union (built by
  :func:`.triton_prefill.plan_tiles`: pages in ``(block, page)`` order with a member bitmask) it reads
  the page's K and V^T bytes (issued one half-page ahead of their use, so that they land while the previous
  half decodes), decodes them to fp16 (``e2m1 * e4m3`` in inline PTX, scales applied on packed halves, each
  scale converted once for all the words of the thread it scales) into a
  ring of ``STAGES`` shared-memory slots (16-byte stores free of bank conflicts), and signals ``k_ready`` /
  ``v_ready``;
* **two consumers** (the default partition and one worker): each owns ``TOKENS`` tokens (64 rows of
  ``GROUP_POW2`` heads) and, for every union entry that one of its tokens selected, runs
  ``S = Q.K^T`` on wgmma, the exp2 online softmax, and ``O += P.V`` on wgmma; entries none of its tokens
  selected are exact no-ops (``alpha = 1``, ``p = 0``), so it skips their products. Only pages that reach
  past a row's position take the per-key causal mask; the others mask whole rows. Both consumers arrive
  on the slot's ``empty`` barrier when done with it.

A page decoded once serves both consumers, while each runs products only for its own tokens, and the
warp scheduler overlaps one consumer's softmax with the other's wgmma and with the producer's decoding.

Numerics are the Triton kernel's, fp16 Q and tiles (``value / TILE_SCALE``, exact), fp32 scores and sums, the
same exp2 softmax step (:func:`.triton_common.fold_scores`: each exponent one fused multiply-add), ``P`` rounded to
fp16 before ``P.V``: the two kernels give the same bits (the benchmark's 32K problems on an H100,
``bench/results/kernels_v2_h100_1207.md``). Batch invariance
holds: a row's own pages are visited in ascending block order whoever shares its tile, and pages it did not select
change nothing. Keys no member token can see have their V scales zeroed by the producer (their
bytes may be E4M3 NaN codes) and their scores masked to ``-inf`` by the consumers.

Scope (:func:`supports`): NVIDIA sm_90, 8 to 64 query heads per KV head (``GROUP_POW2 * TOKENS = 64``
rows per consumer), unions planned over at most 256 slots (16 heads per KV head: up to 32 ids per token);
the dispatcher sends other shapes to the Triton kernel. It runs only compiled (Gluon has no interpreter); ``tests/test_gluon_prefill.py`` compiles
it for sm_90 on any host and checks it against the reference on a Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import triton_predecode, triton_prefill
from .gluon_common import SCALE_WORD, decode_words, k_scale_operand, live_token_masks, vt_scale_operands
from .triton_common import (  # layout constants (Gluon constexprs too), the decoder, softmax and scale helpers
    BLOCK_WORDS,
    CODE_WORDS,
    HEAD_DIM,
    LOG2E,
    NUM_GROUPS,
    PAGE,
    ROW_WORDS,
    SCALE_GROUP,
    SCALE_OFFSET,
    TILE_SCALE,
    V_SCALE_ROWS_PER_GROUP,
    fold_scores,
    global_scale,
)

ROWS = gl.constexpr(64)  # rows (tokens x query heads) per consumer: one warpgroup's wgmma M
STAGES = gl.constexpr(2)  # decoded pages in flight between the producer and the consumers (fused mode)
# The ring's K and V^T slots (128 x 128 fp16, 128-byte swizzle), in which the predecoded mode's TMA copies land too.
TILE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([PAGE.value, HEAD_DIM.value], gl.float16))
MAX_PLAN_WIDTH = 256  # union slots per tile (tile tokens x ids per token, padded): the widest run on a GPU so far
# Register plans per producer size (warps): (registers per thread at launch, consumer, producer). The CTA's
# (8 + producer warps) x 32 threads x the launch count fill the register file, one CTA per SM; the default
# partition (the first consumer) gets what the workers leave, the consumer count again. Built for sm_90, both keep
# the same 8 bytes of stack (bench/gluon_resources.py --kernel prefill); the consumers used at most 169 registers of
# their former 192 (bench/results/kernels_gluon_h200.md, 2026-12-04 evening).
REGISTER_PLANS = {4: (168, 192, 120), 8: (128, 168, 88)}
# The launch default (:func:`run`): 8 warps share each page's decoding, each with half the words of 4 warps.
# H200, T = 32K, top-16 (bench/results/kernels_gluon_h200.md, 2026-12-05): 0.956x the 4-warp kernel's time with
# per-token random selections (64/4 and 16/1), 0.977-0.980x with the indexer's, 0.99-0.999x shared by 8 tokens;
# same bits.
PRODUCER_WARPS = 8


def supports(heads: int, kv_heads: int, width: int) -> bool:
    """Whether this kernel serves a layer (on an sm_90 device, which the dispatcher checks): 8..64 query
    heads per KV head, and a tile's union planned over at most ``MAX_PLAN_WIDTH`` slots (16 query heads
    per KV head: up to 32 ids per token)."""
    group = heads // kv_heads
    return 8 <= group <= 64 and 2 * tokens_per_consumer(group) * triton.next_power_of_2(width) <= MAX_PLAN_WIDTH


def tokens_per_consumer(group: int) -> int:
    """Tokens per consumer (64 rows) for ``group`` query heads per KV head; a tile has twice as many."""
    return ROWS.value // triton.next_power_of_2(group)


# The producer's views of a page's code words. Decoded, a word is one 16-byte store into the ring's 128-byte
# swizzled rows (chunk position XOR row % 8). Both views give each thread 2 adjacent words of a row (one 8-byte load)
# and put the 4 word pairs of a row on lanes 0-3 and the next row (of the other parity) on lanes 4-7, so in each
# quarter warp row r's stores take chunk positions of one parity and row r ^ 1's the other: 8 distinct bank groups.
# (4 adjacent words per thread put two of a row's threads on one position: 2-way conflicts.)
#
# K, ``[128 rows, 8 scale groups, 2 words]``: a thread's 2 words are one scale group of one key (one scale byte),
# in 8 rows x 4 threads per warp, the warps along the rows, repeated along the rows and twice along the groups.
@gluon.constexpr_function
def k_layout(warps):
    assert warps in (4, 8), f"the producer views are laid out for 4 or 8 warps, not {warps}"
    return gl.BlockedLayout([1, 1, 2], [8, 4, 1], [warps, 1, 1], [2, 1, 0])


# V^T, ``[8 scale groups, 2, 4, 2, 16 token octets]`` for dim ``16 g + 8 i + 2 k + j``: a thread's 4 register rows
# (``k``) are 4 dims of one scale group, which share each token's scale, so a thread loads and converts the 8 scales
# of each of its 4 octets once for 4 dims (16 conversions per page instead of 64). Lanes: octet pairs (bits 0-1),
# ``j`` (bit 2), ``i`` (bit 3), ``g`` (bit 4, then 4 warps); 8 warps split the octets in two halves.
@gluon.constexpr_function
def vt_layout(warps):
    assert warps in (4, 8), f"the producer views are laid out for 4 or 8 warps, not {warps}"
    return gl.BlockedLayout([1, 1, 4, 1, 2], [2, 2, 1, 2, 4], [4, 1, 1, 1, warps // 4], [4, 3, 1, 0, 2])


# The V^T view with a last axis of 2: a token octet's two scale words, one 8-byte load per thread and octet.
@gluon.constexpr_function
def vt_pairs_layout(warps):
    assert warps in (4, 8), f"the producer views are laid out for 4 or 8 warps, not {warps}"
    return gl.BlockedLayout([1, 1, 4, 1, 2, 2], [2, 2, 1, 2, 4, 1], [4, 1, 1, 1, warps // 4, 1], [5, 4, 3, 1, 0, 2])


# Per-octet scales ``[8 groups, 16 octets]``, broadcast over the dims of a group (``i``, ``k``, ``j``).
@gluon.constexpr_function
def octets_of(layout):
    return gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))


@gluon.jit
def _flat_tile(decoded):
    """Decoded words (:func:`.gluon_common.decode_words` of a K or V^T view) -> fp16 ``[128, 128]`` in code order:
    both views flatten row-major to ``[128 rows, 16 words]``."""
    return gl.reshape(decoded, (PAGE, 8 * CODE_WORDS))


@gluon.jit
def _load_k(cache_ptr, k_block, WARPS: gl.constexpr):
    """K of one page and KV head, in :func:`k_layout` over ``WARPS`` warps: code words ``[128, 8, 2]`` and the scale
    byte of each ``[128, 8]`` (uint8, its slice 2)."""
    K_LAYOUT: gl.constexpr = k_layout(WARPS)
    groups: gl.constexpr = gl.SliceLayout(2, K_LAYOUT)
    row = gl.arange(0, PAGE, layout=gl.SliceLayout(1, groups))[:, None]
    group = gl.arange(0, NUM_GROUPS, layout=gl.SliceLayout(0, groups))[None, :]
    word = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, K_LAYOUT)))[None, None, :]
    codes = gl.load(cache_ptr.to(gl.pointer_type(gl.uint32)) + k_block + (row * ROW_WORDS + 2 * group)[:, :, None]
                    + word)
    # Words 2g and 2g + 1 hold dims 16g..16g+15: scale group g, byte SCALE_OFFSET + g of the row.
    scales = gl.load(cache_ptr + 4 * k_block + row * (4 * ROW_WORDS) + SCALE_OFFSET + group)
    return codes, scales


@gluon.jit
def _decode_k(codes, scales):
    """:func:`_load_k`'s page -> fp16 ``[128 keys, 128 dims]``, each scale converted once for its 2 words."""
    scale = gl.expand_dims(k_scale_operand(scales.to(gl.uint32)), 2)
    return _flat_tile(decode_words(codes, (scale, scale, scale, scale)))


@gluon.jit
def _load_vt(cache_ptr, v_block, WARPS: gl.constexpr):
    """V^T of one page and KV head: code words in :func:`vt_layout` over ``WARPS`` warps and each token octet's 8
    scales as two words ``[8 groups, 16 octets]`` (:func:`octets_of` that layout)."""
    VT_LAYOUT: gl.constexpr = vt_layout(WARPS)
    VT_OCTETS: gl.constexpr = octets_of(VT_LAYOUT)
    VT_OCTET_PAIRS: gl.constexpr = octets_of(vt_pairs_layout(WARPS))
    words_ptr = cache_ptr.to(gl.pointer_type(gl.uint32)) + v_block
    l4: gl.constexpr = gl.SliceLayout(4, VT_LAYOUT)
    g = gl.arange(0, NUM_GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
    g = g[:, None, None, None]
    i = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, l4))))[None, :, None, None]
    k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, l4))))[None, None, :, None]
    j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, l4))))[None, None, None, :]
    octet = gl.arange(0, CODE_WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
        3, VT_LAYOUT)))))[None, None, None, None, :]
    dim = SCALE_GROUP * g + 8 * i + 2 * k + j
    codes = gl.load(words_ptr + (dim * ROW_WORDS)[:, :, :, :, None] + octet)
    # The scales of tokens 8w..8w+7 in group g sit in bytes 64..71 of row V_SCALE_ROWS_PER_GROUP * g + w.
    pair_g = gl.arange(0, NUM_GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, VT_OCTET_PAIRS)))[:, None, None]
    pair_octet = gl.arange(0, CODE_WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, VT_OCTET_PAIRS)))[None, :, None]
    half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, VT_OCTET_PAIRS)))[None, None, :]
    scale_row = pair_g * V_SCALE_ROWS_PER_GROUP + pair_octet
    lo, hi = gl.split(gl.load(words_ptr + scale_row * ROW_WORDS + SCALE_WORD + half))
    return codes, gl.convert_layout(lo, VT_OCTETS), gl.convert_layout(hi, VT_OCTETS)


@gluon.jit
def _decode_vt(codes, lo, hi, live_keys):
    """:func:`_load_vt`'s page -> fp16 ``[128 dims, 128 tokens]``, each octet's scales converted once for the
    thread's 4 dims of a group; the scales of tokens at or past ``live_keys`` are zeroed first (a page behind
    every reader, the common case, skips the masks)."""
    if live_keys < PAGE:
        octet = gl.arange(0, CODE_WORDS, layout=gl.SliceLayout(0, lo.type.layout))[None, :]
        lo_mask, hi_mask = live_token_masks(octet, live_keys)
        lo = lo & lo_mask
        hi = hi & hi_mask
    s0, s1, s2, s3 = vt_scale_operands(lo, hi)
    scales = (s0[:, None, None, None, :], s1[:, None, None, None, :], s2[:, None, None, None, :],
              s3[:, None, None, None, :])
    return _flat_tile(decode_words(codes, scales))


# The producer's copy of its tile's union plan: one int32 buffer ``[WIDTH, 1]`` per field (page, block, member mask),
# written whole once and read one entry (``index``) at a time.
PLAN_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _stage_plan(plan_ptrs, plan, union_len, plan_smem, WIDTH: gl.constexpr, WARPS: gl.constexpr):
    """Copies the tile's union plan (``plan_ptrs``: page, block and member-mask arrays; zeros past ``union_len``)
    into ``plan_smem`` (:data:`PLAN_LAYOUT`), which :func:`_plan_entry` reads. Read from global memory one entry at a
    time, the page number's load sat right before the page's own loads, and the member mask's before the next
    entry's first instruction: two exposed latencies per page (``bench/results/kernels_v2_h200.md``, profile)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    u = gl.arange(0, WIDTH, layout=layout)
    valid = u < union_len
    for field in gl.static_range(3):
        plan_smem[field]._reinterpret(gl.int32, [WIDTH], PLAN_LAYOUT).store(
            gl.load(plan_ptrs[field] + plan + u, mask=valid, other=0))


@gluon.jit
def _plan_entry(plan_smem, u, WIDTH: gl.constexpr, WARPS: gl.constexpr):
    """Entry ``u`` of the tile's staged union plan (:func:`_stage_plan`): ``(page (int64), block, members)``; past
    the last entry, page 0, block 0 and no members (for ``u = WIDTH``, the last slot's entry: only the prefetch past
    the last entry asks, and nothing decodes it)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    at = gl.minimum(u, WIDTH - 1)
    page = gl.max(plan_smem[0].index(at).load(one), axis=0).to(gl.int64)
    block = gl.max(plan_smem[1].index(at).load(one), axis=0)
    members = gl.max(plan_smem[2].index(at).load(one), axis=0)
    return page, block, members


@gluon.jit
def _live_keys(members, block, tile_token, tile_pos):
    """How many leading keys of ``block``'s page some member token can see; the producer zeroes the V scales of
    the keys past them."""
    member = ((members >> tile_token) & 1) != 0
    return gl.max(gl.where(member, tile_pos, -1), axis=0) - block * PAGE + 1


@gluon.jit
def _tile_tokens(order_ptr, kv_head, tile, tile_token, num_tiles, TILE_T: gl.constexpr, ORDERED: gl.constexpr):
    """The tokens at places ``tile_token`` of ``tile``: consecutive, or with ``ORDERED`` those of the token order
    (:func:`.triton_prefill.group_tokens`, ``[Hkv, num_tiles * TILE_T]``; ``T`` at a place without a token)."""
    place = tile * TILE_T + tile_token
    if ORDERED:
        return gl.load(order_ptr + kv_head.to(gl.int64) * num_tiles * TILE_T + place)
    return place


@gluon.jit
def _producer(ptrs, bufs, sizes, HKV: gl.constexpr, TILE_T: gl.constexpr, WIDTH: gl.constexpr,
              ORDERED: gl.constexpr):
    """Decodes the K and V^T tiles of every union page into the ring (its warps share each page's words).

    The loads run one step ahead of the decoding: a fence (``fence_async_shared``, before each hand-off) waits
    for every load the thread has in flight, so each load is issued right after a hand-off and lands while the
    other half of the page decodes: the next entry and its K while this page's V^T decodes, the next V^T while
    the next K decodes. The entries themselves come from a copy of the tile's plan in shared memory
    (:func:`_stage_plan`), so no page's loads wait for its page number to arrive from global memory."""
    cache_ptr, pos_ptr, order_ptr, plan_len_ptr, plan_page_ptr, plan_block_ptr, plan_members_ptr = ptrs
    k_bufs, v_bufs, k_ready, v_ready, empty, plan_smem = bufs
    T, num_tiles = sizes
    tile = num_tiles - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    WARPS: gl.constexpr = gl.num_warps()
    token_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    tile_token = gl.arange(0, TILE_T, layout=token_layout)
    token = _tile_tokens(order_ptr, kv_head, tile, tile_token, num_tiles, TILE_T, ORDERED)
    tile_pos = gl.load(pos_ptr + token, mask=token < T, other=-1)
    plan = (kv_head * num_tiles + tile).to(gl.int64) * WIDTH
    union_len = gl.load(plan_len_ptr + kv_head * num_tiles + tile)
    page_words = 2 * HKV * BLOCK_WORDS  # one page, in 4-byte words
    k_offset = kv_head * BLOCK_WORDS
    v_offset = (HKV + kv_head) * BLOCK_WORDS

    _stage_plan((plan_page_ptr, plan_block_ptr, plan_members_ptr), plan, union_len, plan_smem, WIDTH, WARPS)
    page, block, members = _plan_entry(plan_smem, 0, WIDTH, WARPS)
    k_codes, k_scales = _load_k(cache_ptr, page * page_words + k_offset, WARPS)
    v_codes, v_lo, v_hi = _load_vt(cache_ptr, page * page_words + v_offset, WARPS)
    stages: gl.constexpr = k_bufs.shape[0]
    for u in range(union_len):
        stage = u % stages
        phase = (u // stages) & 1
        live_keys = _live_keys(members, block, tile_token, tile_pos)
        mbarrier.wait(empty.index(stage), phase ^ 1)  # both consumers are done with this slot
        k_bufs.index(stage).store(_decode_k(k_codes, k_scales))
        fence_async_shared()  # order the generic-proxy stores before the consumers' wgmma reads
        mbarrier.arrive(k_ready.index(stage), count=1)
        # Past the last entry these read page 0 (in bounds) and decode nothing.
        page, block, members = _plan_entry(plan_smem, u + 1, WIDTH, WARPS)
        k_codes, k_scales = _load_k(cache_ptr, page * page_words + k_offset, WARPS)
        v_bufs.index(stage).store(_decode_vt(v_codes, v_lo, v_hi, live_keys))
        fence_async_shared()
        mbarrier.arrive(v_ready.index(stage), count=1)
        v_codes, v_lo, v_hi = _load_vt(cache_ptr, page * page_words + v_offset, WARPS)


@gluon.jit
def _tile_producer(tiles_desc, ptrs, bufs, sizes, HKV: gl.constexpr, WIDTH: gl.constexpr):
    """Predecoded mode: copies the K and V^T tiles of every union entry from the predecoded tiles
    (:mod:`.triton_predecode`; the plan's page field is the entry's tile slot) into the ring (``TILE_COPY_STAGES``
    slots) with the TMA, one thread issuing. The ring's slots take the decoded tiles' shared layout, so the
    consumers read the same values as from :func:`_producer`."""
    plan_len_ptr, plan_slot_ptr = ptrs
    k_bufs, v_bufs, k_ready, v_ready, empty = bufs
    T, num_tiles = sizes
    tile = num_tiles - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    plan = (kv_head * num_tiles + tile).to(gl.int64) * WIDTH
    union_len = gl.load(plan_len_ptr + kv_head * num_tiles + tile)
    tile_bytes: gl.constexpr = PAGE * HEAD_DIM * 2
    stages: gl.constexpr = k_bufs.shape[0]
    for u in range(union_len):
        stage = u % stages
        phase = (u // stages) & 1
        row = (gl.load(plan_slot_ptr + plan + u) * HKV + kv_head) * (2 * PAGE)  # the slot's K rows, then V^T's
        mbarrier.wait(empty.index(stage), phase ^ 1)  # both consumers are done with this slot
        mbarrier.expect(k_ready.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(tiles_desc, [row, 0], k_ready.index(stage), k_bufs.index(stage))
        mbarrier.expect(v_ready.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(tiles_desc, [row + PAGE, 0], v_ready.index(stage), v_bufs.index(stage))


@gluon.jit
def _consumer(half, ptrs, bufs, scalars, GROUP: gl.constexpr, GROUP_POW2: gl.constexpr, TOKENS: gl.constexpr,
              WIDTH: gl.constexpr, K_SCALE_BY_POINTER: gl.constexpr, V_SCALE_BY_POINTER: gl.constexpr,
              ORDERED: gl.constexpr):
    """Consumer ``half`` (0 or 1): the tile's tokens at places ``half * TOKENS ..``, 64 rows, one warpgroup."""
    q_ptr, out_ptr, pos_ptr, order_ptr, plan_len_ptr, plan_block_ptr, plan_members_ptr = ptrs
    q_smem, k_bufs, v_bufs, k_ready, v_ready, empty = bufs
    k_scale, v_scale, sm_scale, T, num_tiles, stride_qt, stride_qh, stride_ot, stride_oh = scalars
    tile = num_tiles - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    keys_layout: gl.constexpr = gl.SliceLayout(0, mma)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    # Q of this consumer's tokens, fp16, into shared memory (wgmma's A operand).
    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    q_token = _tile_tokens(order_ptr, kv_head, tile, half * TOKENS + q_rows // GROUP_POW2, num_tiles, 2 * TOKENS,
                           ORDERED)
    q_live = (q_token < T) & (q_rows % GROUP_POW2 < GROUP)
    q_head = kv_head * GROUP + q_rows % GROUP_POW2
    q_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q_ptrs = q_ptr + q_token.to(gl.int64)[:, None] * stride_qt + q_head[:, None] * stride_qh + q_dims[None, :]
    q_smem.store(gl.load(q_ptrs, mask=q_live[:, None], other=0.0).to(gl.float16))
    fence_async_shared()

    rows = gl.arange(0, ROWS, layout=rows_layout)
    token = _tile_tokens(order_ptr, kv_head, tile, half * TOKENS + rows // GROUP_POW2, num_tiles, 2 * TOKENS,
                         ORDERED)
    live = (token < T) & (rows % GROUP_POW2 < GROUP)
    pos = gl.load(pos_ptr + token, mask=live, other=-1)
    logit_scale = sm_scale * LOG2E * TILE_SCALE * global_scale(k_scale, K_SCALE_BY_POINTER)
    keys = gl.arange(0, PAGE, layout=keys_layout)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_layout)
    l_i = gl.zeros([ROWS], gl.float32, rows_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)
    s_init = gl.zeros([ROWS, PAGE], gl.float32, mma)
    plan = (kv_head * num_tiles + tile).to(gl.int64) * WIDTH
    union_len = gl.load(plan_len_ptr + kv_head * num_tiles + tile)
    # Pages that end at or before every live row's position (most of them) need no per-key causal mask: a row's
    # selection becomes an additive 0 / -inf bias, which leaves the exponents bit-identical to the masked path's.
    first_pos = gl.min(gl.where(live, pos, 2147483647), axis=0)
    not_selected = gl.full([ROWS], float("-inf"), gl.float32, rows_layout)
    stages: gl.constexpr = k_bufs.shape[0]
    for u in range(union_len):
        stage = u % stages
        phase = (u // stages) & 1
        block = gl.load(plan_block_ptr + plan + u)
        mine = (gl.load(plan_members_ptr + plan + u) >> (half * TOKENS)) & ((1 << TOKENS) - 1)
        mbarrier.wait(k_ready.index(stage), phase)
        if mine != 0:
            s = warpgroup_mma(q_smem, k_bufs.index(stage).permute((1, 0)), s_init, use_acc=False)
            row_selected = ((mine >> (rows // GROUP_POW2)) & 1) != 0
            # Logits are s * logit_scale plus a row bias (0, or -inf where the row's token did not select the page),
            # -inf at keys a row cannot see; each exponent is one multiply-add (fold_scores).
            if block * PAGE + PAGE - 1 <= first_pos:
                scores = s
                bias = gl.where(row_selected, 0.0, not_selected)
            else:
                visible = row_selected[:, None] & ((block * PAGE + keys)[None, :] <= pos[:, None])
                scores = gl.where(visible, s, float("-inf"))
                bias = gl.zeros_like(m_i)
            p, alpha, m_i, l_i = fold_scores(scores, logit_scale, bias, m_i, l_i, 1, True)
            p16 = gl.convert_layout(p.to(gl.float16), p_layout)
            acc = acc * alpha[:, None]  # before the wait: rescales while V^T may still be decoding
            mbarrier.wait(v_ready.index(stage), phase)
            acc = warpgroup_mma(p16, v_bufs.index(stage).permute((1, 0)), acc)
        else:
            mbarrier.wait(v_ready.index(stage), phase)
        mbarrier.arrive(empty.index(stage), count=1)

    out_scale = TILE_SCALE * global_scale(v_scale, V_SCALE_BY_POINTER)
    norm = gl.where(l_i > 0, out_scale / gl.where(l_i > 0, l_i, 1.0), 0.0)
    out_rows = out_ptr + token.to(gl.int64) * stride_ot + (kv_head * GROUP + rows % GROUP_POW2) * stride_oh
    dims = gl.arange(0, HEAD_DIM, layout=keys_layout)
    out = (acc * norm[:, None]).to(out_ptr.dtype.element_ty)
    gl.store(out_rows[:, None] + dims[None, :], out, mask=live[:, None])


@gluon.jit
def _consumer_worker(ptrs, bufs, scalars, GROUP: gl.constexpr, GROUP_POW2: gl.constexpr, TOKENS: gl.constexpr,
                     WIDTH: gl.constexpr, K_SCALE_BY_POINTER: gl.constexpr, V_SCALE_BY_POINTER: gl.constexpr,
                     ORDERED: gl.constexpr):
    """The second consumer, as a worker partition (the first is the default partition)."""
    _consumer(1, ptrs, bufs, scalars, GROUP, GROUP_POW2, TOKENS, WIDTH, K_SCALE_BY_POINTER, V_SCALE_BY_POINTER,
              ORDERED)


@gluon.jit
def _ws_prefill_kernel(
    q_ptr, out_ptr, cache_ptr, pos_ptr,  # [T, H, 128], [T, H, 128], uint8 cache, int32 [T]
    order_ptr,  # with ORDERED, int32 [Hkv, tiles * 2 * TOKENS]: the tiles' tokens (triton_prefill.group_tokens)
    tiles_desc,  # predecoded mode: TMA descriptor of the tiles, [slots * Hkv * 256, 128] fp16; else None
    plan_len_ptr, plan_page_ptr, plan_block_ptr, plan_members_ptr,
    k_scale, v_scale, sm_scale,
    T, stride_qt, stride_qh, stride_ot, stride_oh,
    HKV: gl.constexpr, GROUP: gl.constexpr, GROUP_POW2: gl.constexpr, TOKENS: gl.constexpr, WIDTH: gl.constexpr,
    K_SCALE_BY_POINTER: gl.constexpr, V_SCALE_BY_POINTER: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    PREDECODED: gl.constexpr, RING_SLOTS: gl.constexpr, ORDERED: gl.constexpr,
):
    num_tiles = gl.num_programs(0)
    tile_layout: gl.constexpr = TILE_LAYOUT
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], gl.float16)
    k_bufs = gl.allocate_shared_memory(gl.float16, [RING_SLOTS, PAGE, HEAD_DIM], tile_layout)
    v_bufs = gl.allocate_shared_memory(gl.float16, [RING_SLOTS, HEAD_DIM, PAGE], tile_layout)
    q0_smem = gl.allocate_shared_memory(gl.float16, [ROWS, HEAD_DIM], q_smem_layout)
    q1_smem = gl.allocate_shared_memory(gl.float16, [ROWS, HEAD_DIM], q_smem_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [RING_SLOTS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [RING_SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING_SLOTS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer

    rings = (k_bufs, v_bufs, k_ready, v_ready, empty)
    consumer_ptrs = (q_ptr, out_ptr, pos_ptr, order_ptr, plan_len_ptr, plan_block_ptr, plan_members_ptr)
    scalars = (k_scale, v_scale, sm_scale, T, num_tiles, stride_qt, stride_qh, stride_ot, stride_oh)
    # (The partitions are listed in each call: a function cannot be a value in Gluon.)
    if PREDECODED:
        gl.warp_specialize([
            (_consumer, (0, consumer_ptrs, (q0_smem, k_bufs, v_bufs, k_ready, v_ready, empty), scalars,
                         GROUP, GROUP_POW2, TOKENS, WIDTH, K_SCALE_BY_POINTER, V_SCALE_BY_POINTER, ORDERED)),
            (_consumer_worker, (consumer_ptrs, (q1_smem, k_bufs, v_bufs, k_ready, v_ready, empty), scalars,
                                GROUP, GROUP_POW2, TOKENS, WIDTH, K_SCALE_BY_POINTER, V_SCALE_BY_POINTER, ORDERED)),
            (_tile_producer, (tiles_desc, (plan_len_ptr, plan_page_ptr), rings, (T, num_tiles), HKV, WIDTH)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        plan_smem = (gl.allocate_shared_memory(gl.int32, [WIDTH, 1], PLAN_LAYOUT),
                     gl.allocate_shared_memory(gl.int32, [WIDTH, 1], PLAN_LAYOUT),
                     gl.allocate_shared_memory(gl.int32, [WIDTH, 1], PLAN_LAYOUT))
        gl.warp_specialize([
            (_consumer, (0, consumer_ptrs, (q0_smem, k_bufs, v_bufs, k_ready, v_ready, empty), scalars,
                         GROUP, GROUP_POW2, TOKENS, WIDTH, K_SCALE_BY_POINTER, V_SCALE_BY_POINTER, ORDERED)),
            (_consumer_worker, (consumer_ptrs, (q1_smem, k_bufs, v_bufs, k_ready, v_ready, empty), scalars,
                                GROUP, GROUP_POW2, TOKENS, WIDTH, K_SCALE_BY_POINTER, V_SCALE_BY_POINTER, ORDERED)),
            (_producer, ((cache_ptr, pos_ptr, order_ptr, plan_len_ptr, plan_page_ptr, plan_block_ptr,
                          plan_members_ptr), rings + (plan_smem,), (T, num_tiles), HKV, 2 * TOKENS, WIDTH, ORDERED)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def plan(block_ids, block_table, req, pos, group: int, order: torch.Tensor | None = None):
    """The union plan of this kernel's tiles (``2 * tokens_per_consumer(group)`` tokens, consecutive or as in
    ``order``, :func:`group_tokens`): ``(union_len, plan)`` as returned by :func:`.triton_prefill.plan_tiles`."""
    return triton_prefill.plan_tiles(block_ids, block_table, req, pos, 2 * tokens_per_consumer(group), order)


def group_tokens(block_ids, block_table, req, pos, group: int) -> torch.Tensor:
    """The token order of this kernel's tiles that :func:`.triton_prefill.group_tokens` picks: tiles of tokens whose
    selections overlap, so fewer union pages per tile, the same output bits as consecutive tiles. Returns int32
    ``[Hkv, tiles * 2 * tokens_per_consumer(group)]`` (``T`` at a place without a token)."""
    return triton_prefill.group_tokens(block_ids, block_table, req, pos, 2 * tokens_per_consumer(group))


# Predecoded mode (:mod:`.triton_predecode`): a producer warpgroup (one thread issues the TMA copies; Gluon would pad
# one warp to four) with few registers; (registers per thread at
# launch, consumer, producer) as in REGISTER_PLANS.
TILE_COPY_WARPS = 4
TILE_COPY_REGISTER_PLAN = (168, 192, 24)
# Predecoded mode's ring: 3 slots of 64 KB (a K and a V^T tile) and both consumers' Q (32 KB) take 224 of the 227 KB
# a CTA may have; the copies then run two pages ahead of the slower consumer instead of one. On one H100 (T = 32K,
# top-16, 4 runs each: 2 alternating rounds in each of 2 calls, bench/results/predecode_ring_h100.md): per-token
# random selections 3.7% (64/4) and 4.1% (16/1) faster, the indexer's 0.8%, runs of 8 shared 0.9% slower; same bits.
TILE_COPY_STAGES = 3


def ring_slots(predecoded: bool) -> int:
    """Slots of the kernel's ring of K and V^T tiles: ``TILE_COPY_STAGES`` in predecoded mode, else ``STAGES``."""
    return TILE_COPY_STAGES if predecoded else STAGES.value


def tiles_descriptor(tiles: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of predecoded ``tiles`` (:func:`.triton_predecode.alloc_tiles`) as the kernel copies them:
    rows of 128 fp16 values, 128 rows (one K or V^T tile) per copy."""
    return TensorDescriptor.from_tensor(tiles.view(-1, HEAD_DIM.value), [PAGE.value, HEAD_DIM.value], TILE_LAYOUT.value)


def run(q, cache, pos, tile_plan, k_scale, v_scale, sm_scale, out, producer_warps: int | None = None,
        tiles: torch.Tensor | None = None, order: torch.Tensor | None = None):
    """The kernel over a :func:`plan` (``tile_plan``, made with the same ``order``); ``q`` ``[T, H, 128]``, ``out``
    like it, ``pos`` int32 ``[T]``; ``producer_warps``: 4 or 8 (``REGISTER_PLANS``; default ``PRODUCER_WARPS``;
    either gives the same output). With ``tiles`` (predecoded, :mod:`.triton_predecode`; the plan made over their
    slot table) the producer copies tiles instead of decoding pages (``producer_warps`` is then ignored): the same
    output bits. Returns ``out``."""
    if tiles is not None:
        producer_warps, (max_regs, consumer_regs, producer_regs) = TILE_COPY_WARPS, TILE_COPY_REGISTER_PLAN
    else:
        producer_warps = PRODUCER_WARPS if producer_warps is None else producer_warps
        if producer_warps not in REGISTER_PLANS:
            raise ValueError(f"producer_warps: one of {sorted(REGISTER_PLANS)}, got {producer_warps}")
        max_regs, consumer_regs, producer_regs = REGISTER_PLANS[producer_warps]
    t, h, _ = q.shape
    hkv = cache.shape[1] // 2
    group = h // hkv
    union_len, entries = tile_plan
    _ws_prefill_kernel[(union_len.shape[1], hkv)](
        q, out, cache, pos.contiguous(), order, None if tiles is None else tiles_descriptor(tiles),
        union_len, entries[0], entries[1], entries[2],
        k_scale, v_scale, float(sm_scale),
        t, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HKV=hkv, GROUP=group, GROUP_POW2=triton.next_power_of_2(group), TOKENS=tokens_per_consumer(group),
        WIDTH=entries.shape[3],
        K_SCALE_BY_POINTER=isinstance(k_scale, torch.Tensor), V_SCALE_BY_POINTER=isinstance(v_scale, torch.Tensor),
        PRODUCER_WARPS=producer_warps, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        PREDECODED=tiles is not None, RING_SLOTS=ring_slots(tiles is not None), ORDERED=order is not None,
        num_warps=4, maxnreg=max_regs,
    )
    return out


def launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out,
           producer_warps: int | None = None, predecoded: triton_predecode.Predecoded | None = None,
           token_groups: bool = False):
    """Sparse prefill on a Hopper GPU (:func:`sglang_nvfp4.kernels.sparse_prefill`); arguments as
    validated by the dispatcher and as in :func:`.triton_prefill.launch`, the layer within
    :func:`supports`; ``producer_warps`` as in :func:`run`. With ``predecoded`` (the forward's
    :func:`.triton_predecode.prepare` over the same metadata, its tiles holding this layer's pages:
    :func:`.triton_predecode.launch`) the kernel copies the tiles; with ``token_groups`` its tiles take the tokens
    :func:`group_tokens` picks. Either way the same output bits. Returns ``out``."""
    if q.shape[0] == 0:
        return out
    group = q.shape[1] // (cache.shape[1] // 2)
    table, tiles = (block_table, None) if predecoded is None else (predecoded.slot_table, predecoded.tiles)
    order = group_tokens(block_ids, table, req, pos, group) if token_groups else None
    return run(q, cache, pos, plan(block_ids, table, req, pos, group, order), k_scale, v_scale, sm_scale, out,
               producer_warps, tiles=tiles, order=order)
