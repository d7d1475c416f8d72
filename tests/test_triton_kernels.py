"""The Triton kernels on CPU, run by Triton's interpreter, against the reference and format.write_kv.

The interpreter is chosen when a jit function is defined, Triton's own standard library included, so
this module re-runs itself in a subprocess with ``TRITON_INTERPRET=1`` set before anything imports
triton (the parent may already have imported it, through SGLang for instance); the dispatcher is
forced to Triton with ``NVFP4_SPARSE_KERNEL``. Shapes are small: the interpreter costs milliseconds per
page visit. Interpreted kernels take the portable decode path; the PTX path is covered by
test_kernels_gpu.py. The dispatcher's device logic needs no kernels and is tested in this process.
"""

import importlib.util
import os
import sys
import types

import pytest
import torch

from problems import assert_batch_invariant, call_args, make_problem, random_block_ids
from triton_interpreter import assert_module_passed, register_module
from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.indexer import all_visible_blocks
from sglang_nvfp4.reference import sparse_prefill_reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
register_module(__file__, expected_passed=47, timeout=1200, run_s=130)  # the tests defined under ``if INTERPRETED``


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def poisoned(q):
    return torch.full_like(q, float("nan"))


def share_first_page(p):
    """Request 1 reuses request 0's first page for its block 0 (a shared prefix page)."""
    p.block_table[1, 0] = p.block_table[0, 0]
    return p


