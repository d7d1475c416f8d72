"""Run-verification of the FlyDSL kernel on a gfx950 GPU (MI350/MI355); skipped anywhere else.

CI has no such GPU, so this has never run here: it is the first thing to run on an MI355
(``pytest -m gpu tests/test_flydsl_gpu.py``). The kernel must match its numerics twin to within the
mfma's summation order and the reference to fp16 tolerance."""

import pytest
import torch

from problems import make_problem, random_block_ids
from sglang_nvfp4.kernels import flydsl
from sglang_nvfp4.kernels.flydsl.twin import sparse_prefill_twin
from sglang_nvfp4.reference import sparse_prefill_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and flydsl.is_available("cuda")),
        reason="needs a ROCm gfx950 GPU with flydsl installed",
    ),
]


# The small grid runs rounds=1 (at most one workgroup per CU), the large one rounds=2.
GRIDS = [([300, 1000, 129], [300, 37, 2], 1), ([9000, 700], [4000, 700], 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seq_lens, extend_lens, hkv", GRIDS)
def test_kernel_matches_twin_and_reference(seq_lens, extend_lens, hkv, dtype):
    p = make_problem(1, seq_lens, extend_lens, num_heads=16 * hkv, num_kv_heads=hkv, dtype=dtype,
                     k_scale=0.5, v_scale=2.0, device="cuda")
    block_ids = random_block_ids(p, 2, dup_prob=0.3)
    args = (p.q, p.cache, block_ids, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, p.sm_scale)
    out = flydsl.launch(*args, torch.empty_like(p.q))
    torch.cuda.synchronize()
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    twin = sparse_prefill_twin(*cpu_args)
    ref = sparse_prefill_reference(*cpu_args)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.cpu().float(), twin.float(), rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1.6e-2, atol=1e-2)
