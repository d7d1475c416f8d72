"""Shared Triton building blocks of the NVFP4 kernels: layout constants, decoders, softmax steps.

Everything here is a ``tl.constexpr`` or a ``@triton.jit`` helper (inlined into the kernels of
:mod:`.triton_prefill`, :mod:`.triton_decode`, :mod:`.triton_write` and :mod:`.triton_indexer`), in the
way Triton's fused-attention tutorial factors ``_attn_fwd_inner`` out of its kernels:

* layout constants, from :mod:`sglang_nvfp4.format` (the one home of the cache layout), and ``LOG2E``
  from :mod:`sglang_nvfp4.reference` (the contract's exp2 softmax);
* the one E4M3 decoder, :func:`e4m3_decode`;
* the page decoders :func:`load_k_tile` and :func:`load_vt_tile` (one page and KV head -> fp16 tile);
* the attention kernels' online-softmax step :func:`fold_scores` (:func:`online_softmax_step`: over masked scores),
  the split decode's merge of two partials :func:`merge_partials`, and the final normalise-and-store
  :func:`normalize_and_store`.

Tile values. An E2M1 code ``s e1 e0 m`` is rewritten as the E4M3 byte ``s << 7 | (e1 e0 m) << 2``,
which is exactly ``e2m1 * 2**-6`` (code 1, the value 0.5, lands on an E4M3 subnormal), and converted
to fp16 (Hopper's ``cvt.rn.f16x2.e4m3x2`` converts two per instruction); the E4M3 block scale is
converted the same way. Their fp16 product ``e2m1 * e4m3 * 2**-6`` is exact (a multiple of
``2**-17``, at most 42 in magnitude), so a tile equals the reference's fp16 K or V divided by
``TILE_SCALE = 2**6``, which the kernels fold into their logit and output scales. No lookup table.

Tile order. A row's 64 code bytes are read as 16 little-endian words of 8 codes (code ``i`` of a
word in bits ``4i..4i+3``, the byte order of the layout), so codes come out in natural order: K
tiles are ``[keys, dims]`` as in the cache. V^T tile rows are dims in the order ``vt_tile_dim``:
Triton lays a tile's rows out 16 apart in each thread, and this order puts those rows in one scale
group, so a thread multiplies by the scales of one group instead of eight. Kernels store output dim
``c`` of ``P.V`` to ``vt_tile_dim(c)`` (:func:`normalize_and_store` does).

Garbage. Keys that no row can see must not affect the output even when their scale bytes are E4M3
NaN codes: their scores are masked to ``-inf`` and ``load_vt_tile`` zeroes their V scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as fmt
from .. import reference

PAGE = tl.constexpr(fmt.PAGE_SIZE)  # tokens per page
HEAD_DIM = tl.constexpr(fmt.HEAD_DIM)
ROW = tl.constexpr(fmt.ROW_BYTES)  # bytes per cache row
CODE_BYTES = tl.constexpr(fmt.CODE_BYTES)
CODE_WORDS = tl.constexpr(fmt.CODE_BYTES // 4)  # a row's codes as little-endian uint32 words
ROW_WORDS = tl.constexpr(fmt.ROW_BYTES // 4)
CODES_PER_WORD = tl.constexpr(8)
SCALE_OFFSET = tl.constexpr(fmt.SCALE_OFFSET)
NUM_GROUPS = tl.constexpr(fmt.NUM_GROUPS)
SCALE_GROUP = tl.constexpr(fmt.SCALE_GROUP)
V_SCALE_ROWS_PER_GROUP = tl.constexpr(fmt.V_SCALE_ROWS_PER_GROUP)
V_SCALES_PER_ROW = tl.constexpr(fmt.PAGE_SIZE // fmt.V_SCALE_ROWS_PER_GROUP)  # 8 token scales per row
BLOCK_BYTES = tl.constexpr(fmt.PAGE_SIZE * fmt.ROW_BYTES)  # one head's K (or V^T) block in a page
BLOCK_WORDS = tl.constexpr(fmt.PAGE_SIZE * fmt.ROW_BYTES // 4)
TILE_SCALE = tl.constexpr(64.0)  # decoded tiles hold value / TILE_SCALE (see the module docstring)
LOG2E = tl.constexpr(reference.LOG2E)
# Triton's interpreter (3.8) decodes the E4M3 NaN codes 0x7F/0xFF as +-480; e4m3_decode patches them
# there. Read when this module is imported, as triton.jit decides between interpreting and compiling.
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))

# The 8 codes of one word ($8) -> f16x2 registers p0..p3 (codes 0-1, 2-3, 4-5, 6-7), each value e2m1 * 2**-6:
# planes of E4M3 bytes for the even codes (e: codes 0, 2, 4, 6) and the odd codes (o: 1, 3, 5, 7), byte-interleaved
# back into code order, converted two at a time. Scratch registers e, o, t, a, b (b32) and h0, h1 (b16), declared by
# the caller. Shared with the Gluon kernels' decoders (gluon_common.py), whose decode converts the planes as they are.
E2M1_WORD_TO_E4M3_PLANES_PTX = """
shl.b32 t, $8, 2; and.b32 e, t, 0x1C1C1C1C; shl.b32 t, $8, 4; lop3.b32 e, e, t, 0x80808080, 0xF8;
shr.b32 t, $8, 2; and.b32 o, t, 0x1C1C1C1C; lop3.b32 o, o, $8, 0x80808080, 0xF8;
"""
E2M1_WORD_TO_F16X2_PTX = E2M1_WORD_TO_E4M3_PLANES_PTX + """prmt.b32 a, e, o, 0x5140; prmt.b32 b, e, o, 0x7362;
mov.b32 {h0, h1}, a; cvt.rn.f16x2.e4m3x2 p0, h0; cvt.rn.f16x2.e4m3x2 p1, h1;
mov.b32 {h0, h1}, b; cvt.rn.f16x2.e4m3x2 p2, h0; cvt.rn.f16x2.e4m3x2 p3, h1;
"""
# One word in ($8), its 8 codes out in order as fp16 ($0..$7).
_E2M1_WORD_PTX = tl.constexpr("""{
.reg .b32 e, o, t, a, b, p0, p1, p2, p3;
.reg .b16 h0, h1;""" + E2M1_WORD_TO_F16X2_PTX + """mov.b32 {$0, $1}, p0; mov.b32 {$2, $3}, p1; mov.b32 {$4, $5}, p2; mov.b32 {$6, $7}, p3;
}""")


def uses_ptx(device: torch.device) -> bool:
    """Decode tiles with inline PTX (NVIDIA GPUs); the portable path serves ROCm and the interpreter."""
    return device.type == "cuda" and torch.version.hip is None


@triton.jit
def vt_tile_dim(row):
    """Dim held by row ``row`` of a V^T tile: row ``16k + 2g + b`` holds dim ``16g + 8b + k`` (group g).

    No two consecutive rows hold consecutive dims: with such pairs Triton 3.6 takes the rows to be
    16-byte aligned (they are 8-byte aligned) and issues misaligned 16-byte copies."""
    return (row % 16) // 2 * SCALE_GROUP + (row % 2) * 8 + row // 16


@triton.jit
def global_scale(scale, BY_POINTER: tl.constexpr):
    """A layer's fp32 global scale: read through a pointer (a one-element device tensor, CUDA-graph
    safe) or passed by value (a Python float)."""
    if BY_POINTER:
        value = tl.load(scale)
    else:
        value = scale
    return value


@triton.jit
def e2m1_words_to_fp16(words, USE_PTX: tl.constexpr):
    """uint32 ``[R, 16]`` code words -> fp16 ``[R, 128]`` holding ``e2m1 * 2**-6``, in code order.

    ``USE_PTX``: decode with inline PTX (CUDA). Otherwise portable Triton: the fp16 bits
    ``s << 15 | (e1 e0 m) << 9`` are exactly ``e2m1 * 2**-14``, scaled by ``2**8``."""
    if USE_PTX:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _E2M1_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        # [R, 16, 2, 2, 2] with code 4a + 2b + c at [a, b, c]
        codes = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    else:
        shift = tl.arange(0, CODES_PER_WORD) * 4
        code = (words[:, :, None] >> shift[None, None, :]) & 0xF  # [R, 16, 8]
        bits = ((code & 0x7) << 9) | ((code & 0x8) << 12)
        codes = bits.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
    return tl.reshape(codes, (words.shape[0], CODES_PER_WORD * CODE_WORDS))


@triton.jit
def e4m3_decode(codes, DTYPE: tl.constexpr):
    """OCP E4M3FN codes (an integer tensor; its low 8 bits) -> ``DTYPE`` (fp16 or fp32), exactly, with
    NaN for ``0x7F``/``0xFF`` (as :func:`sglang_nvfp4.format.e4m3_decode`).

    One hardware conversion when compiled (on Hopper ``cvt.rn.f16x2.e4m3x2``, two codes per
    instruction; NaN codes give NaN): uint8 codes go straight to fp16, the tiles' path. Triton's
    interpreter converts NaN codes to +-480, so there (only: ``INTERPRETED`` is a compile-time
    constant) they are replaced by NaN."""
    values = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
    if INTERPRETED:
        values = tl.where((codes & 0x7F) == 0x7F, float("nan"), values)
    return values


@triton.jit
def load_k_tile(cache_ptr, k_block, USE_PTX: tl.constexpr, FACTOR: tl.constexpr = 1.0):
    """K of one page and KV head -> fp16 ``[128 keys, 128 dims]`` / TILE_SCALE * FACTOR (:func:`decode_k_tile`).
    ``cache_ptr``: the uint8 cache; ``k_block``: the block's offset in 4-byte words (int64)."""
    words, scale_codes = load_k_codes(cache_ptr, k_block)
    return decode_k_tile(words, scale_codes, USE_PTX, FACTOR)


