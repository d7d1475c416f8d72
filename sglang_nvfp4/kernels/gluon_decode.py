"""Sparse decode for Hopper (sm_90), in Gluon: decoded pages go straight into wgmma's register operands.
Same contract (:mod:`sglang_nvfp4.reference`), grid and split combine as :mod:`.triton_decode`, its own split
schedule (below); entry point :func:`launch`.

Why a second decode kernel. Decode multiplies each decoded page by one token's query heads only, so it is
bound by decoding, not by the tensor cores. The Triton kernel decodes a tile in a blocked layout and Triton
then moves it through shared memory into the layout the matrix unit reads (``bench/results/kernels_h200.md``:
shared-memory pipe 71% busy, 27% of copy bandwidth). Gluon lets the kernel choose the thread of every
decoded value: each thread loads exactly the code words whose values its wgmma A-operand registers hold, so
a decoded tile never touches shared memory.

How. The products are transposed as in the Triton kernel, ``S^T = K.Q^T`` and ``O^T += V^T.P^T``: keys and
dims on wgmma's M side (128 rows, the A operand from registers), the query heads on N (``ROWS``). In the
A layout (k_width 2) a thread holds, per row and per pair of 16-wide k steps, 8 values that are not
consecutive k indices; a code word holds 8 consecutive cache elements. Both products contract over an index
whose order is free so long as both operands use it, so the kernel runs them over permuted indices:

* logical k index ``32 wr + 16 x + 8 y + 2 wl + z`` is cache element ``8 (4 wl + wr) + 4 x + 2 z + y``
  (:func:`cache_index`): word ``4 wl + wr`` of a row (``wl``: the thread's lane within a quad, ``wr``: its
  register) and code ``4 x + 2 z + y`` of that word. The two values of one fp16x2 register (``z``, k bit 0) are
  then codes two apart, which the decoder converts as they come, without a byte interleave
  (:func:`.gluon_common.decode_word_planes`);
* for ``S^T`` the contraction index is the head dim: ``Q^T`` is staged in shared memory in this dim order;
* for ``O^T`` it is the key: ``S^T`` rows (keys) are loaded in this key order too, so ``P^T`` leaves the
  softmax already in the order V^T's words give, and goes to shared memory (``ROWS x 128`` fp16) as is.

Split schedule: a fixed merge tree, any split count. A token's kept pages (its deduplicated selection, in
order) are grouped into chunks of ``CHUNK_PAGES``; a chunk's pages are folded in order into one softmax
partial ``(max, sum, P.V)``, and the chunks' partials are merged pairwise along a binary tree (chunks
``2i`` and ``2i + 1``, then pairs of those, ...) by :func:`.triton_common.merge_partials`. Program
``split`` of ``SPLITS`` takes an aligned run of ``CHUNKS_PER_SPLIT`` chunks, merges them along the same
tree with a stack in shared memory (a level waits for its right sibling), and writes the run's partial;
:func:`.triton_decode.combine_splits` merges the runs' partials along the tree's upper levels. The tree
does not depend on the split count, and an empty partial (chunks past the last kept page) is the exact
identity of the merge, so every split count gives the same output (the sign of a zero aside).
:func:`launch` therefore picks the count from the batch (:func:`decode_splits`: many splits for few
tokens, one for large batches, whose programs then write no partials) and decode stays batch-invariant:
a token's output depends on its own selection only.

A token's pages are looked up in the block table once, when its program starts, so that no page's bytes wait on a
block-table load of their own. Programs that fit in one wave load each page's bytes while the page before it
computes (:func:`prefetches`). One page beyond the bytes a program has already asked for, its next page's blocks
are brought into L2 by a bulk prefetch from one thread (:func:`l2_prefetch_pages`), which costs no register and no
shared memory: the loads of that page then wait on L2 instead of HBM.

Numerics: fp16 Q and tiles (``value / TILE_SCALE``, exact), fp32 scores and sums, exp2 softmax, ``P``
rounded to fp16, as the Triton kernel; the summation order differs, so outputs agree with it to rounding,
not bit for bit. Keys past the token's position have their scores masked to ``-inf``, so ``p = 0``; their scale
bytes may be E4M3 NaN codes, which the V scale operands replace by 448
(:func:`.gluon_common.vt_plane_scale_operands_finite`), so that ``p * v`` is 0 and not NaN. Every other scale is
unchanged, so this equals zeroing those keys' V scales, as the Triton decode does, up to the sign of a zero.

Scope (:func:`supports`): NVIDIA sm_90, 1 to 32 query heads per KV head. It runs only compiled (Gluon
has no interpreter); ``tests/test_gluon_decode.py`` compiles it for sm_90 on any host, checks that no
tile passes through shared memory, and compares it with the reference on a Hopper GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from . import triton_decode
from .gluon_common import SCALE_WORD, decode_word_planes, k_scale_operand, vt_plane_scale_operands_finite
from .triton_common import (
    BLOCK_WORDS,
    HEAD_DIM,
    LOG2E,
    PAGE,
    ROW_WORDS,
    TILE_SCALE,
    V_SCALE_ROWS_PER_GROUP,
    global_scale,
    merge_partials,
    online_softmax_step,
)

MAX_GROUP = 32  # query heads per KV head (wgmma's N: the fp32 S^T and O^T grow with it; 64 spills)
NUM_WARPS = gl.constexpr(4)  # one warpgroup
CHUNK_PAGES = gl.constexpr(2)  # kept pages folded in order into one partial: the leaves of the merge tree
MAX_CHUNKS_PER_SPLIT = 16  # the merge stack's depth: 5 levels of ROWS x 128 fp32 in shared memory
# Programs the split count aims for, per multiprocessor: in both H200 sweeps of bench/results/decode_gluon_h200.md,
# about 256 programs in all served every batch size best (8 splits at batch 8, 2 at 32, 1 from 64 on). Measured before
# the L2 prefetch, and kept: with it, the programs of batch 32 still take 2 splits.
PROGRAMS_PER_SM = 2
MAX_L2_PAGES = 8  # the most pages ahead a launch may prefetch into L2 (l2_pages)
# The merge stack's shared-memory layouts: each thread stores and reloads its own elements of the mma layout.
STACK_ROWS_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
STACK_ACC_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))


def selection_slots(width: int) -> int:
    """Slots the kernel reads of a token's ``width`` ids (padded with -1): a power of two, at least 32 (with 16 slots
    the selection's replicated lanes cost registers, and the kernel spills under the 168-register cap)."""
    return max(32, triton.next_power_of_2(width))


