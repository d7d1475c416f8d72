"""The kernel contract: reference vs an independent float64 dense attention, and its edge cases."""

import pytest
import torch

from problems import all_block_ids, assert_batch_invariant, dense_attention_f64, make_problem, random_block_ids
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.reference import sparse_prefill_reference


def run(p, block_ids, **kw):
    return sparse_prefill_reference(p.q, p.cache, block_ids, p.block_table, p.req, p.pos, p.k_scale, p.v_scale,
                                    p.sm_scale, **kw)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("heads, kv_heads", [(16, 1), (16, 2), (8, 1), (32, 2)])
def test_all_blocks_equals_dense_attention(heads, kv_heads):
    # three requests on shuffled pages, partial last pages, extends not page aligned
    p = make_problem(11, [300, 700, 129], [45, 200, 129], num_heads=heads, num_kv_heads=kv_heads,
                     k_scale=0.5, v_scale=2.0)
    block_ids = all_block_ids(p)
    dense = dense_attention_f64(p)
    ideal = run(p, block_ids, mode="ideal")
    assert ideal.dtype == torch.float64
    assert rel_err(ideal, dense) < 1e-12
    kern = run(p, block_ids)
    assert kern.dtype == torch.bfloat16 and kern.shape == p.q.shape
    assert rel_err(kern, dense) < 1e-2  # fp16 Q/P and bf16 output rounding


