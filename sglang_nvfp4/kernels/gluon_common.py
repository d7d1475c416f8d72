"""Shared Gluon building blocks of the Hopper kernels (:mod:`.gluon_prefill`, :mod:`.gluon_decode`): the page
decoders, in inline PTX, from packed E2M1 code words and their E4M3 scales to fp16.

A value comes out as ``e2m1 * e4m3 / TILE_SCALE`` (exact in fp16; see :mod:`.triton_common`, whose
E2M1 -> E4M3 rewrite ``E2M1_WORD_TO_F16X2_PTX`` both use): the codes of one little-endian 32-bit word, 8 values,
are converted two at a time (``cvt.rn.f16x2.e4m3x2``) and multiplied by their scales on packed halves
(``mul.rn.f16x2``). The callers choose the thread layout of the words, and so where each decoded value lands:
the prefill stages tiles in shared memory in code order, the decode puts them straight into wgmma's register
operand layout.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .. import format as fmt
from .triton_common import E2M1_WORD_TO_F16X2_PTX

SCALE_WORD = gl.constexpr(fmt.SCALE_OFFSET // 4)  # a row's 8 scale bytes, as 2 little-endian words from this word on

# One code word ($8) and its scale operands ($9; V^T also $10) in, 8 fp16 values out in code order ($0..$7).
_CODES_TO_E4M3 = """
.reg .b32 e, o, t, a, b, p0, p1, p2, p3, s0, s1, s2, s3;
.reg .b16 h0, h1;""" + E2M1_WORD_TO_F16X2_PTX
_SCALED_OUT = """
mul.rn.f16x2 p0, p0, s0; mul.rn.f16x2 p1, p1, s1; mul.rn.f16x2 p2, p2, s2; mul.rn.f16x2 p3, p3, s3;
mov.b32 {$0, $1}, p0; mov.b32 {$2, $3}, p1; mov.b32 {$4, $5}, p2; mov.b32 {$6, $7}, p3;
"""
# K: the 8 codes of a word (8 dims of one key) share one scale, the low byte of $9, broadcast to both halves.
_K_WORD_PTX = gl.constexpr("{" + _CODES_TO_E4M3 + """
prmt.b32 a, $9, 0, 0x0000;
mov.b32 {h0, h1}, a; cvt.rn.f16x2.e4m3x2 s0, h0; mov.b32 s1, s0; mov.b32 s2, s0; mov.b32 s3, s0;
""" + _SCALED_OUT + "}")
# V^T: code i of a word is token i of an octet (8 tokens of one dim), with its own scale: bytes 0..3 of $9, of $10.
_V_WORD_PTX = gl.constexpr("{" + _CODES_TO_E4M3 + """
mov.b32 {h0, h1}, $9; cvt.rn.f16x2.e4m3x2 s0, h0; cvt.rn.f16x2.e4m3x2 s1, h1;
mov.b32 {h0, h1}, $10; cvt.rn.f16x2.e4m3x2 s2, h0; cvt.rn.f16x2.e4m3x2 s3, h1;
""" + _SCALED_OUT + "}")


@gluon.jit
def decode_words(words, scales):
    """uint32 code words (any shape ``S``, any layout) and their scale operands (a tuple of uint32 tensors like
    ``words``: K, the scale byte of each word in the low byte; V^T, the 8 token scales of each word as two
    words) -> fp16 ``S + [2, 2, 2]``: code ``4a + 2b + c`` of each word at ``[a, b, c]``, in registers of the
    thread that holds the word."""
    if len(scales) == 1:
        c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
            _K_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, scales[0]],
            dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    else:
        c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
            _V_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, scales[0], scales[1]],
            dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return gl.join(gl.join(gl.join(c0, c4), gl.join(c2, c6)), gl.join(gl.join(c1, c5), gl.join(c3, c7)))


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