def max_registers(rows: int, width: int, prefetch: bool) -> int:
    """Register cap per thread: 168 (3 programs per multiprocessor, as the Triton decode) with 16 rows (16 query
    heads per KV head), up to 32 ids per token and no prefetch, else 232 (2 programs). ``tests/test_gluon_decode.py``
    checks that neither spills, with the installed Triton (CI: 3.8; the GPU host has 3.6)."""
    return 168 if rows <= 16 and selection_slots(width) <= 32 and not prefetch else 232


def prefetches(rows: int, width: int, programs: int, device: torch.device) -> bool:
    """Whether each of the launch's ``programs`` loads a page's bytes into registers while the page before it
    computes. The next page's bytes cost registers: 2 programs per multiprocessor instead of 3, and with more than 16
    rows or 32 ids per token they would spill. Since the programs bring their next page into L2 ahead of its loads
    (:func:`l2_prefetch_pages`), this pays only where the programs do not fill the multiprocessors anyway, one
    program or fewer each. On one H100 (64/4, 32K context, top-16, ``bench/results/decode_l2_h100.json``), batch 1
    (32 programs) took 13.0 µs with it and 13.9 without (and the L2 prefetch); batch 8, 32 and 64 (256 programs each)
    19.2 / 36.4 / 51.8 µs with it against 18.5 / 34.7 / 50.1 µs without."""
    return rows <= 16 and selection_slots(width) <= 32 and programs <= _multiprocessors(device)


def l2_prefetch_pages(prefetch: bool, pages_per_program: int) -> int:
    """How many pages ahead :func:`launch` has a program's pages brought into L2: one page past the bytes it already
    loads (1, or 2 with the register prefetch), and none where a program walks no further. On one H100 (64/4, 32K
    context, top-16, ``bench/results/decode_l2_h100.json``, two calls), batch 256 (no register prefetch) took 154-156
    µs at 1 page, 160-163 at 2, 178-206 at 3-4 and 166-169 at none; batch 32 with the register prefetch (8 pages per
    program) 36.4-37.4 µs at 2 pages, 38.5-38.9 at 1 and 37.6-38.5 at none; batch 1 (2 pages per program) 12.8-13.2
    µs at none, 13.4-14.1 at 2. Deeper prefetches flood L2 and HBM's queues ahead of the loads that wait."""
    ahead = 2 if prefetch else 1
    return ahead if pages_per_program > ahead else 0