def test_gqa_head_mapping():
    p = make_problem(12, [400], [64], num_heads=16, num_kv_heads=2)
    block_ids = all_block_ids(p)
    good = dense_attention_f64(p)
    swapped = dense_attention_f64(p, head_map=lambda i: 1 - i // 8)
    out = run(p, block_ids, mode="ideal")
    assert rel_err(out, good) < 1e-12
    assert rel_err(out, swapped) > 0.1


def test_causal_mask_and_later_blocks_contribute_nothing():
    p = make_problem(13, [600], [600])
    block_ids = all_block_ids(p)
    base = run(p, block_ids, mode="ideal")
    # add every later block of the request to each token's selection
    own = (p.pos // 128).long()
    extra = torch.full_like(block_ids, -1)
    for t in range(len(own)):
        later = torch.arange(int(own[t]) + 1, 5)
        extra[0, t, : len(later)] = later.int()
    widened = torch.cat([block_ids, extra], dim=-1)
    assert torch.allclose(run(p, widened, mode="ideal"), base, rtol=1e-12, atol=1e-14)
    # token 0 of the request sees exactly one key: its output is that key's V
    k, v = fmt.read_kv(p.cache, p.block_table[0, :1], p.k_scale, p.v_scale)
    assert torch.allclose(base[0], v[0, 0, 0].double().expand(16, 128), rtol=0, atol=1e-12)


def test_duplicates_count_once_and_order_does_not_matter():
    p = make_problem(14, [2000, 900], [300, 50], num_kv_heads=2)
    block_ids = random_block_ids(p, seed=1, dup_prob=0.0)
    base = run(p, block_ids)
    dup = block_ids.clone()
    dup[:, :, -1] = torch.where(dup[:, :, -1] < 0, dup[:, :, 0], dup[:, :, -1])  # repeat a selected id
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(run(p, dup[:, :, perm]), base)
    assert torch.equal(run(p, dup[:, :, perm], mode="ideal"), run(p, block_ids, mode="ideal"))


def test_sparse_selection_matches_dense_over_selected_keys():
    p = make_problem(15, [2500, 1300], [256, 77], num_heads=16, num_kv_heads=2)
    block_ids = random_block_ids(p, seed=2)
    out = run(p, block_ids, mode="ideal")
    # independent: per token/head softmax over the keys of the selected blocks, up to pos
    cache, bt = p.cache, p.block_table
    for t in torch.randint(0, p.q.shape[0], (12,), generator=torch.Generator().manual_seed(3)).tolist():
        for h in (0, 9):
            kvh = h // 8
            blocks = sorted(set(b for b in block_ids[kvh, t].tolist() if b >= 0))
            pages = bt[int(p.req[t]), blocks].long()
            k, v = fmt.read_kv(cache, pages, p.k_scale, p.v_scale)
            positions = (torch.tensor(blocks)[:, None] * 128 + torch.arange(128)).flatten()
            keep = positions <= int(p.pos[t])
            kk = k[:, kvh].reshape(-1, 128)[keep].double()
            vv = v[:, kvh].reshape(-1, 128)[keep].double()
            w = torch.softmax(kk @ p.q[t, h].double() * p.sm_scale, 0)
            assert torch.allclose(out[t, h], w @ vv, atol=1e-12, rtol=1e-10)


def test_minus_one_and_empty_selection_give_zero():
    p = make_problem(16, [300], [20])
    block_ids = all_block_ids(p)
    block_ids[:, 5:9] = -1
    out = run(p, block_ids)
    assert torch.all(out[5:9] == 0)
    assert torch.all(out[:5].abs().sum(-1) > 0)
    empty = sparse_prefill_reference(p.q[:0], p.cache, block_ids[:, :0], p.block_table, p.req[:0], p.pos[:0],
                                     1.0, 1.0, 0.1)
    assert empty.shape == (0, 16, 128)


def test_global_scales_fold_in_kernel_mode():
    p1 = make_problem(17, [500], [100], k_scale=1.0, v_scale=1.0)
    p2 = make_problem(17, [500], [100], k_scale=4.0, v_scale=0.125)
    block_ids = all_block_ids(p1)
    # same codes (inputs were scaled by exactly the global scale), so outputs differ by v_scale only
    assert torch.equal(p1.cache, p2.cache)
    o1 = run(p1, block_ids).float()
    o2 = sparse_prefill_reference(p2.q, p2.cache, block_ids, p2.block_table, p2.req, p2.pos, 4.0, 0.125,
                                  p2.sm_scale / 4.0).float()
    assert torch.allclose(o2, o1 * 0.125, rtol=1e-2, atol=1e-4)
    assert rel_err(run(p2, block_ids), dense_attention_f64(p2)) < 1e-2


@pytest.mark.parametrize(
    "field, bad, match",
    [
        ("q", lambda p: p.q[..., :64], "q"),
        ("q", lambda p: p.q[:, :15], "q"),
        ("block_ids", lambda p: p._block_ids.long(), "block_ids"),
        ("block_ids", lambda p: torch.full_like(p._block_ids, 99), "block_ids"),
        ("block_ids", lambda p: torch.full_like(p._block_ids, -2), "block_ids"),
        ("block_table", lambda p: p.block_table.long(), "block_table"),
        ("req", lambda p: p.req + 5, "req"),
        ("pos", lambda p: p.pos - 1000, "pos"),
        ("cache", lambda p: p.cache[:, :, :, :70].contiguous(), "cache"),
    ],
)
def test_invalid_input_raises_value_error_naming_the_argument(field, bad, match):
    p = make_problem(18, [300], [10], num_kv_heads=2, num_heads=16)
    p._block_ids = all_block_ids(p)
    args = dict(q=p.q, cache=p.cache, block_ids=p._block_ids, block_table=p.block_table, req=p.req, pos=p.pos)
    args[field] = bad(p)
    with pytest.raises(ValueError, match=match):
        sparse_prefill_reference(**args, k_scale=1.0, v_scale=1.0, sm_scale=0.1)


def test_selected_block_without_a_page_is_rejected():
    p = make_problem(19, [300], [10])
    block_ids = all_block_ids(p)
    block_ids[0, 0, 5] = 3  # column 3 of the block table is -1 for this request
    with pytest.raises(ValueError, match="block_table"):
        run(p, block_ids)


def test_keys_nobody_sees_may_hold_nan_codes():
    p = make_problem(20, [300, 200], [60, 30], num_kv_heads=2)
    block_ids = random_block_ids(p, seed=4)
    base = run(p, block_ids)
    # poison the unwritten tail of each request's last page with NaN-coded scales and codes
    for r, n in enumerate(p.seq_lens):
        page = int(p.block_table[r, (n - 1) // 128])
        tail = n % 128
        p.cache[page, :2, tail:, :] = 0x7F  # K rows of unwritten tokens
        p.cache[page, 2:, :, 64:] = torch.where(
            (torch.arange(128)[:, None] % 16 * 8 + torch.arange(8)[None, :]) >= tail, 0x7F, p.cache[page, 2:, :, 64:]
        ).to(torch.uint8)
    out = run(p, block_ids)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, base)


@pytest.mark.parametrize("mode", ["kernel", "ideal"])
def test_outputs_do_not_depend_on_the_other_tokens_of_the_call(mode):
    """Batch invariance: every request alone, a lone decode-like token and a two-request subset give the rows
    they get in the whole call. Extends of 150/130/90 tokens put request boundaries inside the reference's
    64-token chunks; random selections list blocks in random slot order, with repeats and -1. (The
    reference of 2026-11-30, which scored 128-token chunks against the union of their pages, moved these
    rows by up to 1.2e-4 in kernel mode.)"""
    p = make_problem(3, [2000, 1500, 900], [150, 130, 90], num_heads=16, num_kv_heads=2, k_scale=0.5, v_scale=2.0)
    block_ids = random_block_ids(p, seed=5, dup_prob=0.3)
    reqs = [torch.nonzero(p.req == r)[:, 0] for r in range(3)]
    groups = [*reqs, reqs[1][-1:], torch.cat([reqs[2], reqs[0]])]

    def attend(*args):
        return sparse_prefill_reference(*args, mode=mode)

    assert_batch_invariant(attend, p, block_ids, groups)


def test_padding_the_selection_width_changes_nothing():
    """A dense layer's selection is as wide as the batch's longest request: extra -1 columns must not move a
    token's output (the same request batched with a longer one)."""
    p = make_problem(22, [700, 390], [30, 9], num_heads=16, num_kv_heads=1)
    block_ids = random_block_ids(p, seed=6)
    wider = torch.cat([block_ids, torch.full_like(block_ids, -1)], dim=2)
    assert torch.equal(run(p, block_ids), run(p, wider))
