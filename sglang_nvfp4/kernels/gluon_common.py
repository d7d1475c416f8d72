"""Shared Gluon building blocks of the Hopper kernels (:mod:`.gluon_prefill`, :mod:`.gluon_decode`): the page
decoders, in inline PTX, from packed E2M1 code words and their E4M3 scales to fp16.

A value comes out as ``e2m1 * e4m3 / TILE_SCALE`` (exact in fp16; see :mod:`.triton_common`, whose
E2M1 -> E4M3 rewrite ``E2M1_WORD_TO_F16X2_PTX`` both use): the codes of one little-endian 32-bit word, 8 values,
are converted two at a time (``cvt.rn.f16x2.e4m3x2``) and multiplied by their scales on packed halves
(``mul.rn.f16x2``); the scales are converted to fp16x2 operands apart from the words, once for all the words they
scale. The callers choose the thread layout of the words, and so where each decoded value lands:
the prefill stages tiles in shared memory in code order, the decode puts them straight into wgmma's register
operand layout.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .. import format as fmt
from .triton_common import E2M1_WORD_TO_E4M3_PLANES_PTX, E2M1_WORD_TO_F16X2_PTX

SCALE_WORD = gl.constexpr(fmt.SCALE_OFFSET // 4)  # a row's 8 scale bytes, as 2 little-endian words from this word on

# One code word ($8) and the scale operands of its four code pairs ($9..$12, fp16x2) in, 8 fp16 values out in code
# order ($0..$7). The scales come in already converted: a scale serves several words (K: the 2 words of a group;
# V^T: one token octet in the 16 dims of a group), and converting them inside each word's decoder took 80 of the
# 200 conversions per page and thread of the prefill's producer.
_WORD_PTX = gl.constexpr("""{
.reg .b32 e, o, t, a, b, p0, p1, p2, p3;
.reg .b16 h0, h1;""" + E2M1_WORD_TO_F16X2_PTX + """
mul.rn.f16x2 p0, p0, $9; mul.rn.f16x2 p1, p1, $10; mul.rn.f16x2 p2, p2, $11; mul.rn.f16x2 p3, p3, $12;
mov.b32 {$0, $1}, p0; mov.b32 {$2, $3}, p1; mov.b32 {$4, $5}, p2; mov.b32 {$6, $7}, p3;
}""")
# K: the scale byte (the low byte of $1) in both halves of one fp16x2 operand ($0).
_K_SCALE_PTX = gl.constexpr("""{
.reg .b32 a;
.reg .b16 h0, h1;
prmt.b32 a, $1, 0, 0x0000; mov.b32 {h0, h1}, a; cvt.rn.f16x2.e4m3x2 $0, h0;
}""")
# The same decoder without the byte interleave: the planes are converted as they are, so the pairs are codes (0, 2),
# (4, 6), (1, 3), (5, 7) ($9..$12 their scale operands), 2 instructions fewer per word; out $0..$7 = codes 0, 2, 4,
# 6, 1, 3, 5, 7.
_WORD_PLANES_PTX = gl.constexpr("""{
.reg .b32 e, o, t, p0, p1, p2, p3;
.reg .b16 h0, h1;""" + E2M1_WORD_TO_E4M3_PLANES_PTX + """
mov.b32 {h0, h1}, e; cvt.rn.f16x2.e4m3x2 p0, h0; cvt.rn.f16x2.e4m3x2 p1, h1;
mov.b32 {h0, h1}, o; cvt.rn.f16x2.e4m3x2 p2, h0; cvt.rn.f16x2.e4m3x2 p3, h1;
mul.rn.f16x2 p0, p0, $9; mul.rn.f16x2 p1, p1, $10; mul.rn.f16x2 p2, p2, $11; mul.rn.f16x2 p3, p3, $12;
mov.b32 {$0, $1}, p0; mov.b32 {$2, $3}, p1; mov.b32 {$4, $5}, p2; mov.b32 {$6, $7}, p3;
}""")
# V^T: the 8 token scales of an octet (bytes of $4, then of $5) as the operands of its 4 code pairs ($0..$3).
_VT_SCALES_PTX = gl.constexpr("""{
.reg .b16 h0, h1;
mov.b32 {h0, h1}, $4; cvt.rn.f16x2.e4m3x2 $0, h0; cvt.rn.f16x2.e4m3x2 $1, h1;
mov.b32 {h0, h1}, $5; cvt.rn.f16x2.e4m3x2 $2, h0; cvt.rn.f16x2.e4m3x2 $3, h1;
}""")


@gluon.jit
def k_scale_operand(scale_bytes):
    """K scales (uint32 tensor, the E4M3 byte in the low byte, any shape and layout) -> the fp16x2 operand
    (uint32 tensor like it) that :func:`decode_words` takes for every code pair of the words of that group."""
    return gl.inline_asm_elementwise(_K_SCALE_PTX, "=r,r", [scale_bytes], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def times_f16x2(operands, factor):
    """fp16x2 operands (uint32 tensor) times an fp16x2 ``factor`` (uint32 tensor or scalar of the same bits), per
    half (``mul.rn.f16x2``): e.g. a power of two folded into :func:`k_scale_operand`'s scales."""
    return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [operands, factor], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def vt_scale_operands(lo, hi):
    """V^T scales of token octets (two uint32 tensors: the E4M3 scales of tokens 0..3 and 4..7, byte ``i`` for
    token ``i``) -> the 4 fp16x2 operands (tokens 0-1, 2-3, 4-5, 6-7) that :func:`decode_words` takes for the
    words of that octet."""
    return gl.inline_asm_elementwise(_VT_SCALES_PTX, "=r,=r,=r,=r,r,r", [lo, hi], dtype=(gl.uint32,) * 4,
                                     is_pure=True, pack=1)


