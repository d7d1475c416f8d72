"""Block indexer, Triton kernels against the torch path: on CPU under the Triton interpreter (this
module re-runs itself in a subprocess with ``TRITON_INTERPRET=1``, which must be set before the kernels
are defined), and compiled on a GPU when one is present. The parent process never imports triton, so
this module leaves no triton state behind for the modules that run after it."""

import importlib.util
import os

import pytest
import torch

from problems import make_problem
from triton_interpreter import assert_module_passed, register_module
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import BlockSummaries, aggregate_queries, select_blocks
from test_indexer import exact_problem, request_slots

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
register_module(__file__, expected_passed=3, timeout=900, run_s=50)


def check_summary_kernel(device):
    # prefill chunks ending mid-page, a decode batch, a reused page (fewer rows than its stale bytes),
    # duplicate padding slots (graph-padded decode batches write slot 0 repeatedly); rows never written
    # hold random bytes, NaN scale codes included, which must not reach any summary
    gen = torch.Generator().manual_seed(0)
    cache = fmt.alloc_cache(7, 2).random_(0, 256, generator=gen).to(device)
    ref, tri = BlockSummaries(7, 2, device), BlockSummaries(7, 2, device)
    mean_only = BlockSummaries(7, 2, device, minmax=False)
    writes = [
        torch.arange(5 * 128, 5 * 128 + 200),  # pages 5 and 6 (unaligned end)
        torch.cat([torch.arange(6 * 128 + 72, 6 * 128 + 90), torch.arange(2 * 128, 2 * 128 + 30)]),
        torch.tensor([2 * 128 + 30, 6 * 128 + 90, 3 * 128]),  # decode batch
        torch.arange(5 * 128, 5 * 128 + 17),  # page 5 reused by a new request
        torch.tensor([0, 0, 0, 4 * 128]),  # padding slots
        torch.tensor([3 * 128 + 1]),  # a NaN key: propagates into both implementations alike
    ]
    for slots in writes:
        slots = slots.to(device)
        distinct = torch.unique(slots)
        k, v = torch.randn(2, len(distinct), 2, fmt.HEAD_DIM, generator=gen).to(device)
        if slots[0] == 3 * 128 + 1:
            k[0, 1, 5] = float("nan")
        fmt.write_kv(cache, distinct, k, v, 0.25, 1.0)
        ref.update(cache, slots, impl="torch")
        tri.update(cache, slots, impl="triton")
        mean_only.update(cache, slots, impl="triton")
        assert torch.equal(tri.fill, ref.fill)
        torch.testing.assert_close(tri.bounds, ref.bounds, rtol=0, atol=0, equal_nan=True)
        # the mean may differ by fp32 summation order before its fp16 rounding: at most one fp16 ulp
        torch.testing.assert_close(tri.mean, ref.mean, rtol=2.0**-10, atol=0, equal_nan=True)
        torch.testing.assert_close(mean_only.mean, tri.mean, rtol=0, atol=0, equal_nan=True)
        assert mean_only.bounds is None
        assert int(tri._last_row.max()) == -1  # scratch restored
    assert bool(tri.bounds[3, 1, :, 0:16].isnan().all()) and not bool(tri.bounds[3, 0].isnan().any())
    assert tri.fill.tolist() == [1, 0, 31, 2, 1, 17, 91]


def check_exact_selection(device):
    # exact integer scores with many ties: both implementations must agree bit for bit
    cases = [
        ([5000, 1100, 300], [1, 1, 1], 16, 1, 1),  # T <= R: one token per program (decode path)
        ([9000], [70], 16, 1, 1),  # one request: 64-token tiles, 71 blocks in two steps of 64
        ([5000, 1100, 300], [6, 3, 2], 12, 2, 3),  # a tile across requests; topk not a power of two
        ([700], [30], 5, 0, 0),
        ([9000, 5000], [40, 2], 64, 1, 1),  # budgets above 16 (up to format.MAX_TOPK)
        ([9000], [3], 32, 2, 3),
    ]
    for seed, (lens, per_request, topk, sink, local) in enumerate(cases):
        q, s, table, req, pos = exact_problem(10 + seed, lens, per_request)
        args = [x.to(device) for x in (q, table, req, pos)]
        s_dev = BlockSummaries(s.num_pages, s.num_kv_heads, device)
        s_dev.mean.copy_(s.mean)
        s_dev.bounds.copy_(s.bounds)
        for method in ("mean", "quest"):
            kw = dict(topk=topk, sink_blocks=sink, local_blocks=local, method=method)
            want = select_blocks(q, s, table, req, pos, impl="torch", **kw)
            got = select_blocks(args[0], s_dev, *args[1:], impl="triton", **kw)
            assert torch.equal(got.cpu(), want), (lens, method)


