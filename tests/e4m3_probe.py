"""The kernels' one E4M3 decoder (``triton_common.e4m3_decode``) over all 256 codes, against
:func:`sglang_nvfp4.format.e4m3_decode` (shared by the interpreted and the GPU Triton tests).

Importing this module imports triton: test modules import it only once the interpreted or compiled
mode is settled (under ``TRITON_INTERPRET=1``, or inside a GPU test)."""

import torch
import triton
import triton.language as tl

from sglang_nvfp4 import format as fmt
from sglang_nvfp4.kernels.triton_common import e4m3_decode

_TL_DTYPES = {torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _decode_all_kernel(codes_ptr, out_ptr, DTYPE: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, e4m3_decode(tl.load(codes_ptr + i), DTYPE))


def check_e4m3_decode(device, code_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Codes ``0..255`` as ``code_dtype`` (uint8: the tiles; int32: the write kernel) decode to
    ``out_dtype`` exactly, signed zeros included, and 0x7F/0xFF to NaN."""
    out = torch.empty(256, dtype=out_dtype, device=device)
    _decode_all_kernel[(1,)](torch.arange(256, device=device).to(code_dtype), out, DTYPE=_TL_DTYPES[out_dtype])
    got = out.float().cpu()
    want = fmt.e4m3_decode(torch.arange(256, dtype=torch.uint8))
    assert torch.equal(got.isnan(), want.isnan()), got.isnan().nonzero().flatten().tolist()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())
