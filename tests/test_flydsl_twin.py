"""The FlyDSL kernel's numerics twin against the reference (CPU).

The twin gathers each lane's bytes with the kernel's own maps and replays its arithmetic, so these
tests check the kernel's algorithm (page union, lane layouts, masking, online softmax, combine)
without the MI355 it needs to run."""

import subprocess
import sys

import pytest
import torch

from problems import all_block_ids, dense_attention_f64, make_problem, random_block_ids
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.kernels import flydsl
from sglang_nvfp4.kernels.flydsl import geometry as geo
from sglang_nvfp4.kernels.flydsl.twin import lane_pages, page_operands, page_union, sparse_prefill_twin
from sglang_nvfp4.reference import sparse_prefill_reference

# (rtol, atol) per output dtype: the twin rounds P against running per-wave maxima and sums in
# another order than the reference, so outputs agree to about one rounding of the output type.
TOL = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3), torch.float32: (2e-3, 2e-3)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The twin is many small tensor ops: one thread is faster and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _args(p, block_ids):
    return (p.q, p.cache, block_ids, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, p.sm_scale)


def _assert_close(got, want):
    rtol, atol = TOL[want.dtype]
    assert got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def test_lane_maps_gather_the_cache_layout():
    """Every (key, dim) of K and V reaches exactly one lane operand, with the format's value."""
    p = make_problem(0, [256], [1], num_kv_heads=2, spare_pages=0)  # every byte written: no NaN
    k_ref, v_ref = fmt.read_kv(p.cache, torch.arange(p.cache.shape[0]), 1.0, 1.0)
    # K operands kf[page, w, st, ks, lane, j]; V operands [page, w, dt, lane, j].
    w, st, ks, lane, j = (torch.arange(k).view([-1 if d == i else 1 for d in range(5)])
                          for i, k in enumerate((geo.NW, 2, geo.NKS, 64, 8)))
    key = geo.k_row(w, lane % 16, st).expand(-1, -1, geo.NKS, -1, 8)
    dim = geo.q_dim(lane // 16, ks, j).expand(geo.NW, 2, -1, -1, -1)
    w4, dt4, lane4, j4 = (torch.arange(k).view([-1 if d == i else 1 for d in range(4)])
                          for i, k in enumerate((geo.NW, geo.NDT, 64, 8)))
    vkey = (geo.score_key(w4, lane4 // 16, 0, 0) + j4).expand(-1, geo.NDT, -1, -1)
    vdim = geo.v_dim(lane4 % 16, dt4).expand(geo.NW, -1, -1, 8)
    for keys, dims in ((key, dim), (vkey, vdim)):
        seen = torch.zeros(fmt.PAGE_SIZE, fmt.HEAD_DIM, dtype=torch.int)
        seen.index_put_((keys.flatten(), dims.flatten()), torch.ones(keys.numel(), dtype=torch.int), accumulate=True)
        assert (seen == 1).all()
    for kvh in range(p.hkv):
        kf, v_codes, v_scales = page_operands(p.cache, kvh)
        torch.testing.assert_close(kf.float(), k_ref[:, kvh][:, key, dim].half().float(), rtol=0, atol=0)
        v_lanes = (v_codes.half() * v_scales[:, :, None].half()).float()
        torch.testing.assert_close(v_lanes, v_ref[:, kvh][:, vkey, vdim].half().float(), rtol=0, atol=0)


def test_page_union_is_first_lane_order():
    lanes = torch.full((64,), -1)
    lanes[[3, 5, 9, 17, 40, 63]] = torch.tensor([7, 2, 7, 9, 2, 4])
    union, n_u = page_union(lanes[None])
    assert int(n_u) == 4 and union[0, :5].tolist() == [7, 2, 9, 4, -1]


def test_lane_pages_drop_future_and_missing_blocks():
    p = make_problem(1, [300], [5])  # positions 295..299: own block 2
    block_ids = torch.tensor([[[0, 2, 1, -1, 2]] * 5], dtype=torch.int32)  # 2 twice, -1
    block_ids[0, 0, 3] = 2
    lanes = lane_pages(block_ids, p.block_table, p.req, p.pos, 5)[0]  # [WG, 64]
    bt = p.block_table[0].tolist()
    assert lanes[0, :5].tolist() == [bt[0], bt[2], bt[1], bt[2], bt[2]]
    assert (lanes[0, 5:16] == -1).all() and (lanes[1, 16:] == -1).all()
    future = torch.tensor([[[2, 3]]], dtype=torch.int32).expand(1, 5, 2).contiguous()
    p2 = make_problem(1, [512], [5], spare_pages=0)
    p2.pos.fill_(200)  # own block 1: blocks 2 and 3 are in the future
    assert (lane_pages(future, p2.block_table, p2.req, p2.pos, 5) == -1).all()


PROBLEMS = [
    # seq_lens, extend_lens, kv heads, q dtype, k_scale, v_scale
    ([300, 1000, 129], [300, 37, 2], 1, torch.float32, 1.0, 1.0),
    ([700, 130, 257], [61, 130, 3], 2, torch.bfloat16, 0.5, 2.0),
    ([1500, 64], [45, 7], 1, torch.float16, 2.0, 0.25),
]


@pytest.mark.parametrize("case", range(len(PROBLEMS)))
def test_twin_matches_reference(case):
    """Several requests on shuffled pages, partial last pages, chunk starts off page boundaries,
    T not a multiple of 4, -1 ids, duplicates and future blocks in the selections."""
    seq_lens, extend_lens, hkv, dtype, ks, vs = PROBLEMS[case]
    p = make_problem(10 + case, seq_lens, extend_lens, num_heads=16 * hkv, num_kv_heads=hkv,
                     dtype=dtype, k_scale=ks, v_scale=vs)
    block_ids = random_block_ids(p, 20 + case, dup_prob=0.3)
    args = _args(p, block_ids)
    _assert_close(sparse_prefill_twin(*args), sparse_prefill_reference(*args))


def test_twin_matches_dense_attention():
    """Selecting every block up to the token's own is causal attention (independent float64 oracle)."""
    p = make_problem(3, [400, 150], [140, 150], dtype=torch.float32)
    got = sparse_prefill_twin(*_args(p, all_block_ids(p)))
    torch.testing.assert_close(got.double(), dense_attention_f64(p), rtol=2e-2, atol=2e-2)


def test_unseen_keys_never_reach_the_output():
    """NaN scales in every key no token can see (tails of last pages, spare pages) change nothing."""
    p = make_problem(4, [200, 333], [70, 100], num_heads=32, num_kv_heads=2)
    block_ids = random_block_ids(p, 5)
    clean = sparse_prefill_twin(*_args(p, block_ids))
    nan = 0x7F
    hkv = p.hkv
    for r, n in enumerate(p.seq_lens):
        last = int(p.block_table[r, (n - 1) // fmt.PAGE_SIZE])
        tail = torch.arange(n % fmt.PAGE_SIZE or fmt.PAGE_SIZE, fmt.PAGE_SIZE)
        p.cache[last, :hkv, tail, fmt.SCALE_OFFSET:] = nan
        groups = torch.arange(fmt.NUM_GROUPS)[:, None]
        rows = fmt.V_SCALE_ROWS_PER_GROUP * groups + tail // 8
        p.cache[last, hkv:, rows, fmt.SCALE_OFFSET + tail % 8] = nan
    used = set(p.block_table[p.block_table >= 0].tolist())
    for page in set(range(p.cache.shape[0])) - used:
        p.cache[page, :, :, fmt.SCALE_OFFSET:] = nan
    poisoned = sparse_prefill_twin(*_args(p, block_ids))
    assert torch.equal(poisoned, clean)
    _assert_close(poisoned, sparse_prefill_reference(*_args(p, block_ids)))


def test_tokens_without_keys_output_zero():
    p = make_problem(6, [260], [9])  # positions 251..259: blocks 1 (up to 255) and 2
    block_ids = random_block_ids(p, 7)
    block_ids[:, 5] = -1  # nothing selected
    block_ids[:, 2] = -1
    block_ids[:, 2, 0] = 2  # only a future block (position 253 is in block 1)
    out = sparse_prefill_twin(*_args(p, block_ids))
    assert (out[[2, 5]] == 0).all()
    _assert_close(out, sparse_prefill_reference(*_args(p, block_ids)))


def test_cpu_path_of_the_package_is_the_twin():
    p = make_problem(8, [150], [11], dtype=torch.bfloat16)
    block_ids = random_block_ids(p, 9)[:, :, :12].contiguous()  # fewer ids than the kernel's 16
    out = torch.empty_like(p.q)
    assert flydsl.supports(p.q.shape[1], p.hkv, block_ids.shape[2]) and not flydsl.is_available("cpu")
    assert flydsl.launch(*_args(p, block_ids), out) is out
    assert torch.equal(out, sparse_prefill_twin(*_args(p, block_ids)))


def test_unsupported_shapes_are_refused():
    p = make_problem(8, [150], [3], num_heads=8)
    assert not flydsl.supports(p.q.shape[1], p.hkv, fmt.TOPK)
    with pytest.raises(ValueError, match="16"):
        flydsl.launch(*_args(p, random_block_ids(p, 1)), torch.empty_like(p.q))


def test_package_imports_without_flydsl():
    code = (
        "import sys; import sglang_nvfp4.kernels.flydsl as k, sglang_nvfp4.kernels.flydsl.twin; "
        "assert 'flydsl' not in sys.modules, 'flydsl imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