def check_random_selection(device):
    # real summaries of random data: rows may differ only where two blocks' scores agree to rounding
    p = make_problem(20, [9000, 900], [64, 8], num_heads=16, num_kv_heads=2, device=device)  # two 64-token tiles
    s = BlockSummaries(p.cache.shape[0], 2, device)
    s.update(p.cache, torch.cat([request_slots(p.block_table.cpu(), r, 0, n) for r, n in enumerate(p.seq_lens)]).to(device))
    for method in ("mean", "quest"):
        want = select_blocks(p.q, s, p.block_table, p.req, p.pos, method=method, impl="torch").cpu()
        got = select_blocks(p.q, s, p.block_table, p.req, p.pos, method=method, impl="triton").cpu()
        queries = aggregate_queries(p.q, 2, method).float().cpu()
        keys = s.keys(method).float().cpu()
        table, req = p.block_table.cpu().long(), p.req.cpu().long()
        for h, t in (got != want).any(-1).nonzero().tolist():
            visible = int(p.pos[t]) // fmt.PAGE_SIZE + 1
            scores = keys[table[req[t], :visible], h] @ queries[t, h]  # [visible blocks]
            differ = set(got[h, t].tolist()) ^ set(want[h, t].tolist())
            spread = scores[list(differ)]
            assert (spread.max() - spread.min()) <= 1e-5 * scores.abs().max(), (h, t, differ)
        assert (got == want).all(-1).double().mean() > 0.95
    # decode shape (one token per request: one program per token), q a strided view
    last = torch.tensor([n - 1 for n in p.seq_lens], dtype=torch.int32, device=device)
    rows = torch.arange(2, dtype=torch.int32, device=device)
    q = torch.cat([p.q[:2], p.q[:2]], dim=-1)[..., : fmt.HEAD_DIM]
    assert not q.is_contiguous()
    assert torch.equal(select_blocks(q, s, p.block_table, rows, last, impl="triton"),
                       select_blocks(q, s, p.block_table, rows, last, impl="torch"))


def check_cuda_graph():
    # a decode step's summary update and selection, captured once and replayed on new queries
    p = make_problem(21, [3000, 1000, 500], [1, 1, 1], num_heads=16, num_kv_heads=2, device="cuda")
    s = BlockSummaries(p.cache.shape[0], 2, "cuda")
    slots = (p.block_table[p.req.long(), (p.pos // fmt.PAGE_SIZE).long()].long() * fmt.PAGE_SIZE + p.pos % fmt.PAGE_SIZE)
    prefix = torch.cat([request_slots(p.block_table.cpu(), r, 0, n - 1) for r, n in enumerate(p.seq_lens)]).cuda()
    s.update(p.cache, prefix)
    q = p.q.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) outside the capture
        s.update(p.cache, slots)
        select_blocks(q, s, p.block_table, p.req, p.pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s.update(p.cache, slots)
        out = select_blocks(q, s, p.block_table, p.req, p.pos)
    fresh = BlockSummaries(p.cache.shape[0], 2, "cuda")
    fresh.update(p.cache, torch.cat([prefix, slots]), impl="torch")
    written_pages = slots // fmt.PAGE_SIZE
    replayed = []
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        s.bounds[written_pages] = 0  # the replayed update must recompute these
        s.fill[written_pages] = 0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(s.fill, fresh.fill) and torch.equal(s.bounds, fresh.bounds)
        assert torch.equal(out, select_blocks(q, s, p.block_table, p.req, p.pos, impl="triton"))
        replayed.append(out.clone())
    assert not torch.equal(*replayed)  # the replays saw the new queries


if INTERPRETED:

    def test_summary_kernel_matches_torch():
        check_summary_kernel("cpu")

    def test_selection_kernel_matches_torch_on_exact_ties():
        check_exact_selection("cpu")

    def test_selection_kernel_matches_torch_on_random_data():
        check_random_selection("cpu")

else:

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    def test_kernels_under_the_triton_interpreter():
        assert_module_passed(__file__)

    @pytest.mark.gpu
    @pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA/ROCm device")
    def test_compiled_kernels_match_torch():
        check_summary_kernel("cuda")
        check_exact_selection("cuda")
        check_random_selection("cuda")
        check_cuda_graph()
