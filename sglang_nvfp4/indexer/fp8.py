"""fp8 rows with a power-of-two scale each: the one rounding rule of the indexers' fp8 operands (the proxy's queries,
the learned indexer's fp8 index keys).

A row ``x [D]`` becomes E4M3 codes of ``x * 2**j`` (round to nearest even), ``2**j`` taking its largest magnitude
into ``[128, 256)``, and one E8M0 byte ``e = 127 - j``; the stored row is ``codes * 2**(e - 127)``, exactly. E4M3
then keeps 4 significant bits of every value whose magnitude is at least ``2**-13`` of the row's largest, whatever
the row's range, and nothing comes near E4M3's 448. The Triton kernels follow the same rule
(``sglang_nvfp4.kernels.triton_indexer._row_exponents``, which the fp8 query rows and the fp8 index-key write use).
"""

from __future__ import annotations

import torch

__all__ = ["E8M0_BIAS", "quantize_rows", "dequantize_rows", "round_rows"]

E8M0_BIAS = 127  # an E8M0 byte e stands for 2**(e - 127) (OCP MX scales; 255 is NaN, unused here)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes ``[..., D]`` and uint8 E8M0 exponents ``[...]`` of the rows of ``x [..., D]`` (any float dtype).
    A zero row stores zero codes (exponent byte 119); ``j`` is clamped to ``[-127, 126]`` (bytes 1..254): rows whose
    largest magnitude is below ``2**-119`` keep fewer significant bits, and nothing overflows."""
    x = x.float()
    _, exponent = torch.frexp(x.abs().amax(-1))  # largest magnitude in [2**(exponent-1), 2**exponent)
    j = (8 - exponent).clamp(-127, 126)
    return torch.ldexp(x, j[..., None]).to(torch.float8_e4m3fn), (E8M0_BIAS - j).to(torch.uint8)


def dequantize_rows(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """fp32 rows ``codes * 2**(e - 127)`` of :func:`quantize_rows`' output, exactly."""
    return torch.ldexp(codes.float(), exponents.int()[..., None] - E8M0_BIAS)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [..., D]`` rounded to what :func:`quantize_rows` stores."""
    return dequantize_rows(*quantize_rows(x))