# V^T scales for :data:`_WORD_PLANES_PTX`'s pairs: tokens (0, 2), (4, 6), (1, 3), (5, 7) ($0..$3) from the octet's
# two scale words ($4: tokens 0-3, $5: 4-7; byte permute 0x3120 puts tokens 0, 2 in the low half), each then
# passed through ``min.f16x2`` with 448 (the largest E4M3 value), which returns the other input where one is NaN.
_VT_PLANE_SCALES_FINITE_PTX = gl.constexpr("""{
.reg .b16 h0, h1;
.reg .b32 a, top;
mov.b32 top, 0x5F005F00;
prmt.b32 a, $4, 0, 0x3120; mov.b32 {h0, h1}, a; cvt.rn.f16x2.e4m3x2 $0, h0; cvt.rn.f16x2.e4m3x2 $2, h1;
prmt.b32 a, $5, 0, 0x3120; mov.b32 {h0, h1}, a; cvt.rn.f16x2.e4m3x2 $1, h0; cvt.rn.f16x2.e4m3x2 $3, h1;
min.f16x2 $0, $0, top; min.f16x2 $1, $1, top; min.f16x2 $2, $2, top; min.f16x2 $3, $3, top;
}""")


@gluon.jit
def vt_plane_scale_operands_finite(lo, hi):
    """V^T scales of token octets (as :func:`vt_scale_operands` takes them) -> the 4 fp16x2 operands that
    :func:`decode_word_planes` takes for the words of that octet, with every NaN scale (an E4M3 NaN code) replaced
    by 448, the largest E4M3 value, and every other scale unchanged. For callers whose keys with such scale bytes
    get no weight (``p = 0``, their logits masked to ``-inf``): their values then stay finite, so ``p * v`` is 0
    instead of NaN. Cheaper than zeroing those keys' scales with :func:`live_token_masks` page by page."""
    return gl.inline_asm_elementwise(_VT_PLANE_SCALES_FINITE_PTX, "=r,=r,=r,=r,r,r", [lo, hi],
                                     dtype=(gl.uint32,) * 4, is_pure=True, pack=1)


@gluon.jit
def decode_words(words, scales):
    """uint32 code words (any shape ``S``, any layout) and the 4 fp16x2 scale operands of their code pairs (a tuple
    of uint32 tensors that broadcast to ``words``: :func:`k_scale_operand` four times, or
    :func:`vt_scale_operands`) -> fp16 ``S + [2, 2, 2]``: code ``4a + 2b + c`` of each word at ``[a, b, c]``, in
    registers of the thread that holds the word. Operands broadcast along axes of ``words`` are converted once
    and shared by the words."""
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        _WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [words, scales[0], scales[1], scales[2], scales[3]],
        dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return gl.join(gl.join(gl.join(c0, c4), gl.join(c2, c6)), gl.join(gl.join(c1, c5), gl.join(c3, c7)))


@gluon.jit
def decode_word_planes(words, scales):
    """:func:`decode_words` with the pairs of the fp16x2 registers two codes apart (:data:`_WORD_PLANES_PTX`, 2
    instructions fewer per word), for a caller that may contract over its own order of the codes: ``scales`` are the
    operands of the pairs (0, 2), (4, 6), (1, 3), (5, 7) (:func:`k_scale_operand` four times, or
    :func:`vt_plane_scale_operands_finite`) -> fp16 ``S + [2, 2, 2]``: code ``4x + y + 2z`` of each word at
    ``[x, y, z]``, so that the last axis holds the two codes of one register."""
    c0, c2, c4, c6, c1, c3, c5, c7 = gl.inline_asm_elementwise(
        _WORD_PLANES_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [words, scales[0], scales[1], scales[2], scales[3]],
        dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return gl.join(gl.join(gl.join(c0, c4), gl.join(c1, c5)), gl.join(gl.join(c2, c6), gl.join(c3, c7)))


@gluon.jit
def live_token_masks(octet, live_keys):
    """Byte masks for the two scale words of each V^T token octet: byte ``j`` of the first (second) word is kept
    when token ``8 * octet + j`` (``+ 4``) is below ``live_keys`` (the page's keys some reader can see).

    Keys no reader sees must get no weight even when their bytes are E4M3 NaN codes: their scales are zeroed.
    ``octet``: int32 tensor; returns two uint32 tensors like it."""
    lo_mask = gl.full_like(octet, 0, dtype=gl.uint32)
    hi_mask = gl.full_like(octet, 0, dtype=gl.uint32)
    byte = gl.full_like(octet, 0xFF, dtype=gl.uint32)
    for j in gl.static_range(4):
        lo_mask = lo_mask | gl.where(octet * 8 + j < live_keys, byte << (8 * j), 0)
        hi_mask = hi_mask | gl.where(octet * 8 + 4 + j < live_keys, byte << (8 * j), 0)
    return lo_mask, hi_mask