def num_chunks(width: int) -> int:
    """Leaves of the merge tree for selections ``width`` ids wide: chunks of ``CHUNK_PAGES`` kept pages."""
    return max(1, triton.next_power_of_2(width) // CHUNK_PAGES.value)


def split_range(width: int) -> tuple[int, int]:
    """The split counts a launch accepts for ``width`` ids: powers of two from ``(fewest, most)``; each split takes
    at most ``MAX_CHUNKS_PER_SPLIT`` chunks, and at least one."""
    chunks = num_chunks(width)
    return max(1, chunks // MAX_CHUNKS_PER_SPLIT), chunks


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_tokens: int, kv_heads: int, width: int, device: torch.device) -> int:
    """The split count :func:`launch` picks: about ``PROGRAMS_PER_SM`` programs per multiprocessor over the batch's
    ``num_tokens x kv_heads`` (token, KV head) pairs, within :func:`split_range`. It follows the batch, but the
    output does not (module docstring)."""
    fewest, most = split_range(width)
    want = max(1, PROGRAMS_PER_SM * _multiprocessors(device) // max(1, num_tokens * kv_heads))
    return min(most, max(fewest, 1 << (want.bit_length() - 1)))


def supports(heads: int, kv_heads: int, width: int) -> bool:
    """Whether this kernel serves a layer (on an sm_90 device, which the dispatcher checks)."""
    return 1 <= heads // kv_heads <= MAX_GROUP


@gluon.jit
def cache_index(k):
    """Cache element (dim of a key row, or key of a V^T row) at logical index ``k`` of a tile (module
    docstring): bits ``k0, k1 k2, k3, k4, k5 k6`` = ``z, wl, y, x, wr`` -> ``32 wl + 8 wr + 4 x + 2 z + y``."""
    return ((k >> 3) & 1) | ((k & 1) << 1) | (((k >> 4) & 1) << 2) | (((k >> 5) & 3) << 3) | (((k >> 1) & 3) << 5)


@gluon.jit
def vt_row_dim(m):
    """Dim held by row ``m`` of a V^T tile (and of ``O^T``): bits ``m3, m6, m0 m1, m2, m4 m5`` -> dim bits 0..6.
    A thread's four rows (bits 3 and 6 of ``m`` are its registers) then lie in one scale group (dim bits 4..6),
    so it loads 8 V scale words per page instead of 32."""
    return ((m >> 3) & 1) | (((m >> 6) & 1) << 1) | ((m & 3) << 2) | (((m >> 2) & 1) << 4) | (((m >> 4) & 3) << 5)


# Thread layout of a tile's code words ``[128 rows, 16 words]``: the rows and words whose decoded values fill a
# thread's registers of wgmma's A operand (m64, fp16, 4 warps): rows ``l // 4 + 8 h + 16 w + 64 r`` (lane ``l``,
# warp ``w``, registers ``h``, ``r``), words ``4 (l % 4) + 0..3`` (16 contiguous bytes). The kernel works on the
# 6-d view ``TILE_6D = [r, w, h, l // 4, l % 4, word % 4]`` of it: scales, which do not depend on some of the
# register axes, are loaded once per thread and broadcast along those axes in registers.
WORDS_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [64, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[128, 16]))
TILE_6D = gl.constexpr((2, 4, 2, 8, 4, 4))


@gluon.jit
def _as_operand(codes, operand_layout: gl.constexpr):
    """Decoded words ``TILE_6D + [2, 2, 2]`` (row, word ``4 wl + wr``, code ``4x + y + 2z``,
    :func:`.gluon_common.decode_word_planes`) -> fp16 ``[128, 128]`` with column ``32 wr + 16 x + 8 y + 2 wl + z``,
    in ``operand_layout``. With the words loaded in ``WORDS_LAYOUT`` this is a renaming of registers: no data
    moves."""
    x = gl.reshape(codes, (PAGE, 4, 4, 2, 2, 2))  # [row, wl, wr, x, y, z]
    x = gl.permute(x, (0, 2, 3, 4, 1, 5))  # [row, wr, x, y, wl, z]
    return gl.convert_layout(gl.reshape(x, (PAGE, HEAD_DIM)), operand_layout)


@gluon.jit
def _block_words(words_ptr, page, kv_head, HKV: gl.constexpr):
    """Pointers to the first words of ``page``'s K and V^T blocks of ``kv_head``, computed once per page (uniform): the
    loads add their loop-invariant 32-bit offsets within the block to them."""
    k_block = words_ptr + page.to(gl.int64) * (2 * HKV * BLOCK_WORDS) + kv_head * BLOCK_WORDS
    return k_block, k_block + HKV * BLOCK_WORDS


@gluon.jit
def _load_k(k_block, k_at):
    """A page's K bytes of this thread (offsets ``k_at`` within the block, :func:`_sparse_decode_kernel`): code words
    ``[128, 16]`` in WORDS_LAYOUT, and per row of the thread its 2 scale bytes (5-d, uint16)."""
    k_words_at, k_scales_at = k_at
    scales = k_block.to(gl.pointer_type(gl.uint16), bitcast=True) + k_scales_at
    return gl.load(k_block + k_words_at), gl.load(scales)


@gluon.jit
def _load_v(v_block, v_at):
    """A page's V^T bytes of this thread: code words ``[128, 16]`` in WORDS_LAYOUT, and the 8 token scales of each
    word's octet as two words (4-d)."""
    v_words_at, v_scale_at = v_at
    scales = v_block + v_scale_at
    return gl.load(v_block + v_words_at), gl.load(scales), gl.load(scales + 1)


@gluon.jit
def _kept_blocks(block_ids_ptr, block_table_ptr, kv_head, token, req, pos, K, stride_ih, stride_it, stride_ik,
                 stride_br, stride_bs, K_POW2: gl.constexpr):
    """The token's deduplicated selection, as the Triton decode keeps it: the first occurrence of each id
    that starts at or before ``pos``. Returns ``(block [K_POW2], page, keep, order, num_kept)``: kept slot ``i``
    is the ``order[i]``-th kept block, on cache page ``page[i]``. The pages are looked up here, all at once, so
    that no page's bytes wait on a block-table load of their own."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])
    slot_i = gl.arange(0, K_POW2, layout=gl.SliceLayout(1, layout))
    slot_j = gl.arange(0, K_POW2, layout=gl.SliceLayout(0, layout))
    ids = block_ids_ptr + kv_head * stride_ih + token.to(gl.int64) * stride_it
    block_i = gl.load(ids + slot_i * stride_ik, mask=slot_i < K, other=-1)
    block_j = gl.load(ids + slot_j * stride_ik, mask=slot_j < K, other=-1)
    selected_j = (block_j >= 0) & (block_j * PAGE <= pos)
    earlier = slot_j[None, :] < slot_i[:, None]
    repeat = (block_i[:, None] == block_j[None, :]) & selected_j[None, :] & earlier
    keep = (block_i >= 0) & (block_i * PAGE <= pos) & (gl.max(repeat.to(gl.int32), axis=1) == 0)
    keep_j = gl.convert_layout(keep, gl.SliceLayout(0, layout))
    order = gl.sum((keep_j[None, :] & earlier).to(gl.int32), axis=1)
    # Every warp holds the whole selection (one or two ids per lane): picking the j-th kept block is then a
    # reduction within a warp.
    everywhere: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    keep = gl.convert_layout(keep, everywhere)
    block = gl.convert_layout(block_i, everywhere)
    page = gl.load(block_table_ptr + req.to(gl.int64) * stride_br + block * stride_bs, mask=keep, other=0)
    return block, page, keep, gl.convert_layout(order, everywhere), gl.sum(keep.to(gl.int32), axis=0)


@gluon.jit
def _kept_page(block, page, keep, order, j):
    """Block and page of the ``j``-th kept block; block 0 and page 0 (unused) from ``j`` = the number kept on."""
    chosen = keep & (order == j)
    return gl.sum(gl.where(chosen, block, 0), axis=0), gl.sum(gl.where(chosen, page, 0), axis=0)


# One thread of the program ($1 = 0) asks the copy engine to bring a page's K and V^T blocks ($2, $3: BLOCK_BYTES each,
# 16-byte aligned) into L2; nothing is written to the program's registers or shared memory, and nothing waits for it.
_L2_PREFETCH_PTX = gl.constexpr("""{
.reg .pred leader;
setp.eq.u32 leader, $1, 0;
@leader cp.async.bulk.prefetch.L2.global [$2], """ + str(BLOCK_WORDS.value * 4) + """;
@leader cp.async.bulk.prefetch.L2.global [$3], """ + str(BLOCK_WORDS.value * 4) + """;
mov.u32 $0, 0;
}""")


@gluon.jit
def _prefetch_to_l2(j, end, block, page, keep, order, words_ptr, kv_head, HKV: gl.constexpr):
    """Has the ``j``-th kept page's K and V^T blocks of ``kv_head`` brought into L2 if ``j`` is below ``end``: their
    loads, a few pages later, then wait on L2 instead of HBM. Issued by one thread, asynchronously
    (:data:`_L2_PREFETCH_PTX`)."""
    _, page_j = _kept_page(block, page, keep, order, j)  # the block's own reduction is dead code, dropped
    k_block, v_block = _block_words(words_ptr, page_j, kv_head, HKV)
    thread: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    leader = gl.where(j < end, gl.arange(0, 32 * NUM_WARPS, layout=thread), 1)
    gl.inline_asm_elementwise(_L2_PREFETCH_PTX, "=r,r,l,l", [leader, k_block, v_block], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _kept_page_bytes(j, block, page, keep, order, words_ptr, kv_head, k_at, v_at, HKV: gl.constexpr):
    """The ``j``-th kept block and its page's bytes (:func:`_kept_page`, :func:`_load_k`, :func:`_load_v`):
    ``(block, k_words, k_scales, v_words, v_lo, v_hi)``. Past the last kept block, block 0 and page 0's bytes
    (unused)."""
    block_j, page_j = _kept_page(block, page, keep, order, j)
    k_block, v_block = _block_words(words_ptr, page_j, kv_head, HKV)
    k_words, k_scales = _load_k(k_block, k_at)
    v_words, v_lo, v_hi = _load_v(v_block, v_at)
    return block_j, k_words, k_scales, v_words, v_lo, v_hi


@gluon.jit
def _empty_partial(ROWS: gl.constexpr, mma: gl.constexpr):
    """The partial of no key: max ``-inf``, sum 0 (``[ROWS]``) and ``O^T = 0`` (``[128, ROWS]``, ``mma``), the
    identity of :func:`.triton_common.merge_partials`."""
    rows_layout: gl.constexpr = gl.SliceLayout(0, mma)
    return (gl.full([ROWS], float("-inf"), gl.float32, rows_layout), gl.zeros([ROWS], gl.float32, rows_layout),
            gl.zeros([HEAD_DIM, ROWS], gl.float32, mma))


@gluon.jit
def _merge_under_level(stack, level, m_i, l_i, acc_t, mma: gl.constexpr):
    """The partial held at merge-stack ``level`` (its left sibling) merged with ``(m_i, l_i, acc_t)``."""
    stack_m, stack_l, stack_acc = stack
    rows_layout: gl.constexpr = gl.SliceLayout(0, mma)
    return merge_partials(stack_m.index(level).load(rows_layout), stack_l.index(level).load(rows_layout),
                          stack_acc.index(level).load(mma), m_i, l_i, acc_t, DIM_AXIS=0)


@gluon.jit
def _sparse_decode_kernel(
    q_ptr, out_ptr, part_acc_ptr, part_stats_ptr, cache_ptr,  # q/out [T, H, 128]; partials fp32
    block_ids_ptr, block_table_ptr, req_ptr, pos_ptr,  # int32 [Hkv, T, K], [R, S], [T], [T]
    k_scale, v_scale, sm_scale,
    K, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ih, stride_it, stride_ik, stride_br, stride_bs,
    HKV: gl.constexpr, GROUP: gl.constexpr, ROWS: gl.constexpr, K_POW2: gl.constexpr, SPLITS: gl.constexpr,
    CHUNKS_PER_SPLIT: gl.constexpr, STACK_LEVELS: gl.constexpr, PREFETCH: gl.constexpr, L2_PAGES: gl.constexpr,
    K_SCALE_BY_POINTER: gl.constexpr, V_SCALE_BY_POINTER: gl.constexpr,
):
    token = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    pos = gl.load(pos_ptr + token)
    req = gl.load(req_ptr + token)
    block, page, keep, order, num_kept = _kept_blocks(block_ids_ptr, block_table_ptr, kv_head, token, req, pos, K,
                                                      stride_ih, stride_it, stride_ik, stride_br, stride_bs, K_POW2)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, ROWS, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], gl.float16)

    # Q of the KV head's query heads, fp16, dims in the logical order, as wgmma's B operand (Q^T).
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    q_dims = cache_index(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout)))
    q_ptrs = q_ptr + token.to(gl.int64) * stride_qt + (kv_head * GROUP + q_rows)[:, None] * stride_qh + q_dims[None, :]
    q_smem = gl.allocate_shared_memory(gl.float16, [ROWS, HEAD_DIM], smem_layout)
    q_smem.store(gl.load(q_ptrs, mask=(q_rows < GROUP)[:, None], other=0.0).to(gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [ROWS, HEAD_DIM], smem_layout)
    fence_async_shared()

    # Per thread: its tile rows and code words (WORDS_LAYOUT as TILE_6D), and its scale addresses, reduced over
    # the register axes they do not depend on (within a thread: no data moves). Offsets within a block, in words.
    row_2d = gl.arange(0, PAGE, layout=gl.SliceLayout(1, WORDS_LAYOUT))[:, None]
    word_2d = gl.arange(0, 16, layout=gl.SliceLayout(0, WORDS_LAYOUT))[None, :]
    row = gl.reshape(row_2d + 0 * word_2d, TILE_6D)
    word = gl.reshape(word_2d + 0 * row_2d, TILE_6D)
    # K tile row m is key cache_index(m) of the page. A K row's words 4l..4l+3 (lane l % 4) hold dims 32l..32l+31:
    # scale groups 2l and 2l + 1, bytes 2l and 2l + 1 of the row's scales, in scale word l // 2.
    k_at = (cache_index(row_2d) * ROW_WORDS + word_2d,  # code words, then the 2 scale bytes, in 2-byte units
            gl.max(cache_index(row), axis=5) * (2 * ROW_WORDS) + 2 * SCALE_WORD + gl.max(word // 4, axis=5))
    k_byte_shift = 8 * ((word % 4) // 2)  # of a code word's scale byte, in its row's 2 (a constant of each register)
    # V^T tile row m is dim vt_row_dim(m). The scales of tokens 8w..8w+7 in group g: bytes 64..71 of V^T row
    # V_SCALE_ROWS_PER_GROUP * g + w, two words.
    v_at = (vt_row_dim(row_2d) * ROW_WORDS + word_2d,
            gl.max(gl.max((vt_row_dim(row) // 16) * V_SCALE_ROWS_PER_GROUP + word, axis=2), axis=0) * ROW_WORDS
            + SCALE_WORD)
    s_key = cache_index(gl.arange(0, PAGE, layout=gl.SliceLayout(1, mma)))  # S^T row m is key cache_index(m)
    logit_scale = sm_scale * LOG2E * TILE_SCALE * global_scale(k_scale, K_SCALE_BY_POINTER)
    words_ptr = cache_ptr.to(gl.pointer_type(gl.uint32))

    s_init = gl.zeros([PAGE, ROWS], gl.float32, mma)
    # The merge stack (module docstring), STACK_LEVELS = log2(CHUNKS_PER_SPLIT) + 1 levels: level i holds the
    # partial of 2**i chunks until its right sibling is done. Each thread stores and reloads its own elements, in
    # one layout: no barrier is needed.
    stack = (gl.allocate_shared_memory(gl.float32, [STACK_LEVELS, ROWS], STACK_ROWS_LAYOUT),
             gl.allocate_shared_memory(gl.float32, [STACK_LEVELS, ROWS], STACK_ROWS_LAYOUT),
             gl.allocate_shared_memory(gl.float32, [STACK_LEVELS, HEAD_DIM, ROWS], STACK_ACC_LAYOUT))  # m, l, acc
    first_chunk = split * CHUNKS_PER_SPLIT
    end_chunk = gl.minimum(first_chunk + CHUNKS_PER_SPLIT, (num_kept + CHUNK_PAGES - 1) // CHUNK_PAGES)
    end_page = gl.minimum(end_chunk * CHUNK_PAGES, num_kept)  # past the split's last page
    # Pages 1 .. L2_PAGES - 1 of the split into L2 now; page j + L2_PAGES when page j starts.
    for ahead in gl.static_range(1, L2_PAGES):
        _prefetch_to_l2(first_chunk * CHUNK_PAGES + ahead, end_page, block, page, keep, order, words_ptr, kv_head,
                        HKV)
    if PREFETCH:  # the first page's bytes; past the last kept page this reads page 0, unused
        next_block, next_k_words, next_k_scales, next_v_words, next_v_lo, next_v_hi = _kept_page_bytes(
            first_chunk * CHUNK_PAGES, block, page, keep, order, words_ptr, kv_head, k_at, v_at, HKV)
    for chunk in range(first_chunk, end_chunk):
        # The chunk's pages, folded in order from the empty partial.
        m_i, l_i, acc_t = _empty_partial(ROWS, mma)
        for j in range(chunk * CHUNK_PAGES, gl.minimum(chunk * CHUNK_PAGES + CHUNK_PAGES, num_kept)):
            if L2_PAGES > 0:
                _prefetch_to_l2(j + L2_PAGES, end_page, block, page, keep, order, words_ptr, kv_head, HKV)
            if PREFETCH:  # this page's bytes arrived during the previous page; the next page's load now
                block_j, k_words, k_scales, v_words, v_lo, v_hi = (next_block, next_k_words, next_k_scales,
                                                                   next_v_words, next_v_lo, next_v_hi)
                next_block, next_k_words, next_k_scales, next_v_words, next_v_lo, next_v_hi = _kept_page_bytes(
                    j + 1, block, page, keep, order, words_ptr, kv_head, k_at, v_at, HKV)
            else:
                block_j, k_words, k_scales, v_words, v_lo, v_hi = _kept_page_bytes(
                    j, block, page, keep, order, words_ptr, kv_head, k_at, v_at, HKV)
            k_words = gl.reshape(k_words, TILE_6D)
            v_words = gl.reshape(v_words, TILE_6D)
            k_operand = k_scale_operand(gl.expand_dims(k_scales.to(gl.uint32), 5) >> k_byte_shift)
            k_tile = _as_operand(decode_word_planes(k_words, (k_operand, k_operand, k_operand, k_operand)), operand)
            s_t = warpgroup_mma(k_tile, q_smem.permute((1, 0)), s_init, use_acc=False)  # [128 keys, ROWS]
            # Key 128 * block_j <= pos is visible to every head: no max stays -inf.
            visible = (block_j * PAGE + s_key) <= pos
            p_t, alpha, m_i, l_i = online_softmax_step(s_t, visible[:, None], logit_scale, m_i, l_i,
                                                       KEY_AXIS=0, ROWS_MAY_SEE_NOTHING=False)
            p_smem.store(gl.permute(p_t.to(gl.float16), (1, 0)))
            fence_async_shared()
            # Converted once per octet, then shared by the thread's rows of it; NaN codes (keys past pos) made finite.
            s0, s1, s2, s3 = vt_plane_scale_operands_finite(v_lo, v_hi)
            v_scales = (gl.expand_dims(gl.expand_dims(s0, 0), 2), gl.expand_dims(gl.expand_dims(s1, 0), 2),
                        gl.expand_dims(gl.expand_dims(s2, 0), 2), gl.expand_dims(gl.expand_dims(s3, 0), 2))
            vt_tile = _as_operand(decode_word_planes(v_words, v_scales), operand)
            acc_t = warpgroup_mma(vt_tile, p_smem.permute((1, 0)), acc_t * alpha[None, :])  # [128 dims, ROWS]
        # Carry the chunk up the stack: while its position (counted in this split) has a 1 at a level, the level
        # holds its left sibling; merge and go up. Then it waits at the first 0.
        k = chunk - first_chunk
        carrying = k >= 0  # true
        for level in gl.static_range(STACK_LEVELS):
            if carrying:
                if ((k >> level) & 1) != 0:
                    m_i, l_i, acc_t = _merge_under_level(stack, level, m_i, l_i, acc_t, mma)
                else:
                    stack_m, stack_l, stack_acc = stack
                    stack_m.index(level).store(m_i)
                    stack_l.index(level).store(l_i)
                    stack_acc.index(level).store(acc_t)
                    carrying = k < 0  # false
    # The split's partial: the levels still held (the 1 bits of the chunk count), right to left, onto the empty
    # partial. Chunks past the last kept page are empty partials, the identity: they need no visit.
    done = gl.maximum(end_chunk - first_chunk, 0)
    m_i, l_i, acc_t = _empty_partial(ROWS, mma)
    for level in gl.static_range(STACK_LEVELS):
        if ((done >> level) & 1) != 0:
            m_i, l_i, acc_t = _merge_under_level(stack, level, m_i, l_i, acc_t, mma)

    dims = vt_row_dim(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, mma)))[:, None]  # dim of each acc_t row
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    if SPLITS == 1:
        norm = gl.where(l_i > 0, TILE_SCALE * global_scale(v_scale, V_SCALE_BY_POINTER) / gl.where(l_i > 0, l_i, 1.0), 0.0)
        out_rows = out_ptr + token.to(gl.int64) * stride_ot + (kv_head * GROUP + rows)[None, :] * stride_oh
        gl.store(out_rows + dims, (acc_t * norm[None, :]).to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[None, :])
    else:
        # The Triton decode's partials, which its combine kernel merges: column c of a row holds dim vt_tile_dim(c).
        part = (token.to(gl.int64) * HKV + kv_head) * SPLITS + split
        column = 16 * (dims % 8) + 2 * (dims // 16) + (dims // 8) % 2
        gl.store(part_acc_ptr + part * ROWS * HEAD_DIM + rows[None, :] * HEAD_DIM + column, acc_t)
        gl.store(part_stats_ptr + part * 2 * ROWS + rows, m_i)
        gl.store(part_stats_ptr + part * 2 * ROWS + ROWS + rows, l_i)


def launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out, splits: int | None = None,
           prefetch: bool | None = None, l2_pages: int | None = None):
    """Sparse decode on a Hopper GPU (:func:`sglang_nvfp4.kernels.sparse_decode`); arguments as validated by the
    dispatcher and as in :func:`.triton_decode.launch`, the layer within :func:`supports`; ``splits``: programs per
    (token, KV head), a power of two within :func:`split_range` (default: :func:`decode_splits`; every count gives
    the same output); ``prefetch``: whether the programs load a page's bytes while the page before it computes
    (default: :func:`prefetches`; either gives the same output); ``l2_pages``: how many pages ahead each program has
    its pages brought into L2, 0 for none (default: :func:`l2_prefetch_pages`; every count gives the same output).
    Returns ``out``."""
    t, h, _ = q.shape
    hkv = cache.shape[1] // 2
    group = h // hkv
    if t == 0:
        return out
    width = block_ids.shape[2]
    fewest, most = split_range(width)
    if splits is None:
        splits = decode_splits(t, hkv, width, q.device)
    elif splits & (splits - 1) or not fewest <= splits <= most:
        raise ValueError(f"splits: a power of two in [{fewest}, {most}] for {width} ids per token, got {splits}")
    rows, part_acc, part_stats = triton_decode.split_partials(out, hkv, group, splits)
    k_by_pointer, v_by_pointer = isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor)
    chunks_per_split = num_chunks(width) // splits
    if prefetch is None:
        prefetch = prefetches(rows, width, t * hkv * splits, q.device)
    elif prefetch and (rows > 16 or selection_slots(width) > 32):
        raise ValueError(f"prefetch: only up to 16 rows and 32 ids per token (it would spill), got {rows} rows and "
                         f"{width} ids")
    # A prefetch past the last kept page reads page 0's bytes (unused): an empty cache has none.
    prefetch = bool(prefetch) and cache.shape[0] > 0
    if l2_pages is None:
        l2_pages = l2_prefetch_pages(prefetch, chunks_per_split * CHUNK_PAGES.value)
    elif not 0 <= l2_pages <= MAX_L2_PAGES:
        raise ValueError(f"l2_pages: 0 to {MAX_L2_PAGES}, got {l2_pages}")
    _sparse_decode_kernel[(t, hkv, splits)](
        q, out, part_acc, part_stats, cache, block_ids, block_table, req.contiguous(), pos.contiguous(),
        k_scale, v_scale, float(sm_scale),
        width, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *block_ids.stride(), *block_table.stride(),
        HKV=hkv, GROUP=group, ROWS=rows, K_POW2=selection_slots(width), SPLITS=splits,
        CHUNKS_PER_SPLIT=chunks_per_split, STACK_LEVELS=chunks_per_split.bit_length(), PREFETCH=prefetch,
        L2_PAGES=l2_pages, K_SCALE_BY_POINTER=k_by_pointer, V_SCALE_BY_POINTER=v_by_pointer,
        num_warps=NUM_WARPS.value, maxnreg=max_registers(rows, width, prefetch),
    )
    if splits > 1:
        triton_decode.combine_splits(out, part_acc, part_stats, v_scale, hkv, group, rows, splits)
    return out