if INTERPRETED:
    from e4m3_probe import check_e4m3_decode
    from sglang_nvfp4.kernels import triton_decode, triton_prefill

    @pytest.fixture
    def forced_triton(monkeypatch):
        monkeypatch.setenv(kernels.FORCE_ENV, "triton")

    @pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int32])
    @pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
    def test_e4m3_decode_is_exact_for_all_codes(code_dtype, out_dtype):
        check_e4m3_decode("cpu", code_dtype, out_dtype)

    # Three requests (one sharing a page with another), partial last pages, chunk starts not page
    # aligned, tiles spanning requests; random_block_ids adds -1 slots, duplicates and later blocks.
    PREFILL_CASES = [
        # heads, kv_heads, tokens per tile, q dtype
        (16, 1, 1, torch.bfloat16),
        (16, 2, 4, torch.float16),
        (32, 2, 8, torch.float32),
        (16, 2, 2, torch.bfloat16),  # GQA 8
        (8, 1, 8, torch.float16),  # GQA 8
        (8, 8, None, torch.float16),  # MHA, the default tile: 32 tokens of one head (member bits up to 31)
    ]

    @pytest.mark.parametrize("heads, kv_heads, tokens_per_tile, dtype", PREFILL_CASES)
    def test_prefill_matches_reference(heads, kv_heads, tokens_per_tile, dtype):
        config = (triton_prefill.PrefillConfig(tokens_per_tile, 4, 1) if tokens_per_tile
                  else triton_prefill.default_prefill_config(heads // kv_heads))
        p = share_first_page(make_problem(40 + heads + config.tokens_per_tile, [700, 390, 129], [21, 14, 6],
                                          num_heads=heads, num_kv_heads=kv_heads, k_scale=0.5, v_scale=2.0, dtype=dtype))
        block_ids = random_block_ids(p, seed=config.tokens_per_tile, dup_prob=0.3)
        block_ids[:, 3] = -1  # a token that selected nothing
        want = sparse_prefill_reference(*call_args(p, block_ids))
        out = poisoned(p.q)
        triton_prefill.launch(*call_args(p, block_ids), out, config=config)
        assert not out.isnan().any()
        assert torch.all(out[3] == 0)
        tolerance = {torch.float32: 2e-4, torch.float16: 1e-3, torch.bfloat16: 6e-3}[dtype]  # P in fp16 + output rounding
        assert rel_err(out, want) < tolerance

    def _check_plan(p, block_ids, tokens_per_tile, order=None):
        """``plan_tiles`` against a Python model: per tile and KV head, every distinct (block, page) a tile token
        selected (ids >= 0 starting at or before its position), in (block, page) order, with the bitmask of the
        tokens that selected it; the tile's tokens consecutive, or ``order``'s (``len(p.pos)``: none)."""
        union_len, plan = triton_prefill.plan_tiles(block_ids, p.block_table, p.req, p.pos, tokens_per_tile, order)
        for h in range(p.hkv):
            for tile in range(union_len.shape[1]):
                want = {}
                places = range(tile * tokens_per_tile, (tile + 1) * tokens_per_tile)
                tokens = [order[h, i].item() for i in places] if order is not None else list(places)
                for b, t in enumerate(tokens):
                    if t >= len(p.pos):
                        continue
                    for block in block_ids[h, t].tolist():
                        if 0 <= block and block * fmt.PAGE_SIZE <= p.pos[t]:
                            key = (block, int(p.block_table[p.req[t], block]))
                            want[key] = want.get(key, 0) | 1 << b
                n = int(union_len[h, tile])
                got = list(zip(plan[1, h, tile, :n].tolist(), plan[0, h, tile, :n].tolist()))
                assert got == sorted(want), (h, tile)
                got_members = [m & 0xFFFFFFFF for m in plan[2, h, tile, :n].tolist()]  # int32 bit 31 = token 31
                assert got_members == [want[k] for k in sorted(want)], (h, tile)

    def test_predecode_decodes_each_visible_block_once_into_tiles():
        """Slot ``r * S + b`` holds request r's block b as fp16 K and V^T tiles of ``value / TILE_SCALE``
        (format.read_kv's decoding) and as E4M3 key tiles, keys at or past the request's last query position + 1
        zeroed (their rows hold garbage, often E4M3 NaN codes), slots past them untouched; a request without query
        tokens, a shared prefix page and partial pages included."""
        from sglang_nvfp4.kernels import triton_predecode

        from sglang_nvfp4.kernels.triton_indexer import FP8_KEY_SCALE

        p = share_first_page(make_problem(46, [700, 390, 129], [21, 14, 6], num_kv_heads=2))
        tokens = p.req < 2  # request 2 has no query token here: nothing of it is decoded
        req, pos = p.req[tokens].contiguous(), p.pos[tokens].contiguous()
        predecoded = triton_predecode.prepare(p.block_table, req, pos, p.hkv, key_tiles=True)
        assert predecoded.kv_len.tolist() == [700, 390, 0]
        assert predecoded.slot_table.flatten().tolist() == list(range(p.block_table.numel()))
        predecoded.tiles.fill_(float("nan"))
        predecoded.key_tiles.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
        triton_predecode.launch(p.cache, p.block_table, predecoded)
        width = p.block_table.shape[1]
        for r, kv_len in enumerate(predecoded.kv_len.tolist()):
            for b in range(width):
                tile, key_tile = predecoded.tiles[r * width + b], predecoded.key_tiles[r * width + b]
                if b * fmt.PAGE_SIZE >= kv_len:
                    assert tile.isnan().all() and (key_tile.view(torch.uint8) == 0x7F).all(), (r, b)
                    continue
                k, v = fmt.read_kv(p.cache, p.block_table[r, b : b + 1], 1 / 64, 1 / 64)  # TILE_SCALE = 64
                live = (b * fmt.PAGE_SIZE + torch.arange(fmt.PAGE_SIZE) < kv_len)[:, None]
                want_k = torch.where(live, k[0], 0.0).half()
                assert torch.equal(tile[:, 0], want_k), (r, b)
                assert torch.equal(tile[:, 1], torch.where(live, v[0], 0.0).half().transpose(-1, -2)), (r, b)
                # The score kernels' keys: times FP8_KEY_SCALE (exact), rounded to nearest even E4M3; compared as
                # values, as the interpreter's rounding (triton_indexer.to_e4m3) turns -0 into +0.
                want_key = (want_k.float() * FP8_KEY_SCALE.value).to(torch.float8_e4m3fn)
                assert torch.equal(key_tile.float(), want_key.float()), (r, b)

    @pytest.mark.parametrize("tokens_per_tile, width", [(4, 16), (8, 32), (16, 5), (32, 3)])
    def test_plan_lists_each_tiles_union_in_block_page_order(tokens_per_tile, width):
        """Random selections with -1 ids, repeats and blocks past the token; tiles span requests that share a page."""
        p = share_first_page(make_problem(41, [1000, 700, 300], [40, 30, 50], num_kv_heads=2))
        _check_plan(p, random_block_ids(p, seed=3, width=width), tokens_per_tile)

    @pytest.mark.parametrize("tokens_per_tile", [4, 8])
    def test_plan_keeps_full_tiles_and_large_page_ids(tokens_per_tile):
        """Every slot of every tile holds a visible id (no padding entry sorts last) and page ids sit just below
        2**31 (the planner reads no cache): the union's largest class and the page field's top bits survive."""
        p = share_first_page(make_problem(43, [1000, 700, 300], [40, 30, 50], num_kv_heads=2))
        p.block_table += (2**31 - 1) - int(p.block_table.max())
        own = (p.pos // fmt.PAGE_SIZE).int()  # >= 1 for every extend token here
        block_ids = torch.stack([torch.stack([own, torch.zeros_like(own)], -1),
                                 torch.stack([own - 1, own], -1)]).contiguous()  # [Hkv=2, T, K=2], all visible
        assert len(p.pos) % tokens_per_tile == 0 and bool((block_ids >= 0).all())
        _check_plan(p, block_ids, tokens_per_tile)

    def _token_order_model(p, block_ids, tokens_per_tile):
        """``group_tokens``' rule in Python: per KV head and window of ``GROUP_WINDOW`` tokens, a tile starts with the
        window's earliest token left and each next place takes the token with the fewest selected ids (>= 0,
        starting at or before its position) whose block the tile's tokens of the first token's request lack (all of
        them for a token of another request), the earliest on ties."""
        hkv, t, width = block_ids.shape
        window = triton_prefill.GROUP_WINDOW
        places = -(-t // tokens_per_tile) * tokens_per_tile
        order = torch.full((hkv, places), t, dtype=torch.int32)
        for h in range(hkv):
            blocks = [[b for b in block_ids[h, i].tolist() if b >= 0 and b * fmt.PAGE_SIZE <= p.pos[i]]
                      for i in range(t)]
            for first in range(0, t, window):
                left = list(range(first, min(t, first + window)))
                for place in range(first, min(places, first + window)):
                    if not left:
                        break
                    if (place - first) % tokens_per_tile == 0:
                        union, pick = set(), left[0]
                        tile_req = int(p.req[pick])
                    else:
                        def added(c):
                            same = int(p.req[c]) == tile_req
                            return sum(not (same and b in union) for b in blocks[c])
                        pick = min(left, key=lambda c: (added(c), c))
                    left.remove(pick)
                    if int(p.req[pick]) == tile_req:
                        union.update(blocks[pick])
                    order[h, place] = pick
        return order

    @pytest.mark.parametrize("tokens_per_tile, width, lens", [
        (4, 16, [1000, 700, 300]), (8, 32, [1000, 700, 300]), (16, 5, [1000, 700, 300]), (2, 64, [1000, 700, 300]),
        (8, 16, [18000, 700, 9000]),  # block ids past 63 and 127: bitset words, each word's sign bit
    ])
    def test_group_tokens_follows_its_rule(tokens_per_tile, width, lens):
        """Three requests sharing a page (windows across request boundaries), -1 ids, repeats and blocks past a
        token's position; 64-token windows, the last with a partial tile."""
        p = share_first_page(make_problem(44, lens, [40, 30, 50], num_kv_heads=2))
        block_ids = random_block_ids(p, seed=5, width=width)
        order = triton_prefill.group_tokens(block_ids, p.block_table, p.req, p.pos, tokens_per_tile)
        want = _token_order_model(p, block_ids, tokens_per_tile)
        assert torch.equal(order, want)
        t = len(p.pos)
        for h in range(p.hkv):  # every token once; T marks the last tile's empty places
            assert sorted(order[h][order[h] < t].tolist()) == list(range(t))
        assert not torch.equal(order[0, :t], torch.arange(t, dtype=torch.int32))  # it does regroup
        _check_plan(p, block_ids, tokens_per_tile, order)

    def test_token_order_arguments_are_checked():
        """``plan_tiles`` refuses an order of the wrong shape, and ``group_tokens`` a tile that does not divide its
        window; no token, no order."""
        p = make_problem(45, [300], [120], num_kv_heads=2)
        ids = random_block_ids(p, seed=1)
        with pytest.raises(ValueError, match="order: expected contiguous int32"):
            triton_prefill.plan_tiles(ids, p.block_table, p.req, p.pos, 8, torch.zeros(2, 64, dtype=torch.int32))
        with pytest.raises(ValueError, match="must divide the 64-token window"):
            triton_prefill.group_tokens(ids, p.block_table, p.req, p.pos, 24)
        empty = triton_prefill.group_tokens(ids[:, :0], p.block_table, p.req[:0], p.pos[:0], 8)
        assert empty.shape == (2, 0)

    @pytest.mark.parametrize("heads, kv_heads, splits", [(16, 2, 1), (16, 1, 4), (16, 2, 16), (8, 1, 2)])
    def test_decode_matches_reference(heads, kv_heads, splits):
        p = share_first_page(make_problem(60 + splits, [900, 1300, 129, 257, 40], [1] * 5, num_heads=heads,
                                          num_kv_heads=kv_heads, k_scale=2.0, v_scale=0.25, dtype=torch.float32))
        block_ids = random_block_ids(p, seed=splits, dup_prob=0.5)
        block_ids[:, 4] = -1
        want = sparse_prefill_reference(*call_args(p, block_ids))
        out = poisoned(p.q)
        triton_decode.launch(*call_args(p, block_ids), out, splits=splits)
        assert not out.isnan().any()
        assert torch.all(out[4] == 0)
        assert rel_err(out, want) < 3e-4

    def test_prefill_is_batch_invariant():
        """Tiles of 4 tokens span requests (extends of 21/14/6) and, alone, a request's tokens fall into other
        tiles: a token's output must not move. Random slot orders make tile-mates list shared blocks in
        different orders (before the union was sorted by block, that reordered a token's pages)."""
        p = share_first_page(make_problem(47, [700, 390, 129], [21, 14, 6], num_heads=16, num_kv_heads=2))
        block_ids = random_block_ids(p, seed=8, dup_prob=0.3)
        reqs = [torch.nonzero(p.req == r)[:, 0] for r in range(3)]
        # KV head 1: request 0's tokens all select token 0's blocks, each in a slot order of its own
        block_ids[1, reqs[0]] = torch.stack([torch.roll(block_ids[1, 0], int(t)) for t in reqs[0]])
        config = triton_prefill.PrefillConfig(4, 4, 1)

        def attend(*args):
            return triton_prefill.launch(*args, poisoned(args[0]), config=config)

        assert_batch_invariant(attend, p, block_ids, [*reqs, reqs[0][5:], torch.cat([reqs[2], reqs[1]])])

    def test_decode_is_batch_invariant():
        """The split count is fixed, so a token decoded alone or with 4 others gives the same bits."""
        p = share_first_page(make_problem(48, [900, 1300, 129, 257, 40], [1] * 5, num_heads=16, num_kv_heads=2,
                                          dtype=torch.float32))
        block_ids = random_block_ids(p, seed=9, dup_prob=0.5)

        def attend(*args):
            return triton_decode.launch(*args, poisoned(args[0]))

        assert_batch_invariant(attend, p, block_ids, [torch.tensor([t]) for t in range(5)] + [torch.tensor([3, 1])])

    import triton
    import triton.language as tl

    from sglang_nvfp4.kernels.triton_common import merge_partials

    @triton.jit
    def _merge_neighbours_kernel(acc_ptr, stats_ptr, out_acc_ptr, out_stats_ptr, ROWS: tl.constexpr):
        """Program p: partials 2p and 2p + 1 of ``[P, ROWS, 128]`` / ``[P, 2, ROWS]`` -> partial p of the halves."""
        p = tl.program_id(0)
        rows = tl.arange(0, ROWS)
        at = rows[:, None] * 128 + tl.arange(0, 128)[None, :]
        m_a, l_a = tl.load(stats_ptr + 4 * p * ROWS + rows), tl.load(stats_ptr + 4 * p * ROWS + ROWS + rows)
        m_b, l_b = tl.load(stats_ptr + (4 * p + 2) * ROWS + rows), tl.load(stats_ptr + (4 * p + 3) * ROWS + rows)
        acc_a = tl.load(acc_ptr + 2 * p * ROWS * 128 + at)
        acc_b = tl.load(acc_ptr + (2 * p + 1) * ROWS * 128 + at)
        m, l, acc = merge_partials(m_a, l_a, acc_a, m_b, l_b, acc_b, DIM_AXIS=1)
        tl.store(out_stats_ptr + 2 * p * ROWS + rows, m)
        tl.store(out_stats_ptr + (2 * p + 1) * ROWS + rows, l)
        tl.store(out_acc_ptr + p * ROWS * 128 + at, acc)

    def test_split_combine_is_a_tree_over_neighbours():
        """The combine merges splits 2i and 2i + 1 first, then pairs of those: 8 partials give the bits that their
        4 neighbour merges (the same merge function) give, and so on down to one partial. The Gluon decode's free
        split count rests on this. Empty partials (-inf, 0, 0) among them are the identity."""
        gen = torch.Generator().manual_seed(5)
        rows, splits, group = 16, 8, 12
        acc = torch.randn(1, 1, splits, rows, 128, generator=gen) * 3
        stats = torch.stack([torch.randn(1, 1, splits, rows, generator=gen) * 4,
                             torch.rand(1, 1, splits, rows, generator=gen) * 50 + 1], dim=3)
        for empty in (1, 6, 7):
            acc[:, :, empty], stats[:, :, empty, 0], stats[:, :, empty, 1] = 0.0, float("-inf"), 0.0
        outs = []
        while True:
            out = torch.full((1, group, 128), float("nan"))
            if splits == 1:  # one partial left: it and an empty one, the identity
                empty = torch.tensor([float("-inf"), 0.0])[:, None].expand(1, 1, 1, 2, rows)
                triton_decode.combine_splits(out, torch.cat([acc, torch.zeros_like(acc)], 2),
                                             torch.cat([stats, empty], 2), 1.0, 1, group, rows, 2)
            else:
                triton_decode.combine_splits(out, acc, stats, 1.0, 1, group, rows, splits)
            outs.append(out)
            if splits == 1:
                break
            splits //= 2
            half_acc, half_stats = torch.empty(1, 1, splits, rows, 128), torch.empty(1, 1, splits, 2, rows)
            _merge_neighbours_kernel[(splits,)](acc, stats, half_acc, half_stats, ROWS=rows)
            acc, stats = half_acc, half_stats
        assert not outs[0].isnan().any()
        for out in outs[1:]:
            assert torch.equal(out, outs[0])

    from sglang_nvfp4.kernels.triton_common import fold_scores, online_softmax_step

    @triton.jit
    def _fold_both_ways_kernel(s_ptr, selected_ptr, stats_ptr, p_ptr, out_stats_ptr, logit_scale,
                               ROWS: tl.constexpr, KEYS: tl.constexpr):
        """One page's step for rows that selected it or not, two ways: ``online_softmax_step`` with the rows masked
        (``p_ptr[0]``, ``out_stats_ptr[0]``: alpha, m, l) and ``fold_scores`` with a row bias of 0 / -inf (``[1]``)."""
        rows = tl.arange(0, ROWS)
        s = tl.load(s_ptr + rows[:, None] * KEYS + tl.arange(0, KEYS)[None, :])
        selected = tl.load(selected_ptr + rows) != 0
        m_i, l_i = tl.load(stats_ptr + rows), tl.load(stats_ptr + ROWS + rows)
        bias = tl.where(selected, 0.0, float("-inf"))
        for way in tl.static_range(2):
            if way == 0:
                p, alpha, m, l = online_softmax_step(s, selected[:, None], logit_scale, m_i, l_i, 1, True)
            else:
                p, alpha, m, l = fold_scores(s, logit_scale, bias, m_i, l_i, 1, True)
            tl.store(p_ptr + way * ROWS * KEYS + rows[:, None] * KEYS + tl.arange(0, KEYS)[None, :], p)
            tl.store(out_stats_ptr + (3 * way + 0) * ROWS + rows, alpha)
            tl.store(out_stats_ptr + (3 * way + 1) * ROWS + rows, m)
            tl.store(out_stats_ptr + (3 * way + 2) * ROWS + rows, l)

    def test_fold_scores_row_bias_is_the_masked_step():
        """The Gluon prefill's unmasked pages fold their rows' selections in as a bias (0 / -inf) instead of masking
        the scores: the same bits as the masked step, and both equal a float64 model of the exp2 softmax step. Rows:
        selected or not, with a running max of -inf (nothing seen yet) or finite."""
        rows, keys, logit_scale = 16, 32, 0.37
        gen = torch.Generator().manual_seed(3)
        s = torch.randn(rows, keys, generator=gen) * 5
        selected = torch.tensor([1, 0] * 8, dtype=torch.int32)
        m_i = torch.randn(rows, generator=gen) * 3
        l_i = torch.rand(rows, generator=gen) * 10 + 1
        m_i[:4], l_i[:4] = float("-inf"), 0.0  # rows 0 (selected) to 3 have seen no key
        p, stats = torch.full((2, rows, keys), float("nan")), torch.full((6, rows), float("nan"))
        _fold_both_ways_kernel[(1,)](s, selected, torch.stack([m_i, l_i]), p, stats, logit_scale, ROWS=rows, KEYS=keys)
        assert torch.equal(p[0], p[1]) and torch.equal(stats[:3], stats[3:])
        logits = torch.where(selected[:, None] != 0, s.double() * float(torch.tensor(logit_scale)), float("-inf"))
        m = torch.maximum(m_i.double(), logits.amax(dim=1))
        m_ref = torch.where(m == float("-inf"), 0.0, m)
        want_p = torch.exp2(logits - m_ref[:, None])
        alpha = torch.exp2(m_i.double() - m_ref)
        torch.testing.assert_close(p[0].double(), want_p, rtol=4e-6, atol=0)
        torch.testing.assert_close(stats[0].double(), alpha, rtol=4e-6, atol=0)
        assert torch.equal(stats[1].double(), m.float().double())  # the max of the scores, scaled: the logits' max
        torch.testing.assert_close(stats[2].double(), l_i.double() * alpha + want_p.sum(dim=1), rtol=4e-6, atol=0)
        unselected = selected == 0
        assert (p[0][unselected] == 0).all() and torch.equal(stats[2][unselected], l_i[unselected])

    def test_dispatcher_serves_triton_with_tensor_scales_and_strided_q(forced_triton):
        p = make_problem(70, [500, 260], [9, 4], num_heads=16, num_kv_heads=2, k_scale=0.5, v_scale=3.0,
                         dtype=torch.float16)
        block_ids = random_block_ids(p, seed=7)
        want = sparse_prefill_reference(*call_args(p, block_ids))
        wide = torch.randn(p.q.shape[0], 16, 256, dtype=p.q.dtype)
        wide[..., :128] = p.q  # q as a strided view, as when sliced out of a fused qkv tensor
        q = wide[..., :128]
        scales = torch.tensor([p.k_scale]), torch.tensor(p.v_scale, dtype=torch.float64)
        for fn in (kernels.sparse_prefill, kernels.sparse_decode):
            out = poisoned(p.q)
            assert fn(q, p.cache, block_ids, p.block_table, p.req, p.pos, *scales, p.sm_scale, out=out) is out
            assert rel_err(out, want) < 1e-3
        assert kernels.resolve_implementation("cpu") == "triton"

    @pytest.mark.parametrize("width", [5, 20])
    def test_any_block_id_width(forced_triton, width):
        p = make_problem(71, [1200], [10], num_heads=16, num_kv_heads=1, dtype=torch.float32)
        block_ids = random_block_ids(p, seed=width, width=width)
        want = sparse_prefill_reference(*call_args(p, block_ids))
        assert rel_err(kernels.sparse_prefill(*call_args(p, block_ids)), want) < 2e-4
        assert rel_err(kernels.sparse_decode(*call_args(p, block_ids)), want) < 2e-4

    @pytest.mark.parametrize("width", [32, fmt.MAX_TOPK])
    def test_budgets_beyond_sixteen_blocks(forced_triton, width):
        """Budgets above the default (``NVFP4_SPARSE_TOPK`` up to ``format.MAX_TOPK``): 4-token prefill tiles
        whose unions hold up to 4 * width pages, and decode with its 4 splits, against the reference."""
        p = make_problem(74 + width, [9000, 4700], [6, 3], num_heads=16, num_kv_heads=2, dtype=torch.float32)
        block_ids = random_block_ids(p, seed=width, width=width, dup_prob=0.3)
        assert (block_ids >= 0).sum(-1).max() > 16  # really wider than the default budget
        want = sparse_prefill_reference(*call_args(p, block_ids))
        assert rel_err(kernels.sparse_prefill(*call_args(p, block_ids), out=poisoned(p.q)), want) < 2e-4
        assert rel_err(kernels.sparse_decode(*call_args(p, block_ids), out=poisoned(p.q)), want) < 3e-4

    def test_dense_selection_shared_by_the_kv_heads(forced_triton):
        """Dense layers hand the plan one all-visible selection expanded over the KV heads (stride 0)."""
        p = make_problem(73, [700, 300], [12, 5], num_heads=16, num_kv_heads=2, dtype=torch.float32)
        shared = all_visible_blocks(p.pos, p.block_table.shape[1]).expand(2, -1, -1)
        want = sparse_prefill_reference(*call_args(p, shared.contiguous()))
        # decode's splits round P against each split's own running max: the decode tests' tolerance
        for kind, tolerance in (("prefill", 2e-4), ("decode", 3e-4)):
            plan = kernels.plan_attention(kind, p.block_table, p.req, p.pos, num_kv_heads=2)
            out = plan.run(p.q, p.cache, shared, p.k_scale, p.v_scale, p.sm_scale, out=poisoned(p.q))
            assert rel_err(out, want) < tolerance, kind

    def test_keys_nobody_sees_may_hold_nan_codes(forced_triton):
        p = make_problem(72, [300, 200], [14, 7], num_heads=16, num_kv_heads=2, dtype=torch.float32)
        block_ids = random_block_ids(p, seed=4)
        base = kernels.sparse_prefill(*call_args(p, block_ids))
        # NaN-coded scales and codes in the unwritten tail of each request's last page
        for r, n in enumerate(p.seq_lens):
            page, tail = int(p.block_table[r, (n - 1) // 128]), n % 128
            p.cache[page, :2, tail:, :] = 0x7F  # K rows of unwritten tokens
            token_of_scale = torch.arange(128)[:, None] % 16 * 8 + torch.arange(8)[None, :]
            p.cache[page, 2:, :, 64:] = torch.where(token_of_scale >= tail, 0x7F, p.cache[page, 2:, :, 64:]).to(torch.uint8)
        for fn in (kernels.sparse_prefill, kernels.sparse_decode):
            out = fn(*call_args(p, block_ids))
            assert torch.isfinite(out).all()
            assert rel_err(out, base) < 2e-4

    def test_tokens_without_keys_write_zero(forced_triton):
        p = make_problem(73, [600], [24], num_heads=16, num_kv_heads=1, dtype=torch.float32)
        p.pos = torch.arange(100, 124, dtype=torch.int32)  # an earlier chunk of the request: block 0
        block_ids = torch.full((1, 24, 16), -1, dtype=torch.int32)
        block_ids[0, ::2, 0] = 3  # a later block: nothing visible
        for fn in (kernels.sparse_prefill, kernels.sparse_decode):
            assert torch.equal(fn(*call_args(p, block_ids), out=poisoned(p.q)), torch.zeros_like(p.q))

    def _write_inputs(seed, n, hkv, dtype):
        gen = torch.Generator().manual_seed(seed)
        k, v = torch.randn(2, n, hkv, 128, generator=gen)
        k = k * torch.exp(torch.randn(n, hkv, 128, generator=gen) * 3)  # saturated and subnormal scales
        k[0, 0, :16] = 0  # an all-zero group
        k[1, 0, 5] = float("inf")
        v[2, 0, 3] = -float("inf")
        v[3, 0, :16] = 1e-30  # underflows to scale 0
        return k.to(dtype), v.to(dtype)

    @pytest.mark.parametrize("hkv, dtype, k_scale, v_scale", [
        (2, torch.float32, 0.5, 2.0),
        (1, torch.bfloat16, 1.0, torch.tensor(1.0)),
        (4, torch.float16, torch.tensor([3e-3]), 17.0),
    ])
    def test_write_kv_is_bit_identical(forced_triton, hkv, dtype, k_scale, v_scale):
        gen = torch.Generator().manual_seed(hkv)
        cache = fmt.alloc_cache(4, hkv).random_(0, 256, generator=gen)
        want = cache.clone()
        n = 90
        # neighbour pairs (both tokens of a V byte in one call) and lone tokens whose neighbour's nibble must survive
        pairs = torch.arange(130, 140)
        others = torch.randperm(512, generator=gen)
        slots = torch.cat([pairs, others[(others < 130) | (others >= 140)][: n - len(pairs)]])
        k, v = _write_inputs(hkv, n, hkv, dtype)
        kernels.write_kv(cache, slots, k, v, k_scale, v_scale)
        fmt.write_kv(want, slots, k, v, k_scale, v_scale)
        assert torch.equal(cache, want)

    @pytest.mark.parametrize("slots", [
        list(range(130, 170)),  # one request from an even slot: every token in an aligned pair (whole bytes)
        list(range(131, 171)),  # from an odd slot: no aligned pair, every byte by nibbles, both parities
        # runs from odd and even batch indices, a reversed pair (5, 4), padding, a run across pages
        list(range(131, 150)) + list(range(300, 321)) + [-1, 5, 4, 254, 255, 256, 257],
    ])
    def test_write_kv_aligned_pairs_and_the_rest(forced_triton, slots):
        gen = torch.Generator().manual_seed(len(slots))
        cache = fmt.alloc_cache(6, 2).random_(0, 256, generator=gen)
        want = cache.clone()
        slots = torch.tensor(slots)
        k, v = _write_inputs(9, len(slots), 2, torch.bfloat16)
        kernels.write_kv(cache, slots, k, v, 0.5, torch.tensor(2.0))
        keep = slots >= 0
        fmt.write_kv(want, slots[keep], k[keep], v[keep], 0.5, 2.0)
        assert torch.equal(cache, want)

    def test_write_kv_in_one_launch_when_no_two_slots_share_a_byte(forced_triton):
        # a decode step: one token on each of 4 pages, even and odd rows (the neighbour's nibble survives), and a
        # padded row (-1), written in the single launch
        gen = torch.Generator().manual_seed(8)
        cache = fmt.alloc_cache(5, 2).random_(0, 256, generator=gen)
        want = cache.clone()
        slots = torch.tensor([129, 256 + 6, 384 + 127, -1, 512])
        k, v = _write_inputs(8, 5, 2, torch.bfloat16)
        kernels.write_kv(cache, slots, k, v, 0.7, torch.tensor(1.5), one_token_per_byte=True)
        keep = slots >= 0
        fmt.write_kv(want, slots[keep], k[keep], v[keep], 0.7, 1.5)
        assert torch.equal(cache, want)

    def test_write_kv_skips_negative_slots(forced_triton):
        cache = fmt.alloc_cache(2, 1).random_(0, 256, generator=torch.Generator().manual_seed(5))
        want = cache.clone()
        k, v = _write_inputs(5, 6, 1, torch.float32)
        slots = torch.tensor([3, -1, 200, -1, 17, 18])
        keep = slots >= 0
        kernels.write_kv(cache, slots, k, v, 1.0, 1.0)
        fmt.write_kv(want, slots[keep], k[keep], v[keep], 1.0, 1.0)
        assert torch.equal(cache, want)

else:

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    def test_kernels_under_the_triton_interpreter():
        assert_module_passed(__file__)

    @pytest.mark.parametrize("field, bad", [
        ("slots", lambda s, k, v: (s.float(), k, v)),
        ("k", lambda s, k, v: (s, k[:, :, :64], v)),
        ("v", lambda s, k, v: (s, k, v.int())),
    ])
    def test_write_kv_validates_arguments(monkeypatch, field, bad):
        monkeypatch.setenv(kernels.FORCE_ENV, "triton")  # validated before any kernel is imported
        cache = fmt.alloc_cache(2, 1)
        slots, k, v = bad(torch.arange(4), torch.randn(4, 1, 128), torch.randn(4, 1, 128))
        with pytest.raises(ValueError, match=field):
            kernels.write_kv(cache, slots, k, v, 1.0, 1.0)

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    @pytest.mark.parametrize("tokens_per_tile", [0, 33, 64])
    def test_plan_refuses_tiles_its_member_bitmask_cannot_hold(tokens_per_tile):
        from sglang_nvfp4.kernels import triton_prefill

        with pytest.raises(ValueError, match=f"tokens_per_tile={tokens_per_tile}"):
            triton_prefill.plan_tiles(torch.zeros(1, 4, 16, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                      torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                                      tokens_per_tile)
        assert triton_prefill.default_prefill_config(1).tokens_per_tile == triton_prefill.MAX_TILE_TOKENS

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    def test_plan_refuses_block_tables_wider_than_its_sort_key():
        from sglang_nvfp4.kernels import triton_prefill

        ids, tokens = torch.zeros(1, 4, 16, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        # 8 tokens x 16 ids: 7 entry bits, so block ids up to 2**25 - 2, hence 2**25 - 1 slots at most
        wide = torch.zeros(1, 1, dtype=torch.int32).expand(1, 2**25)
        with pytest.raises(ValueError, match=f"block_table has {2**25} block slots"):
            triton_prefill.plan_tiles(ids, wide, tokens, tokens, 8)

    def test_implementation_resolution(monkeypatch):
        monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
        assert kernels.resolve_implementation("cpu") == "reference"
        monkeypatch.setattr(torch.version, "hip", None)
        assert kernels.resolve_implementation("cuda:0") == "triton"
        monkeypatch.setenv(kernels.FORCE_ENV, "reference")
        assert kernels.resolve_implementation("cuda:0") == "reference"
        monkeypatch.setenv(kernels.FORCE_ENV, "cuda")
        with pytest.raises(ValueError, match=kernels.FORCE_ENV):
            kernels.resolve_implementation("cpu")

    @pytest.mark.parametrize("arch, importable, available, want", [
        ("gfx950:sramecc+:xnack-", True, True, "flydsl"),
        ("gfx950:sramecc+:xnack-", True, False, "triton"),
        ("gfx950:sramecc+:xnack-", False, True, "triton"),
        ("gfx942:sramecc+:xnack-", True, True, "triton"),
    ])
    def test_rocm_picks_flydsl_on_gfx950_when_available(monkeypatch, arch, importable, available, want):
        monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
        monkeypatch.setattr(torch.version, "hip", "6.4")
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(gcnArchName=arch))
        fake = types.ModuleType("sglang_nvfp4.kernels.flydsl")
        fake.is_available = lambda device: available
        monkeypatch.setitem(sys.modules, "sglang_nvfp4.kernels.flydsl", fake if importable else None)
        monkeypatch.delattr(kernels, "flydsl", raising=False)
        kernels._flydsl_serves.cache_clear()
        try:
            assert kernels.resolve_implementation("cuda:0") == want
        finally:
            kernels._flydsl_serves.cache_clear()