@triton.jit
def load_k_codes(cache_ptr, k_block):
    """The bytes of :func:`load_k_tile`, undecoded: code words uint32 ``[128 keys, 16]`` and E4M3 scale codes
    uint8 ``[128 keys, 8 groups]`` (a caller that loads one page ahead keeps these in registers)."""
    key = tl.arange(0, PAGE)[:, None]
    words = tl.load(cache_ptr.to(tl.pointer_type(tl.uint32)) + k_block + key * ROW_WORDS + tl.arange(0, CODE_WORDS)[None, :])
    scale_codes = tl.load(cache_ptr + 4 * k_block + key * ROW + SCALE_OFFSET + tl.arange(0, NUM_GROUPS)[None, :])
    return words, scale_codes


@triton.jit
def decode_k_tile(words, scale_codes, USE_PTX: tl.constexpr, FACTOR: tl.constexpr = 1.0):
    """:func:`load_k_codes`'s bytes -> fp16 ``[128 keys, 128 dims]`` / TILE_SCALE * FACTOR. ``FACTOR``, a power of
    two, multiplies the 8 scales of a key instead of its 128 values: the same bits (every product is exact in fp16,
    at most 2688 / TILE_SCALE * FACTOR), 64 fewer packed products per thread and tile."""
    scales = e4m3_decode(scale_codes, tl.float16)  # [keys, groups]
    if FACTOR != 1.0:
        scales = scales * FACTOR
    vals = tl.reshape(e2m1_words_to_fp16(words, USE_PTX), (PAGE, NUM_GROUPS, SCALE_GROUP))
    return tl.reshape(vals * scales[:, :, None], (PAGE, HEAD_DIM))


