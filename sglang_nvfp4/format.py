"""NVFP4 KV-cache format: the one home of the cache layout.

Every other module (kernels, reference, indexer, SGLang pool, tests) imports the constants and
helpers below instead of restating offsets.

Number formats
--------------
* E2M1 (FP4): 1 sign bit (bit 3), 2 exponent bits, 1 mantissa bit. Magnitudes by code 0..7:
  0, 0.5, 1, 1.5, 2, 3, 4, 6. Encoding rounds to the nearest value, ties to the even code, and
  saturates at +-6. ``-0`` (code 8) is produced for negative inputs that round to zero.
* E4M3 (OCP E4M3FN): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448, no infinities,
  ``0x7F``/``0xFF`` are NaN; subnormals down to 2**-9. Encoding is round-to-nearest-even and
  saturating (``|x| > 448`` and +-inf give +-448; NaN gives ``0x7F | sign``).

NVFP4 quantization of a 128-dim vector ``x`` with a fp32 global scale ``gs``
---------------------------------------------------------------------------
For each group of ``SCALE_GROUP = 16`` consecutive dims (8 groups), in fp32:
``scale_code = e4m3(amax(|x_group|) / 6 / gs)`` and ``code_i = e2m1(x_i / (e4m3_value(scale_code) * gs))``
(a zero ``e4m3_value * gs`` gives codes 0). Decoding: ``e2m1_value(code) * e4m3_value(scale) * gs``.
Two codes share a byte: the even element in the low nibble, the odd one in the high nibble.
Note ``e2m1_value * e4m3_value`` is exact in fp16 (<= 6 significant bits, |v| <= 2688, >= 2**-10),
which is why kernels dequantize to fp16 and fold ``gs`` into a scalar.

Cache layout, per layer
-----------------------
``uint8 [num_pages, 2 * Hkv, PAGE_SIZE = 128, ROW_BYTES = 72]``. One page holds 128 consecutive
tokens of one request. For KV head ``h``:

* index ``h`` holds K. Row ``r`` is token ``r`` of the page: bytes ``0..63`` are the E2M1 codes of
  dims ``2b`` (low nibble) and ``2b+1`` (high nibble) of byte ``b``; bytes ``64..71`` are the E4M3
  scales of dims ``[16g, 16g+16)`` for ``g = 0..7``.
* index ``Hkv + h`` holds V transposed. Row ``d`` is dim ``d``: bytes ``0..63`` are the E2M1 codes
  of tokens ``2b`` (low) and ``2b+1`` (high) for that dim. V is quantized per token like K (scale
  per token ``t`` and dim group ``g``); that scale lives at row ``16*g + t // 8``, byte ``64 + t % 8``.

Why this layout (the access pattern of the FlyDSL gfx950 kernel, :mod:`sglang_nvfp4.kernels.flydsl`)
-------------------------------------------------------------------------------------------------
A workgroup has 4 waves; wave ``w`` owns keys ``[32w, 32w+32)`` of a page. In
``v_mfma_f32_16x16x32_f16`` lane ``(n, g) = (lane % 16, lane // 16)`` holds 8 consecutive k-elements
``8g..8g+7`` of row ``n`` of the A operand.

* S = K . Q^T: Q is loaded so that in k-step ``ks`` lane ``g`` holds dims ``32g + 8ks .. +7``.
  The lane's K row therefore needs dims ``[32g, 32g+32)`` = bytes ``[16g, 16g+16)``: **one 16-byte
  read** per key row, and the two scales of groups ``2g, 2g+1`` = bytes ``64+2g, 65+2g`` of the same
  row. K rows being tokens makes every read contiguous.
* O^T += V^T . P: P leaves the S mfma with lane ``(n, g)`` holding keys ``8g..8g+7`` of the wave, so
  the V^T operand lane needs those 8 keys of one dim: with V stored transposed they are **4
  consecutive bytes** of one row, already in the (low, high) = (even, odd key) order of an fp16 pair.
  The output tiles are arranged so that a lane's 8 d-tiles are dims ``32(n//4) + 8(n%4) + dt``,
  all in scale group ``G = 2(n//4) + (n%4)//2``; the lane's 8 keys are tokens
  ``t = 32w + 8g .. +7``, so ``t // 8 = 4w + g`` and their 8 scales are the **8 contiguous bytes**
  ``64..71`` of row ``16*G + t//8``. That is why V scales sit at row ``16*g + t//8``, byte ``64 + t%8``.
  The 64 code bytes of a row plus 8 scale bytes make the 72-byte row for both K and V.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch

PAGE_SIZE = 128  # tokens per page (= one logical block of the sparse selection)
HEAD_DIM = 128  # dims per head
ROW_BYTES = 72  # bytes per cache row: 64 code bytes + 8 scale bytes
SCALE_GROUP = 16  # elements sharing one E4M3 block scale
TOPK = 16  # the kernels' narrowest selection width: FlyDSL's fixed one, the backend pads narrower ones to it
MAX_TOPK = 64  # the largest budget the Triton kernels and the indexers are tested with

CODE_BYTES = HEAD_DIM // 2  # 64: two E2M1 codes per byte
SCALE_OFFSET = CODE_BYTES  # scales start at byte 64 of a row
NUM_GROUPS = HEAD_DIM // SCALE_GROUP  # 8 scale groups per 128-vector
V_SCALE_ROWS_PER_GROUP = PAGE_SIZE // 8  # 16 rows of 8 scale bytes hold one group's 128 token scales

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BYTES_PER_TOKEN_PER_HEAD = 2 * ROW_BYTES  # K row + V share (128 rows * 72 B / 128 tokens): 144 B
BF16_BYTES_PER_TOKEN_PER_HEAD = 2 * HEAD_DIM * 2  # 512 B

# E2M1 magnitudes by 3-bit code (for the reference paths; kernels decode with bit arithmetic).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between consecutive magnitudes, and whether a tie rounds up (to the even code).
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (any float dtype) to E2M1 codes ``uint8`` (values 0..15), RNE, saturating at +-6.

    NaN encodes as a signed zero."""
    a = x.float().abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for threshold, tie_up in E2M1_THRESHOLDS:
        mag += (a >= threshold if tie_up else a > threshold).to(torch.uint8)
    return mag | (torch.signbit(x.float()).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) -> float32 values."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.long()
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to OCP E4M3FN codes ``uint8``: round-to-nearest-even, saturating at +-448."""
    xf = x.float()
    sign = torch.signbit(xf).to(torch.uint8) << 7
    a = xf.abs().clamp(max=E4M3_MAX)  # +inf saturates; NaN stays NaN
    _, exp = torch.frexp(a)  # a = m * 2**exp, m in [0.5, 1)
    e = torch.where(a >= 2.0**-6, exp - 1, torch.full_like(exp, -6))  # subnormals share 2**-6's quantum
    quantum = torch.ldexp(torch.ones_like(a), (e - 3).float())
    n = torch.round(torch.where(torch.isnan(a), torch.zeros_like(a), a) / quantum)  # exact division, RNE
    code = ((e + 6) * 8 + n.int()).clamp(max=0x7E).to(torch.uint8)  # n == 16 carries into the exponent
    code = torch.where(torch.isnan(a), torch.full_like(code, 0x7F), code)
    return code | sign


def e4m3_decode(u8: torch.Tensor) -> torch.Tensor:
    """OCP E4M3FN codes (uint8) -> float32 (``0x7F``/``0xFF`` -> NaN)."""
    b = u8.int()
    e = (b >> 3) & 0xF
    m = (b & 7).float()
    normal = torch.ldexp(8.0 + m, (e - 10).float())
    sub = m * 2.0**-9
    mag = torch.where(e == 0, sub, normal)
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def global_scale(scale, device=None, *, name: str = "global scale", as_tensor: bool = False) -> float | torch.Tensor:
    """The one normaliser of a layer's fp32 global K/V scale, for the reference, the kernels and the pools.

    A real number becomes a ``float`` holding its fp32 rounding (the value the kernels compute with). A
    one-element floating tensor becomes fp32 of shape ``[1]`` on ``device`` (its own device when
    ``None``): kernels read such a scale through a pointer, which keeps CUDA graphs free of host syncs;
    ``as_tensor`` makes a number such a tensor too. A number must be positive and finite in fp32 (a tensor's value is
    not checked: that would sync the host); anything else raises ``ValueError`` naming ``name``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a float or a one-element float tensor, got {scale.dtype} {tuple(scale.shape)}")
        return scale.detach().reshape(1).to(device=scale.device if device is None else device, dtype=torch.float32)
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise ValueError(f"{name}: expected a float or a one-element float tensor, got {type(scale).__name__}")
    value = positive_fp32(scale, name)
    return torch.full((1,), value, dtype=torch.float32, device=device) if as_tensor else value


