"""Block indexer, torch path: summaries, the selection rule, dense equivalence, oracle, protocol, errors."""

import math

import pytest
import torch

from problems import all_block_ids, make_problem, shuffled_block_table
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import BlockIndexer, BlockSummaries, ProxyIndexer, StateBytes, SummaryIndexer, select_blocks
from sglang_nvfp4.quality.block_mass import block_attention_mass, oracle_blocks
from sglang_nvfp4.reference import sparse_prefill_reference


# ---------------------------------------------------------------------------------------- helpers


def request_slots(block_table: torch.Tensor, r: int, start: int, end: int) -> torch.Tensor:
    """Slots of tokens ``start..end-1`` of request row ``r``."""
    idx = torch.arange(start, end)
    return block_table[r].long()[idx // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + idx % fmt.PAGE_SIZE


def summaries_for(p) -> BlockSummaries:
    """Summaries of a :func:`problems.make_problem` cache, every request written in one update."""
    s = BlockSummaries(p.cache.shape[0], p.hkv)
    s.update(p.cache, torch.cat([request_slots(p.block_table, r, 0, n) for r, n in enumerate(p.seq_lens)]))
    return s


def exact_problem(seed, seq_lens, tokens_per_request, hkv=2, group=4, distinct_summaries=3, spare_pages=3):
    """Integer-valued summaries (drawn from a small pool, so equal scores are common) and queries: every
    score is exact in fp16/fp32 whatever the summation order. Requests sit on shuffled pages; query
    tokens are random positions of each request. Returns (q, summaries, block_table, req, pos)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_block_table(gen, seq_lens, spare_pages)
    s = BlockSummaries(num_pages, hkv)
    pool_mean = torch.randint(-8, 9, (distinct_summaries, hkv, fmt.HEAD_DIM), generator=gen)
    pool_min = torch.randint(-8, 1, (distinct_summaries, hkv, fmt.HEAD_DIM), generator=gen)
    pool_max = pool_min + torch.randint(0, 9, pool_min.shape, generator=gen)
    pick = torch.randint(0, distinct_summaries, (num_pages,), generator=gen)
    s.mean.copy_(pool_mean[pick].half())
    s.bounds.copy_(torch.stack((pool_max[pick], pool_min[pick]), dim=2).half())
    s.fill.fill_(fmt.PAGE_SIZE)
    req = torch.cat([torch.full((m,), r, dtype=torch.int32) for r, m in enumerate(tokens_per_request)])
    pos = torch.cat([torch.randint(0, n, (m,), generator=gen, dtype=torch.int32) for n, m in zip(seq_lens, tokens_per_request)])
    q = torch.randint(-3, 4, (len(req), hkv * group, fmt.HEAD_DIM), generator=gen).float()
    return q, s, table, req, pos


def brute_force_selection(q, s, table, req, pos, topk, sink_blocks, local_blocks, method):
    """The documented rule, one (KV head, token) at a time in float64: sum over the head group of the
    per-head score, own/sink/local forced, the rest by (score desc, block id asc), ascending ids."""
    hkv = s.num_kv_heads
    group = q.shape[1] // hkv
    out = torch.full((hkv, q.shape[0], topk), -1, dtype=torch.int32)
    for h in range(hkv):
        for t in range(q.shape[0]):
            own = int(pos[t]) // fmt.PAGE_SIZE
            qs = q[t, h * group : (h + 1) * group].double()
            scores = {}
            for b in range(own + 1):
                page = int(table[req[t], b])
                if method == "mean":
                    scores[b] = float((qs @ s.mean[page, h].double()).sum())
                else:
                    hi, lo = s.bounds[page, h, 0].double(), s.bounds[page, h, 1].double()
                    scores[b] = float(torch.maximum(qs * hi, qs * lo).sum())
            forced = {b for b in scores if b == own or b < sink_blocks or b >= own - local_blocks}
            rest = sorted((b for b in scores if b not in forced), key=lambda b: (-scores[b], b))
            chosen = sorted(forced | set(rest[: topk - len(forced)]))
            out[h, t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def nvfp4_code_values(k: torch.Tensor, k_scale: float) -> torch.Tensor:
    """What the cache holds for ``k`` in units of the global scale (``e2m1 * e4m3``), float64."""
    return fmt.dequantize_nvfp4(*fmt.quantize_nvfp4(k, k_scale), 1.0).double()


# -------------------------------------------------------------------------------------- summaries


class WriteLog:
    """A cache and its summaries, plus an independent record of which key each page row holds."""

    def __init__(self, num_pages, hkv, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = fmt.alloc_cache(num_pages, hkv).random_(0, 256, generator=self.gen)  # stale bytes, NaN scales too
        self.summaries = BlockSummaries(num_pages, hkv)
        self.rows = {}  # page -> {row: key values [Hkv, 128]}
        self.k_scale = 0.5

    def write(self, pages_rows):
        pages_rows = torch.tensor(pages_rows)
        slots = pages_rows[:, 0] * fmt.PAGE_SIZE + pages_rows[:, 1]
        k = torch.randn(len(slots), self.summaries.num_kv_heads, fmt.HEAD_DIM, generator=self.gen) * 3
        v = torch.randn(k.shape, generator=self.gen)
        fmt.write_kv(self.cache, slots, k, v, self.k_scale, 1.0)
        self.summaries.update(self.cache, slots)
        values = nvfp4_code_values(k, self.k_scale)
        for page, row in pages_rows.tolist():
            if row == 0:  # a page's first row: (re)allocated to a new owner
                self.rows[page] = {}
        for (page, row), kv in zip(pages_rows.tolist(), values):
            self.rows[page][row] = kv

    def check(self):
        for page, rows in self.rows.items():
            filled = max(rows) + 1
            assert sorted(rows) == list(range(filled)), "test writes pages in row order"
            keys = torch.stack([rows[r] for r in range(filled)], dim=1)  # [Hkv, rows, 128]
            assert int(self.summaries.fill[page]) == filled
            assert torch.equal(self.summaries.bounds[page, :, 0], keys.amax(dim=1).half())
            assert torch.equal(self.summaries.bounds[page, :, 1], keys.amin(dim=1).half())
            want = keys.mean(dim=1)
            got = self.summaries.mean[page].double()
            assert torch.allclose(got, want, rtol=2.0**-10, atol=2.0**-24), (got - want).abs().max()


def test_summaries_follow_partial_pages_chunks_and_page_reuse():
    log = WriteLog(num_pages=6, hkv=2, seed=0)
    assert int(log.summaries.fill.sum()) == 0
    log.write([(3, r) for r in range(100)])  # prefill chunk ending mid-page
    log.check()
    log.write([(3, r) for r in range(100, 128)] + [(1, r) for r in range(50)])  # unaligned chunk over two pages
    log.check()
    for r in (50, 51):  # decode steps
        log.write([(1, r)])
        log.check()
    before = log.summaries.mean[3].clone()
    log.write([(0, r) for r in torch.randperm(40, generator=log.gen).tolist()])  # another request, rows out of order
    log.check()
    assert torch.equal(log.summaries.mean[3], before)  # untouched page keeps its summary
    # page 3 is freed and reused by a new request: its 10 new rows replace the old owner's 128
    log.write([(3, r) for r in range(10)])
    assert int(log.summaries.fill[3]) == 10
    log.check()
    log.write([(3, 10), (0, 40), (5, 0)])  # a decode batch over three requests
    log.check()
    assert int(log.summaries.fill[2]) == 0 and int(log.summaries.fill[4]) == 0


def test_summaries_without_minmax_serve_mean_only():
    p = make_problem(3, [300], [10], num_kv_heads=2)
    s = BlockSummaries(p.cache.shape[0], 2, minmax=False)
    s.update(p.cache, request_slots(p.block_table, 0, 0, 300))
    full = summaries_for(p)
    assert s.bounds is None and torch.equal(s.mean, full.mean)
    assert torch.equal(select_blocks(p.q, s, p.block_table, p.req, p.pos, method="mean"),
                       select_blocks(p.q, full, p.block_table, p.req, p.pos, method="mean"))
    with pytest.raises(ValueError, match="method"):
        select_blocks(p.q, s, p.block_table, p.req, p.pos, method="quest")


# -------------------------------------------------------------------------------------- selection


@pytest.mark.parametrize("method", ["mean", "quest"])
@pytest.mark.parametrize("topk, sink_blocks, local_blocks", [(16, 1, 1), (8, 2, 3), (5, 0, 0), (12, 0, 4)])
def test_selection_follows_the_documented_rule(method, topk, sink_blocks, local_blocks):
    # three requests, up to 40 blocks, many exactly equal scores (tie rule), tokens in any block
    q, s, table, req, pos = exact_problem(1, [5000, 1100, 300], [24, 12, 6])
    got = select_blocks(q, s, table, req, pos, topk=topk, sink_blocks=sink_blocks, local_blocks=local_blocks,
                        method=method)
    want = brute_force_selection(q, s, table, req, pos, topk, sink_blocks, local_blocks, method)
    assert got.dtype == torch.int32 and got.shape == (2, len(req), topk)
    assert torch.equal(got, want)


def test_selection_structure_on_random_data():
    p = make_problem(4, [6000, 2100, 130], [200, 60, 2], num_kv_heads=2)
    s = summaries_for(p)
    sel = select_blocks(p.q, s, p.block_table, p.req, p.pos, topk=16, sink_blocks=1, local_blocks=2)
    own = (p.pos // fmt.PAGE_SIZE).long()
    for h in range(2):
        for t in range(len(own)):
            row = sel[h, t].tolist()
            n = min(16, int(own[t]) + 1)
            assert all(b >= 0 for b in row[:n]) and all(b == -1 for b in row[n:]), row  # -1 only as tail padding
            assert row[:n] == sorted(set(row[:n]))  # distinct, ascending
            assert max(row[:n]) == int(own[t])  # own block present, nothing after it (causal)
            assert 0 in row and set(range(max(0, int(own[t]) - 2), int(own[t]))) <= set(row)  # sink and local
    # a different query changes the scored part of the selection (it is not just a window)
    other = select_blocks(-p.q, s, p.block_table, p.req, p.pos, topk=16, sink_blocks=1, local_blocks=2)
    assert not torch.equal(other, sel)


def test_short_sequences_are_exactly_dense():
    # every token sees <= 16 blocks: the selection is all of them and attention equals dense attention
    p = make_problem(5, [2048, 700, 129], [60, 30, 129], num_kv_heads=2, k_scale=0.5, v_scale=2.0)
    s = summaries_for(p)
    rest = (p.block_table, p.req, p.pos, p.k_scale, p.v_scale, p.sm_scale)
    dense = sparse_prefill_reference(p.q, p.cache, all_block_ids(p), *rest)
    for method in ("mean", "quest"):
        sel = select_blocks(p.q, s, p.block_table, p.req, p.pos, method=method)
        assert torch.equal(sel, all_block_ids(p))
        assert torch.equal(sparse_prefill_reference(p.q, p.cache, sel, *rest), dense)


def test_shared_prefix_pages_are_scored_from_their_page():
    # request 1 shares request 0's first 8 pages (a radix-cache prefix) and then diverges
    q, s, table, req, pos = exact_problem(2, [3000, 1500], [10, 10])
    table[1, :8] = table[0, :8]
    pos[10:] = torch.arange(1400, 1500, 10, dtype=torch.int32)
    got = select_blocks(q, s, table, req, pos, method="quest", topk=6)
    assert torch.equal(got, brute_force_selection(q, s, table, req, pos, 6, 1, 1, "quest"))


def test_empty_inputs():
    q, s, table, req, pos = exact_problem(3, [500], [4])
    sel = select_blocks(q[:0], s, table, req[:0], pos[:0])
    assert sel.shape == (2, 0, 16) and sel.dtype == torch.int32
    before = s.mean.clone()
    s.update(fmt.alloc_cache(s.num_pages, 2), torch.empty(0, dtype=torch.int64))
    assert torch.equal(s.mean, before)


# ----------------------------------------------------------------------------------------- oracle


def test_block_mass_and_oracle_against_independent_dense_softmax():
    p = make_problem(6, [3000, 1000], [6, 3], num_kv_heads=2, k_scale=0.5)
    mass = block_attention_mass(p.q, p.cache, p.block_table, p.req, p.pos, p.k_scale, p.sm_scale)
    group = p.q.shape[1] // p.hkv
    for t in range(p.q.shape[0]):
        r, n = int(p.req[t]), int(p.pos[t]) + 1
        blocks = -(-n // fmt.PAGE_SIZE)
        k, _ = fmt.read_kv(p.cache, p.block_table[r, :blocks], p.k_scale, 1.0)
        for h in range(p.hkv):
            keys = k[:, h].reshape(-1, fmt.HEAD_DIM)[:n].double()
            w = torch.softmax(p.q[t, h * group : (h + 1) * group].double() @ keys.T * p.sm_scale, dim=-1).sum(0)
            want = torch.zeros(mass.shape[-1], dtype=torch.float64)
            want[:blocks] = torch.nn.functional.pad(w, (0, blocks * fmt.PAGE_SIZE - n)).view(blocks, -1).sum(-1)
            assert torch.allclose(mass[h, t], want, rtol=1e-4, atol=1e-9)
    oracle = oracle_blocks(mass, p.pos, topk=4)
    for h in range(p.hkv):
        for t in range(p.q.shape[0]):
            row = oracle[h, t]
            n = min(4, int(p.pos[t]) // fmt.PAGE_SIZE + 1)
            assert (row[n:] == -1).all() and row[:n].tolist() == sorted(row[:n].tolist())
            best = mass[h, t].sort(descending=True).values[:n].sum()
            assert math.isclose(float(mass[h, t, row[:n].long()].sum()), float(best), rel_tol=1e-12)


# --------------------------------------------------------------------------------------- protocol


class NewestBlocksIndexer:
    """A stand-in for a model-provided indexer: keeps one int per token slot, selects the newest blocks."""

    topk = 4

    def __init__(self, num_slots: int):
        self.stamp = torch.zeros(num_slots, dtype=torch.int32)  # per-token state: which call wrote the slot
        self.calls = 0

    @staticmethod
    def state_bytes(num_layers: int, num_kv_heads: int) -> StateBytes:
        return StateBytes(per_token=4)

    def state_nbytes(self) -> int:
        return self.stamp.nbytes

    def on_kv_written(self, layer_id, cache, slots, **model_inputs):
        self.calls += 1
        self.stamp[slots.long()] = self.calls
        self.seen = (layer_id, slots.numel(), model_inputs)

    def save_tokens(self, layer_id, slots):
        return self.stamp[slots.long()].clone()

    def restore_tokens(self, layer_id, cache, slots, saved):
        self.stamp[slots.long()] = saved

    def select(self, layer_id, q, cache, block_table, req, pos, **model_inputs):
        own = (pos.long() // fmt.PAGE_SIZE)[None, :, None]
        ids = own - torch.arange(self.topk)[None, None, :]
        return torch.where(ids >= 0, ids, -1).int().expand(fmt.check_cache(cache), -1, -1).contiguous()


def test_indexers_are_interchangeable_behind_the_protocol():
    p = make_problem(7, [2600, 900], [50, 20], num_kv_heads=2)
    default = SummaryIndexer(num_layers=2, num_pages=p.cache.shape[0], num_kv_heads=2)
    newest = NewestBlocksIndexer(p.cache.shape[0] * fmt.PAGE_SIZE)
    proxy = ProxyIndexer(num_layers=2, num_pages=p.cache.shape[0], num_kv_heads=2)
    for indexer in (default, newest, proxy):
        assert isinstance(indexer, BlockIndexer)
        for r, n in enumerate(p.seq_lens):
            indexer.on_kv_written(1, p.cache, request_slots(p.block_table, r, 0, n), idx_k=None)
        block_ids = indexer.select(1, p.q, p.cache, p.block_table, p.req, p.pos, idx_q=None)
        assert block_ids.shape == (2, p.q.shape[0], indexer.topk) and block_ids.dtype == torch.int32
        sparse_prefill_reference(p.q, p.cache, block_ids, p.block_table, p.req, p.pos, 1.0, 1.0, p.sm_scale)
    assert newest.seen == (1, 900, {"idx_k": None})
    assert torch.equal(default.summaries[1].mean, summaries_for(p).mean)
    assert int(default.summaries[0].fill.sum()) == 0  # layers are independent
    assert torch.equal(default.select(1, p.q, p.cache, p.block_table, p.req, p.pos),
                       select_blocks(p.q, summaries_for(p), p.block_table, p.req, p.pos, method="quest"))


def test_summary_indexer_states_the_bytes_it_allocates():
    for method, per_head in (("quest", 768), ("mean", 256)):
        state = SummaryIndexer.state_bytes(num_layers=3, num_kv_heads=2, method=method)
        assert state == StateBytes(per_page=3 * (2 * per_head + 8), per_token=0)
        indexer = SummaryIndexer(3, 10, 2, method=method)
        assert indexer.state_nbytes() == 10 * state.per_page
        assert indexer.save_tokens(0, torch.arange(5)) is None


# ----------------------------------------------------------------------------------------- errors


def test_bad_arguments_raise_value_errors_naming_them():
    q, s, table, req, pos = exact_problem(8, [1000], [5])
    ok = dict(q=q, summaries=s, block_table=table, req=req, pos=pos)

    def call(**kw):
        args = {**ok, **kw}
        opts = {k: args.pop(k) for k in ("topk", "sink_blocks", "local_blocks", "method", "impl") if k in args}
        return select_blocks(args["q"], args["summaries"], args["block_table"], args["req"], args["pos"], **opts)

    cases = [
        ("q", dict(q=q[:, :, :64])),
        ("q", dict(q=q.double())),
        ("q", dict(q=q[:, :7])),
        ("summaries", dict(summaries=s.mean)),
        ("block_table", dict(block_table=table.long())),
        ("req", dict(req=req[:-1])),
        ("pos", dict(pos=pos.long())),
        ("topk", dict(topk=0)),
        ("topk", dict(topk=3, sink_blocks=1, local_blocks=2)),
        ("sink_blocks", dict(sink_blocks=-1)),
        ("method", dict(method="max")),
        ("impl", dict(impl="cuda")),
        ("req", dict(req=torch.full_like(req, 1))),
        ("pos", dict(pos=torch.full_like(pos, -1))),
        ("pos", dict(pos=torch.full_like(pos, table.shape[1] * fmt.PAGE_SIZE))),
        ("block_table", dict(block_table=torch.full_like(table, -1))),
    ]
    for name, kw in cases:
        with pytest.raises(ValueError, match=name):
            call(**kw)
    cache = fmt.alloc_cache(s.num_pages, 2)
    for name, args in [
        ("cache", (fmt.alloc_cache(s.num_pages + 1, 2), torch.tensor([0]))),
        ("cache", (fmt.alloc_cache(s.num_pages, 1), torch.tensor([0]))),
        ("slots", (cache, torch.tensor([0.0]))),
        ("slots", (cache, torch.tensor([[0]]))),
        ("slots", (cache, torch.tensor([s.num_pages * fmt.PAGE_SIZE]))),
    ]:
        with pytest.raises(ValueError, match=name):
            s.update(*args)
    with pytest.raises(ValueError, match="num_pages"):
        BlockSummaries(-1, 2)
    with pytest.raises(ValueError, match="method"):
        SummaryIndexer(1, 4, 2, method="max")
    with pytest.raises(ValueError, match="topk"):
        oracle_blocks(torch.zeros(2, len(pos), table.shape[1], dtype=torch.float64), pos, topk=0)
