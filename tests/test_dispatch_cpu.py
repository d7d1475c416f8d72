"""The dispatcher on CPU serves the reference and validates its arguments at the boundary."""

import pytest
import torch

from problems import make_problem, random_block_ids
from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.reference import sparse_prefill_reference


def test_cpu_dispatch_is_the_reference_and_fills_out():
    p = make_problem(30, [700, 260], [100, 33], num_kv_heads=2)
    block_ids = random_block_ids(p, seed=0)
    args = (p.q, p.cache, block_ids, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, p.sm_scale)
    want = sparse_prefill_reference(*args)
    out = torch.full_like(p.q, float("nan"))
    assert kernels.sparse_prefill(*args, out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(kernels.sparse_decode(*args), want)
    assert kernels.resolve_implementation("cpu") == "reference"


def test_out_is_validated():
    p = make_problem(31, [200], [4])
    block_ids = random_block_ids(p, seed=0)
    with pytest.raises(ValueError, match="out"):
        kernels.sparse_prefill(p.q, p.cache, block_ids, p.block_table, p.req, p.pos, 1.0, 1.0, 0.1,
                               out=torch.empty(4, 16, 128, dtype=torch.float16))


def test_cpu_write_kv_is_format_write_kv():
    a = fmt.alloc_cache(3, 2).random_(0, 256, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 50, 2, 128, generator=gen)
    slots = torch.randperm(384, generator=gen)[:50]
    kernels.write_kv(a, slots, k, v, 0.5, 2.0)
    fmt.write_kv(b, slots, k, v, 0.5, 2.0)
    assert torch.equal(a, b)