def positive_fp32(value, name: str) -> float:
    """The one check of a scalar scale the kernels take in fp32 (global K/V scales, ``sm_scale``): a real number
    (not a bool) whose fp32 rounding is positive and finite, returned as that rounding; else ``ValueError`` naming
    ``name``. Positive because the scales divide the values and the kernels take each row's max of the unscaled
    scores (``max(s) * scale`` is the max of the logits only for a scale > 0)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a positive finite number, got {type(value).__name__} {value!r}")
    try:
        rounded = struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:  # beyond fp32's range
        rounded = math.inf
    if not (math.isfinite(rounded) and rounded > 0):
        raise ValueError(f"{name}: expected a positive finite fp32 number, got {value!r}")
    return rounded


def quantize_nvfp4(x: torch.Tensor, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., 128]`` -> ``(packed[..., 64] uint8, scales[..., 8] uint8)``; see the module docstring."""
    if x.shape[-1] != HEAD_DIM:
        raise ValueError(f"x: last dim must be {HEAD_DIM}, got shape {tuple(x.shape)}")
    gs = global_scale(scale, x.device, as_tensor=True)  # a tensor: CUDA divides by host scalars via reciprocals
    groups = x.float().reshape(*x.shape[:-1], NUM_GROUPS, SCALE_GROUP)
    amax = groups.abs().amax(dim=-1)
    scales = e4m3_encode(amax / 6.0 / gs)
    denom = (e4m3_decode(scales) * gs).unsqueeze(-1)
    codes = e2m1_encode(groups / denom)
    codes = torch.where(denom == 0, torch.zeros_like(codes), codes).reshape(*x.shape[:-1], HEAD_DIM)
    return pack_nibbles(codes), scales


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, scale) -> torch.Tensor:
    """``(packed[..., 64], scales[..., 8])`` uint8 -> float32 ``[..., 128]``."""
    gs = global_scale(scale, packed.device, as_tensor=True)
    vals = e2m1_decode(unpack_nibbles(packed)).reshape(*packed.shape[:-1], NUM_GROUPS, SCALE_GROUP)
    return (vals * e4m3_decode(scales).unsqueeze(-1) * gs).reshape(*packed.shape[:-1], HEAD_DIM)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., 2n]`` -> bytes ``[..., n]`` (even element in the low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., n]`` -> uint8 codes ``[..., 2n]`` (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def alloc_cache(num_pages: int, num_kv_heads: int, device=None) -> torch.Tensor:
    """A zeroed cache ``uint8 [num_pages, 2 * num_kv_heads, 128, 72]`` for one layer."""
    if num_pages < 0 or num_kv_heads <= 0:
        raise ValueError(f"alloc_cache: need num_pages >= 0 and num_kv_heads > 0, got {num_pages}, {num_kv_heads}")
    return torch.zeros(num_pages, 2 * num_kv_heads, PAGE_SIZE, ROW_BYTES, dtype=torch.uint8, device=device)


def check_cache(cache: torch.Tensor, name: str = "cache") -> int:
    """Validate a layer's cache tensor; returns its number of KV heads."""
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[2:] != (PAGE_SIZE, ROW_BYTES) or cache.shape[1] % 2:
        raise ValueError(
            f"{name}: expected uint8 [pages, 2*Hkv, {PAGE_SIZE}, {ROW_BYTES}], got {cache.dtype} {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return cache.shape[1] // 2


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale, v_scale, *,
             one_token_per_byte: bool = False) -> None:
    """Quantize ``k, v [N, Hkv, 128]`` and scatter them to ``slot = page * 128 + row``, in place.

    Only the written tokens' bytes change: a V byte shared with a neighbour token keeps its nibble.
    ``slots`` must be distinct and inside the cache (checked: this is the reference path). With
    ``one_token_per_byte`` the caller also promises that no two slots share a V byte (``slot // 2``
    distinct; the kernels then write in one launch): checked here too."""
    hkv = check_cache(cache)
    n = check_slots(slots, cache.shape[0] * PAGE_SIZE, distinct=True)
    if one_token_per_byte and n and torch.unique(slots // 2).numel() != n:
        raise ValueError("slots: one_token_per_byte, but two slots share a V byte (slot // 2)")
    for name, t in (("k", k), ("v", v)):
        if t.shape != (n, hkv, HEAD_DIM):
            raise ValueError(f"{name}: expected shape {(n, hkv, HEAD_DIM)}, got {tuple(t.shape)}")
    if n == 0:
        return
    k_packed, k_sc = quantize_nvfp4(k.to(cache.device), k_scale)
    v_packed, v_sc = quantize_nvfp4(v.to(cache.device), v_scale)
    _scatter_records(cache, slots, torch.cat((k_packed, k_sc, v_packed, v_sc), dim=-1))


def check_slots(slots: torch.Tensor, capacity: int | None = None, *, distinct: bool = False) -> int:
    """The one validation of token slots (``page * 128 + row``): int32/int64 ``[N]``; with ``capacity``
    also values in ``[0, capacity)`` (a device sync), with ``distinct`` no repeats. Returns ``N``;
    ``ValueError`` otherwise."""
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots: expected int32/int64 [N], got {slots.dtype} {tuple(slots.shape)}")
    n = slots.shape[0]
    if n and capacity is not None:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(f"slots: values must be in [0, {capacity}), got min {lo} max {hi}")
    if n and distinct and torch.unique(slots).numel() != n:
        raise ValueError("slots: must be distinct")
    return n


# A token's bytes, gathered from the layout into one record per KV head: its K row (codes and
# scales), its V codes for dims 0..127 (two per byte, even dim low) and its 8 V scales.
TOKEN_RECORD_BYTES = ROW_BYTES + CODE_BYTES + NUM_GROUPS  # 144


def _token_index(cache: torch.Tensor, slots: torch.Tensor):
    """Advanced indices of every byte a token owns: K row, V code bytes (+ nibble shift), V scales."""
    hkv = cache.shape[1] // 2
    slots = slots.to(cache.device).long()
    page, row = slots // PAGE_SIZE, slots % PAGE_SIZE
    heads = torch.arange(hkv, device=cache.device)
    k_idx = (page[:, None], heads[None, :], row[:, None])  # -> [N, Hkv, 72]
    v_heads = (hkv + heads)[None, :, None]
    dims = torch.arange(HEAD_DIM, device=cache.device)[None, None, :]
    v_code_idx = (page[:, None, None], v_heads, dims, (row // 2)[:, None, None])  # -> [N, Hkv, 128]
    groups = torch.arange(NUM_GROUPS, device=cache.device)[None, None, :]
    scale_rows = V_SCALE_ROWS_PER_GROUP * groups + (row // 8)[:, None, None]
    v_scale_idx = (page[:, None, None], v_heads, scale_rows, (SCALE_OFFSET + row % 8)[:, None, None])  # -> [N, Hkv, 8]
    return k_idx, v_code_idx, v_scale_idx, row


def read_token_records(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The bytes of the tokens at ``slots``: ``uint8 [N, Hkv, TOKEN_RECORD_BYTES]`` (exact, no requantization)."""
    check_cache(cache)
    k_idx, v_code_idx, v_scale_idx, row = _token_index(cache, slots)
    v_codes = (cache[v_code_idx] >> (4 * (row % 2)).to(torch.uint8)[:, None, None]) & 0xF
    return torch.cat((cache[k_idx], pack_nibbles(v_codes), cache[v_scale_idx]), dim=-1)


def write_token_records(cache: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> None:
    """Inverse of :func:`read_token_records`: put whole tokens back (moves, offload restore), in place."""
    hkv = check_cache(cache)
    n = check_slots(slots, cache.shape[0] * PAGE_SIZE, distinct=True)
    if records.dtype != torch.uint8 or records.shape != (n, hkv, TOKEN_RECORD_BYTES):
        raise ValueError(f"records: expected uint8 {(n, hkv, TOKEN_RECORD_BYTES)}, got {records.dtype} {tuple(records.shape)}")
    if n:
        _scatter_records(cache, slots, records.to(cache.device))


def _scatter_records(cache: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> None:
    slots = slots.to(cache.device)
    k_idx, _, v_scale_idx, row = _token_index(cache, slots)
    cache[k_idx] = records[..., :ROW_BYTES]
    cache[v_scale_idx] = records[..., ROW_BYTES + CODE_BYTES :]
    v_codes = unpack_nibbles(records[..., ROW_BYTES : ROW_BYTES + CODE_BYTES])  # [N, Hkv, 128 dims]
    for parity in (0, 1):  # even rows, then odd rows: the two tokens of a byte never race
        sel = (row % 2) == parity
        v_code_idx = _token_index(cache, slots[sel])[1]
        keep = 0xF0 if parity == 0 else 0x0F
        cache[v_code_idx] = (cache[v_code_idx] & keep) | (v_codes[sel] << (4 * parity))


def read_kv(cache: torch.Tensor, pages: torch.Tensor, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize whole pages -> float32 ``k, v [len(pages), Hkv, 128 tokens, 128 dims]``."""
    hkv = check_cache(cache)
    data = cache[pages.long()]  # [P, 2Hkv, 128, 72]
    k = dequantize_nvfp4(data[:, :hkv, :, :SCALE_OFFSET], data[:, :hkv, :, SCALE_OFFSET:], k_scale)
    v_rows = data[:, hkv:]  # rows are dims
    codes = unpack_nibbles(v_rows[..., :SCALE_OFFSET]).transpose(-1, -2)  # [P, Hkv, tokens, dims]
    # Row 16*g + j, byte 64 + i holds the scale of token 8*j + i for group g.
    sc = v_rows[..., SCALE_OFFSET:].reshape(*v_rows.shape[:2], NUM_GROUPS, PAGE_SIZE)  # [P, Hkv, g, t]
    sc = e4m3_decode(sc).transpose(-1, -2).repeat_interleave(SCALE_GROUP, dim=-1)  # [P, Hkv, t, dims]
    v = e2m1_decode(codes) * sc * global_scale(v_scale, cache.device, as_tensor=True)
    return k, v