@triton.jit
def load_vt_tile(cache_ptr, v_block, key_live, USE_PTX: tl.constexpr):
    """V^T of one page and KV head -> fp16 ``[128 dims (vt_tile_dim order), 128 keys]`` / TILE_SCALE;
    keys where ``key_live [128]`` is false read as 0. ``v_block``: the block's offset in 4-byte words."""
    dims = vt_tile_dim(tl.arange(0, HEAD_DIM))[:, None]
    words = tl.load(cache_ptr.to(tl.pointer_type(tl.uint32)) + v_block + dims * ROW_WORDS + tl.arange(0, CODE_WORDS)[None, :])
    # The scale of token t, group g sits at row V_SCALE_ROWS_PER_GROUP * g + t // 8, byte SCALE_OFFSET + t % 8:
    # the 8 bytes after the codes of a row hold the scales of 8 consecutive tokens.
    group = tl.arange(0, NUM_GROUPS)[:, None]
    token = tl.arange(0, PAGE)[None, :]
    scale_rows = cache_ptr + 4 * v_block + (group * V_SCALE_ROWS_PER_GROUP + token // V_SCALES_PER_ROW) * ROW
    scales = e4m3_decode(tl.load(scale_rows + SCALE_OFFSET + token % V_SCALES_PER_ROW), tl.float16)  # [groups, keys]
    scales = tl.where(key_live[None, :], scales, 0.0)
    # Tile row 16k + 2g + b holds a dim of group g.
    vals = tl.reshape(e2m1_words_to_fp16(words, USE_PTX), (HEAD_DIM // 16, NUM_GROUPS, 2, PAGE))
    return tl.reshape(vals * scales[None, :, None, :], (HEAD_DIM, PAGE))


@triton.jit
def online_softmax_step(s, visible, logit_scale, m_i, l_i,
                        KEY_AXIS: tl.constexpr, ROWS_MAY_SEE_NOTHING: tl.constexpr):
    """Fold one page of scores into a running exp2 softmax; returns ``(p, alpha, m_new, l_new)``.

    ``s``: fp32 ``Q.K^T`` of the page (tile values, unscaled), keys on axis ``KEY_AXIS``: ``[rows, keys]``
    when 1 (prefill), ``[keys, rows]`` when 0 (decode's transposed products); ``visible``: bool,
    broadcastable to ``s``; ``logit_scale`` (> 0): maps ``s`` to base-2 logits; ``m_i``, ``l_i``: fp32
    ``[rows]`` running max (of the logits) and sum. ``p``: fp32 like ``s``, ``exp2(logit - m_new)`` (0 where not
    visible); the caller rescales its accumulator by ``alpha [rows]`` and adds ``P.V``. See :func:`fold_scores`.

    ``ROWS_MAY_SEE_NOTHING``: a row may have no visible key so far (its max stays ``-inf``): its
    exponentials are then taken against 0 instead, so that it keeps ``p = 0``, ``l = 0`` and no NaN.
    Decode passes False (every kept block's first key is visible to all rows), saving the select."""
    scores = tl.where(visible, s, float("-inf"))
    return fold_scores(scores, logit_scale, 0.0, m_i, l_i, KEY_AXIS, ROWS_MAY_SEE_NOTHING)


@triton.jit
def fold_scores(scores, logit_scale, bias, m_i, l_i, KEY_AXIS: tl.constexpr, ROWS_MAY_SEE_NOTHING: tl.constexpr):
    """The online-softmax step of every attention kernel, on logits ``scores * logit_scale + bias``.

    ``scores``: fp32, ``-inf`` at keys a row cannot see, keys on axis ``KEY_AXIS``; ``logit_scale``: fp32, positive
    and finite (a zero would turn the masked scores' ``-inf * 0`` into NaN: the plan checks numeric scales, a scale
    tensor is its caller's); ``bias``: 0, or fp32 ``[rows]`` of 0 / ``-inf`` (the Gluon prefill's rows that did not
    select a page, without a per-key mask; a ``-inf`` bias needs ``ROWS_MAY_SEE_NOTHING``, else ``bias - m`` is
    ``-inf - -inf``). Each exponent is one multiply-add, ``scores * logit_scale + (bias - m)``, and the row max of
    the logits is that of the scores, scaled: equal bit for bit, as multiplying by a positive number keeps the
    order. Returns ``(p, alpha, m_new, l_new)`` as :func:`online_softmax_step`."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=KEY_AXIS) * logit_scale + bias)
    if ROWS_MAY_SEE_NOTHING:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores * logit_scale + tl.expand_dims(bias - m_ref, KEY_AXIS))
    l_new = l_i * alpha + tl.sum(p, axis=KEY_AXIS)
    return p, alpha, m_new, l_new


@triton.jit
def merge_partials(m_a, l_a, acc_a, m_b, l_b, acc_b, DIM_AXIS: tl.constexpr):
    """Two softmax partials of the same rows over disjoint keys -> their union's ``(m, l, acc)``.

    ``m``, ``l``: fp32 running max (base 2) and sum per row; ``acc``: fp32 ``P.V`` of those rows, the output dims
    on axis ``DIM_AXIS`` (the ``m``/``l`` shapes broadcast along it). A partial that saw no key (``m = -inf``,
    ``l = 0``, ``acc = 0``) is the identity on either side, bit for bit (a zero's sign aside): the other's weight
    is ``exp2(0) = 1`` and this one's is 0. The split decode merges its pages' partials along a fixed tree with this one function,
    in the decode kernels and in :func:`.triton_decode.combine_splits` alike, so that where a merge runs
    changes no bit: the fused multiply-adds are written out, leaving the compiler nothing to contract."""
    m = tl.maximum(m_a, m_b)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(m_a - m_ref)
    w_b = tl.exp2(m_b - m_ref)
    l = tl.fma(l_a, w_a, l_b * w_b)
    w_a = tl.expand_dims(w_a, DIM_AXIS)
    w_b = tl.expand_dims(w_b, DIM_AXIS)
    return m, l, tl.fma(acc_a, w_a, acc_b * w_b)


@triton.jit
def normalize_and_store(out_rows, acc, l, out_scale, live, columns):
    """Write ``acc * out_scale / l`` to the output rows; rows with ``l == 0`` (no visible key) write 0.

    ``out_rows``: ``[rows]`` pointers to dim 0 of each row (q's dtype); ``acc``: fp32 ``[rows, C]``, its
    ``columns [C]`` of ``P.V`` with a V^T tile (column ``c`` holds output dim ``vt_tile_dim(c)``; all 128, or a
    slice); ``l``: fp32 ``[rows]``; ``live``: bool ``[rows]``, the rows to write."""
    norm = tl.where(l > 0, out_scale / tl.where(l > 0, l, 1.0), 0.0)
    dims = vt_tile_dim(columns)
    out = (acc * norm[:, None]).to(out_rows.dtype.element_ty)
    tl.store(out_rows[:, None] + dims[None, :], out, mask=live[:, None])
