"""Triton cache write: quantize ``k, v [N, Hkv, 128]`` to NVFP4 and scatter them to their slots,
bit for bit as :func:`sglang_nvfp4.format.write_kv` (for inputs without NaN); entry point
:func:`launch`, called by the dispatcher :mod:`sglang_nvfp4.kernels`. The encoders live here (only
this kernel encodes); the E4M3 decoder and the layout constants come from :mod:`.triton_common`.

Exactness: every fp32 step is the reference's, with correctly rounded divisions (``div_rn``; a plain
``/`` is approximate on CUDA); E4M3 rounding is done on the integer mantissa (round half to even),
E2M1 by the reference's own thresholds (``format.E2M1_THRESHOLDS``), and the scale divisor is the
exact decoded scale.

A V byte holds two tokens (even slot in the low nibble, odd slot in the high one). A prefill writes both
tokens of most bytes in one call, consecutive in the batch; a read-modify-write of each nibble by two programs
would race. So a prefill write takes up to three launches (:func:`launch`):

1. K of every token, and V of the **aligned pairs**: batch tokens ``2i, 2i + 1`` holding slots ``2b, 2b + 1``
   (one program holds both, so it writes byte ``b`` whole, with no read). A request whose first slot has the
   parity of its first batch index is all pairs: every request that starts a page, e.g. each one of a batch
   without cached prefixes of odd length.
2. and 3. V of the other tokens (a lone token, or a pair the batch order does not align), slots of even then odd
   parity, each nibble read, modified and written: inside a launch no two programs touch the same byte, and the
   byte's other nibble survives. Programs without such a token store nothing.

A caller that knows no two of its slots share a V byte (``slot // 2`` distinct: a decode step, one token per
request on its own pages) asks for one launch (``one_token_per_byte``): K, and V by read-modify-write. K and V
are written by separate programs (grid axis 2): decode writes a few tokens, so a launch's time is one program's
chain of loads, quantization and stores. Negative slots are skipped (padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as fmt
from .triton_common import (
    BLOCK_BYTES,
    CODE_BYTES,
    HEAD_DIM,
    NUM_GROUPS,
    PAGE,
    ROW,
    SCALE_GROUP,
    SCALE_OFFSET,
    V_SCALE_ROWS_PER_GROUP,
    V_SCALES_PER_ROW,
    e4m3_decode,
    global_scale,
)

E2M1_MAX = tl.constexpr(fmt.E2M1_MAX)
E4M3_MAX = tl.constexpr(fmt.E4M3_MAX)
# E2M1 rounding: threshold between consecutive magnitudes and whether a tie rounds up (to the even code).
(_T0, _U0), (_T1, _U1), (_T2, _U2), (_T3, _U3), (_T4, _U4), (_T5, _U5), (_T6, _U6) = (
    (tl.constexpr(t), tl.constexpr(up)) for t, up in fmt.E2M1_THRESHOLDS
)
TOKENS_PER_PROGRAM = 16  # even: a program holds both tokens of each aligned pair
ANY_PARITY = tl.constexpr(2)  # a PARITY that writes every slot


@triton.jit
def _past(a, THRESHOLD: tl.constexpr, TIE_UP: tl.constexpr):
    """1 where ``a`` rounds above ``THRESHOLD`` (ties included when ``TIE_UP``), as int32."""
    if TIE_UP:
        above = a >= THRESHOLD
    else:
        above = a > THRESHOLD
    return above.to(tl.int32)


@triton.jit
def e2m1_encode(x):
    """fp32 -> E2M1 code (int32 0..15): round to nearest, ties to even, saturating at +-6."""
    a = tl.abs(x)
    mag = (_past(a, _T0, _U0) + _past(a, _T1, _U1) + _past(a, _T2, _U2) + _past(a, _T3, _U3)
           + _past(a, _T4, _U4) + _past(a, _T5, _U5) + _past(a, _T6, _U6))
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 0x8
    return mag | sign


@triton.jit
def e4m3_encode(x):
    """fp32 -> OCP E4M3FN code (int32 0..255): round to nearest even on the integer mantissa,
    saturating at +-448, ``0x7F | sign`` for NaN."""
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), E4M3_MAX)
    bits = a.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127
    mant = (bits & 0x7FFFFF) | 0x800000
    e = tl.maximum(exp, -6)  # E4M3 subnormals share 2**-6's quantum 2**-9
    shift = tl.minimum(20 + e - exp, 31)  # keep 3 fraction bits at exponent e
    n = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    n += ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(tl.int32)
    code = (e + 6) * 8 + n  # n == 16 carries into the exponent
    code = tl.where(x != x, 0x7F, code)
    return code | sign


@triton.jit
def quantize_rows(x, gs):
    """fp32 ``[R, 128]`` -> (E2M1 codes int32 ``[R, 128]``, E4M3 scale codes int32 ``[R, 8]``)."""
    groups = tl.reshape(x, (x.shape[0], NUM_GROUPS, SCALE_GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    scale = e4m3_encode(tl.math.div_rn(tl.math.div_rn(amax, E2M1_MAX), gs))
    denom = e4m3_decode(scale, tl.float32) * gs
    safe = tl.where(denom == 0, 1.0, denom)
    codes = e2m1_encode(tl.math.div_rn(groups, safe[:, :, None]))
    codes = tl.where(denom[:, :, None] == 0, 0, codes)  # an all-zero group: scale 0, codes 0
    return tl.reshape(codes, (x.shape[0], HEAD_DIM)), scale


@triton.jit
def _write_k_rows(cache_ptr, k_ptr, k_scale, n, slot, active, stride_kn, stride_kh, kv_head,
                  HKV: tl.constexpr, K_SCALE_BY_POINTER: tl.constexpr):
    """K of the ``active`` tokens ``n`` (int32 ``[BLOCK_N]``) at ``slot``: row ``slot % 128`` of the head's K block,
    codes then scales (whole bytes: a K row is one token's)."""
    dims = tl.arange(0, HEAD_DIM)
    k_block = (slot // PAGE) * (2 * HKV * BLOCK_BYTES) + kv_head * BLOCK_BYTES
    x = tl.load(k_ptr + n.to(tl.int64)[:, None] * stride_kn + kv_head * stride_kh + dims[None, :],
                mask=active[:, None], other=0.0).to(tl.float32)
    codes, scales = quantize_rows(x, global_scale(k_scale, K_SCALE_BY_POINTER))
    even, odd = tl.split(tl.reshape(codes, (n.shape[0], CODE_BYTES, 2)))
    k_row = cache_ptr + k_block[:, None] + (slot % PAGE)[:, None] * ROW
    tl.store(k_row + tl.arange(0, CODE_BYTES)[None, :], (even | (odd << 4)).to(tl.uint8), mask=active[:, None])
    tl.store(k_row + SCALE_OFFSET + tl.arange(0, NUM_GROUPS)[None, :], scales.to(tl.uint8), mask=active[:, None])


@triton.jit
def _v_rows(v_ptr, v_scale, n, active, stride_vn, stride_vh, kv_head, V_SCALE_BY_POINTER: tl.constexpr):
    """V of the ``active`` tokens ``n``, quantized: E2M1 codes int32 ``[BLOCK_N, 128]``, scale codes
    ``[BLOCK_N, 8]``."""
    dims = tl.arange(0, HEAD_DIM)
    x = tl.load(v_ptr + n.to(tl.int64)[:, None] * stride_vn + kv_head * stride_vh + dims[None, :],
                mask=active[:, None], other=0.0).to(tl.float32)
    return quantize_rows(x, global_scale(v_scale, V_SCALE_BY_POINTER))


@triton.jit
def _store_v_scales(v_block, row, scales, active):
    """The V scales of the ``active`` tokens at page rows ``row``: group ``g``'s is byte ``SCALE_OFFSET + row % 8``
    of V^T row ``V_SCALE_ROWS_PER_GROUP * g + row // 8`` (a byte per token)."""
    groups = tl.arange(0, NUM_GROUPS)[None, :]
    scale_ptr = (v_block[:, None] + (groups * V_SCALE_ROWS_PER_GROUP + (row // V_SCALES_PER_ROW)[:, None]) * ROW
                 + SCALE_OFFSET + (row % V_SCALES_PER_ROW)[:, None])
    tl.store(scale_ptr, scales.to(tl.uint8), mask=active[:, None])


@triton.jit
def _write_v_pairs(cache_ptr, v_ptr, v_scale, n, slot, paired, stride_vn, stride_vh, kv_head,
                   HKV: tl.constexpr, V_SCALE_BY_POINTER: tl.constexpr):
    """V^T of the aligned pairs (``paired``: tokens ``2i, 2i + 1`` of the program at slots ``2b, 2b + 1``): dim ``d``
    of both is byte ``b % 64`` of row ``d``, written whole (even token's code in the low nibble)."""
    BLOCK_N: tl.constexpr = n.shape[0]
    codes, scales = _v_rows(v_ptr, v_scale, n, paired, stride_vn, stride_vh, kv_head, V_SCALE_BY_POINTER)
    v_block = cache_ptr + (slot // PAGE) * (2 * HKV * BLOCK_BYTES) + (HKV + kv_head) * BLOCK_BYTES
    _store_v_scales(v_block, slot % PAGE, scales, paired)
    low, high = tl.split(tl.permute(tl.reshape(codes, (BLOCK_N // 2, 2, HEAD_DIM)), (0, 2, 1)))
    pair_slot, _ = tl.split(tl.reshape(slot, (BLOCK_N // 2, 2)))
    pair_live, _ = tl.split(tl.reshape(paired.to(tl.int32), (BLOCK_N // 2, 2)))
    pair_block = cache_ptr + (pair_slot // PAGE) * (2 * HKV * BLOCK_BYTES) + (HKV + kv_head) * BLOCK_BYTES
    byte_ptr = pair_block[:, None] + tl.arange(0, HEAD_DIM)[None, :] * ROW + ((pair_slot % PAGE) // 2)[:, None]
    tl.store(byte_ptr, (low | (high << 4)).to(tl.uint8), mask=(pair_live != 0)[:, None])


@triton.jit
def _write_v_nibbles(cache_ptr, v_ptr, v_scale, n, slot, active, stride_vn, stride_vh, kv_head,
                     HKV: tl.constexpr, V_SCALE_BY_POINTER: tl.constexpr):
    """V^T of the ``active`` tokens one nibble at a time: dim ``d`` of the token at page row ``r`` is a nibble of
    byte ``r // 2`` of row ``d`` (low for an even ``r``), read, modified and written back."""
    codes, scales = _v_rows(v_ptr, v_scale, n, active, stride_vn, stride_vh, kv_head, V_SCALE_BY_POINTER)
    row = slot % PAGE
    v_block = cache_ptr + (slot // PAGE) * (2 * HKV * BLOCK_BYTES) + (HKV + kv_head) * BLOCK_BYTES
    _store_v_scales(v_block, row, scales, active)
    shift = (4 * (row % 2)).to(tl.int32)[:, None]
    byte_ptr = v_block[:, None] + tl.arange(0, HEAD_DIM)[None, :] * ROW + (row // 2)[:, None]
    old = tl.load(byte_ptr, mask=active[:, None], other=0).to(tl.int32)
    tl.store(byte_ptr, ((old & (0xF0 >> shift)) | (codes << shift)).to(tl.uint8), mask=active[:, None])


@triton.jit
def _write_kv_kernel(
    cache_ptr, slots_ptr, k_ptr, v_ptr, k_scale, v_scale,
    N, stride_kn, stride_kh, stride_vn, stride_vh,
    HKV: tl.constexpr, WRITE_K: tl.constexpr, V_PAIRS: tl.constexpr, PARITY: tl.constexpr, BLOCK_N: tl.constexpr,
    K_SCALE_BY_POINTER: tl.constexpr, V_SCALE_BY_POINTER: tl.constexpr,
):
    """Program (tokens, KV head, K or V): ``WRITE_K`` launches have K programs (axis 2 = 0) besides the V ones.
    V: ``V_PAIRS`` writes the aligned pairs only; otherwise the tokens outside aligned pairs whose slot has parity
    ``PARITY``, or with ``ANY_PARITY`` every token (the caller's slots share no V byte)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + n, mask=n < N, other=-1).to(tl.int64)
    active = slot >= 0
    is_k = False
    if WRITE_K:
        is_k = tl.program_id(2) == 0
    if is_k:
        _write_k_rows(cache_ptr, k_ptr, k_scale, n, slot, active, stride_kn, stride_kh, kv_head, HKV,
                      K_SCALE_BY_POINTER)
    else:
        if PARITY != ANY_PARITY:
            # Aligned pair: token n and its batch neighbour n ^ 1 (same program) hold the two slots of one V byte,
            # the even slot at the even index.
            partner = tl.load(slots_ptr + (n ^ 1), mask=(n ^ 1) < N, other=-1).to(tl.int64)
            paired = active & (partner >= 0) & ((slot ^ 1) == partner) & ((slot % 2) == (n % 2))
        if V_PAIRS:
            _write_v_pairs(cache_ptr, v_ptr, v_scale, n, slot, paired, stride_vn, stride_vh, kv_head, HKV,
                           V_SCALE_BY_POINTER)
        else:
            if PARITY != ANY_PARITY:
                active = active & ~paired & (slot % 2 == PARITY)
            if tl.max(active.to(tl.int32), axis=0) > 0:
                _write_v_nibbles(cache_ptr, v_ptr, v_scale, n, slot, active, stride_vn, stride_vh, kv_head, HKV,
                                 V_SCALE_BY_POINTER)


def launch(cache, slots, k, v, k_scale, v_scale, one_token_per_byte: bool = False) -> None:
    """Cache write (:func:`sglang_nvfp4.kernels.write_kv`): the pair launch and the two parity launches (module
    docstring), or one launch with ``one_token_per_byte`` (the caller's promise that no two slots share a V byte,
    ``slot // 2``); arguments as validated by the dispatcher.

    ``cache``: uint8 ``[pages, 2 * Hkv, 128, 72]``, written in place; ``slots [N]`` int32/int64 distinct
    (negative: skipped); ``k, v [N, Hkv, 128]`` (bf16/fp16/fp32) with unit stride in the last dim;
    scales: floats or one-element fp32 tensors on the cache's device."""
    n = slots.shape[0]
    if n == 0:
        return
    hkv = cache.shape[1] // 2
    slots = slots.contiguous()
    # (WRITE_K, V_PAIRS, PARITY) per launch
    passes = [(True, False, ANY_PARITY.value)] if one_token_per_byte else [(True, True, 0), (False, False, 0),
                                                                            (False, False, 1)]
    for write_k, v_pairs, parity in passes:
        _write_kv_kernel[(triton.cdiv(n, TOKENS_PER_PROGRAM), hkv, 2 if write_k else 1)](
            cache, slots, k, v, k_scale, v_scale,
            n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            HKV=hkv, WRITE_K=write_k, V_PAIRS=v_pairs, PARITY=parity, BLOCK_N=TOKENS_PER_PROGRAM,
            K_SCALE_BY_POINTER=isinstance(k_scale, torch.Tensor), V_SCALE_BY_POINTER=isinstance(v_scale, torch.Tensor),
            num_warps=4,
        )
