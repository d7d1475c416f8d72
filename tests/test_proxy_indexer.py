"""The token-level proxy indexer (``NVFP4_SPARSE_INDEXER=proxy``): its selections against a float64
brute force of the documented score and rule, and its Triton kernels against the torch path (this module
re-runs itself under ``TRITON_INTERPRET=1`` on CPU, and runs the kernels compiled on a GPU)."""

import importlib.util
import os

import pytest
import torch

from problems import shuffled_block_table
from triton_interpreter import assert_module_passed, register_module
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import BlockIndexer, ProxyIndexer, StateBytes, select_blocks_proxy
from sglang_nvfp4.indexer.proxy import round_keys_fp8, round_queries_fp8

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
register_module(__file__, expected_passed=22, timeout=900, run_s=115)  # the torch tests run there too
E4M3_ONE = 0x38  # the E4M3 byte of 1.0


def exact_problem(seed, seq_lens, tokens_per_request, hkv=2, group=4, spare_pages=3):
    """A cache of random E2M1 codes with every K scale 1.0 (keys in {0, +-0.5, ..., +-6}), rows past each
    request's length random too (they must never count), and integer queries: the head means are multiples
    of 1/4, so every logit is exact in fp16/fp32 whatever the summation order, and equal scores are common.
    Returns (q [T, hkv * group, 128], cache, block_table, req, pos)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_block_table(gen, seq_lens, spare_pages)
    cache = fmt.alloc_cache(num_pages, hkv).random_(0, 256, generator=gen)
    cache[:, :hkv, :, fmt.SCALE_OFFSET :] = E4M3_ONE
    req = torch.cat([torch.full((m,), r, dtype=torch.int32) for r, m in enumerate(tokens_per_request)])
    pos = torch.cat([torch.randint(0, n, (m,), generator=gen, dtype=torch.int32)
                     for n, m in zip(seq_lens, tokens_per_request)])
    q = torch.randint(-2, 3, (len(req), hkv * group, fmt.HEAD_DIM), generator=gen).to(torch.bfloat16)
    return q, cache, table, req, pos


def random_problem(seed, hkv=2, group=4, seq_lens=(2600, 900), tokens=(30, 12)):
    """As :func:`exact_problem`, with Gaussian queries and K scales spread over E4M3's [2**-6, 2] (non-NaN codes):
    logits that fp8 rounding moves, and no exact ties."""
    q, cache, table, req, pos = exact_problem(seed, list(seq_lens), list(tokens), hkv=hkv, group=group)
    gen = torch.Generator().manual_seed(seed + 100)
    scales = cache[:, :hkv, :, fmt.SCALE_OFFSET :]
    scales.copy_(torch.randint(0x18, 0x48, scales.shape, generator=gen, dtype=torch.uint8))
    q = (torch.randn(q.shape, generator=gen) * 0.3).to(torch.bfloat16)
    return q, cache, table, req, pos


def brute_force_f64(q, cache, table, req, pos, topk, sink_blocks, local_blocks, groups=1, precision="fp16", share=1,
                    share_score="max"):
    """The documented score one (KV head, token) at a time in float64: each of the ``groups`` fp16 means of runs
    of consecutive query heads against every key at or before the token, max per block and over the runs;
    own/sink/local forced, the rest by (score desc, id asc). ``precision="fp8"``: the means and keys rounded as
    documented first (the rounding itself is checked against hand-computed values below). ``share`` > 1 in a batch
    with more tokens than table rows: consecutive tokens of a request with the same ``pos // share`` score each
    block by the max of their scores (``share_score="last"``: by their last token's) and select once."""
    hkv = cache.shape[1] // 2
    scores = {}  # (h, i) -> {block: score}
    for i in range(q.shape[0]):
        p, own = int(pos[i]), int(pos[i]) // fmt.PAGE_SIZE
        pages = table[int(req[i]), : own + 1].long()
        data = cache[pages, :hkv]
        k = fmt.dequantize_nvfp4(data[..., : fmt.SCALE_OFFSET], data[..., fmt.SCALE_OFFSET :], 1.0)
        k = (round_keys_fp8(k) if precision == "fp8" else k).double()
        for h in range(hkv):
            qbar = q[i].double().view(hkv, groups, -1, fmt.HEAD_DIM)[h].mean(1).half()  # [groups, 128]
            qbar = (round_queries_fp8(qbar) if precision == "fp8" else qbar).double()
            logits = (k[:, h].reshape(-1, fmt.HEAD_DIM)[: p + 1] @ qbar.T).amax(1)
            scores[h, i] = {b: float(logits[b * fmt.PAGE_SIZE : (b + 1) * fmt.PAGE_SIZE].max())
                            for b in range(own + 1)}
    runs = [[i] for i in range(q.shape[0])]
    if share > 1 and q.shape[0] > table.shape[0]:
        runs = []
        for i in range(q.shape[0]):
            if runs and int(req[i]) == int(req[i - 1]) and int(pos[i]) // share == int(pos[i - 1]) // share:
                runs[-1].append(i)
            else:
                runs.append([i])
    out = torch.full((hkv, q.shape[0], topk), -1, dtype=torch.int32)
    for run in runs:
        own = int(pos[run[-1]]) // fmt.PAGE_SIZE
        for h in range(hkv):
            scorers = run if share_score == "max" else run[-1:]
            score = {b: max(scores[h, i][b] for i in scorers) for b in range(own + 1)}
            forced = {b for b in score if b == own or b < sink_blocks or b >= own - local_blocks}
            rest = sorted((b for b in score if b not in forced), key=lambda b: (-score[b], b))
            chosen = sorted(forced | set(rest[: max(0, topk - len(forced))]))[:topk]
            out[h, run, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def prefill_problem(seed, seq_lens, starts, group=4):
    """:func:`exact_problem` as a prefill batch: request ``r`` holds its tokens at positions ``starts[r] ..
    seq_lens[r] - 1`` (consecutive, starts not aligned to any run)."""
    counts = [n - s for n, s in zip(seq_lens, starts)]
    q, cache, table, req, _ = exact_problem(seed, list(seq_lens), counts, group=group)
    pos = torch.cat([torch.arange(s, n, dtype=torch.int32) for n, s in zip(seq_lens, starts)])
    return q, cache, table, req, pos


@pytest.mark.parametrize("topk, sink, local, groups", [(16, 1, 1, 1), (4, 1, 1, 1), (6, 2, 0, 1), (3, 0, 0, 1),
                                                       (4, 1, 1, 2), (6, 1, 0, 4)])
def test_selection_follows_the_documented_score_and_rule(topk, sink, local, groups):
    q, cache, table, req, pos = exact_problem(1, [1900, 700, 130], [30, 20, 6])
    got = select_blocks_proxy(q, cache, table, req, pos, topk=topk, sink_blocks=sink, local_blocks=local,
                              groups=groups, impl="torch")
    assert torch.equal(got, brute_force_f64(q, cache, table, req, pos, topk, sink, local, groups))


def test_query_groups_change_the_selection_and_must_divide_the_heads():
    q, cache, table, req, pos = exact_problem(3, [2600], [40])
    one, four = (select_blocks_proxy(q, cache, table, req, pos, topk=4, groups=g, impl="torch") for g in (1, 4))
    assert not torch.equal(one, four)  # the groups are scored, not averaged away
    every_head = select_blocks_proxy(q, cache, table, req, pos, topk=4, groups=None, impl="torch")
    assert torch.equal(every_head, brute_force_f64(q, cache, table, req, pos, 4, 1, 1, groups=4))
    with pytest.raises(ValueError, match="groups=3: must divide the 4 query heads"):
        select_blocks_proxy(q, cache, table, req, pos, topk=4, groups=3)


@pytest.mark.parametrize("share, topk, groups, score", [(8, 4, 1, "max"), (4, 6, None, "max"), (128, 4, 2, "max"),
                                                       (8, 4, None, "last"), (16, 6, 2, "last")])
def test_shared_selection_follows_the_documented_rule(share, topk, groups, score):
    # three requests, their chunks starting mid-run and mid-block; the third's tokens all in one block
    q, cache, table, req, pos = prefill_problem(5, [1400, 700, 200], [1337, 645, 133])
    got = select_blocks_proxy(q, cache, table, req, pos, topk=topk, groups=groups, share=share, share_score=score,
                              impl="torch")
    want = brute_force_f64(q, cache, table, req, pos, topk, 1, 1, groups or 4, share=share, share_score=score)
    assert torch.equal(got, want)
    alone = select_blocks_proxy(q, cache, table, req, pos, topk=topk, groups=groups, impl="torch")
    assert not torch.equal(got, alone)  # the runs change selections on this problem
    # every token of a run holds the run's selection, and runs break at requests and at multiples of share
    key = req.long() * 10**6 + pos.long() // share
    for k in key.unique():
        rows = got[:, key == k]
        assert torch.equal(rows, rows[:, :1].expand_as(rows))


def test_token_runs_by_hand():
    from sglang_nvfp4.indexer.rules import at_run_ends, max_runs, token_runs

    # request 0: positions 6..12 (runs of 4: 6-7, 8-11, 12); request 1: positions 3..5 (runs 3, 4-5)
    req = torch.tensor([0] * 7 + [1] * 3, dtype=torch.int32)
    pos = torch.tensor([6, 7, 8, 9, 10, 11, 12, 3, 4, 5], dtype=torch.int32)
    runs = max_runs(10, 2, 4)  # 10 // 4 + 2 * 2 = 6
    run, run_pos = token_runs(req, pos, 4, runs)
    assert run.tolist() == [0, 0, 1, 1, 1, 1, 2, 3, 4, 4]
    assert run_pos.tolist() == [7, 11, 12, 3, 5, 0]  # the unused run holds 0
    assert at_run_ends(run, torch.arange(10), runs).tolist() == [1, 5, 6, 7, 9, 0]
    # a buffer of 2 runs: the tokens past it join the last run, which ends at the batch's last token
    run, run_pos = token_runs(req, pos, 4, 2)
    assert run.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert run_pos.tolist() == [7, 5]


def test_shared_selection_leaves_decode_batches_and_checks_its_value():
    # one token per table row (decode): each token selects alone whatever share says
    q, cache, table, req, pos = exact_problem(6, [2600, 2500, 1300], [1, 1, 1])
    pos = torch.tensor([2599, 2499, 1299], dtype=torch.int32)
    shared = select_blocks_proxy(q, cache, table, req, pos, topk=4, share=16, impl="torch")
    assert torch.equal(shared, select_blocks_proxy(q, cache, table, req, pos, topk=4, impl="torch"))
    for bad in (0, 3, 256):
        with pytest.raises(ValueError, match=f"share={bad}: expected one of \\(1, 2, 4, 8, 16, 32, 64, 128\\)"):
            select_blocks_proxy(q, cache, table, req, pos, share=bad)
        with pytest.raises(ValueError, match=f"share={bad}"):
            ProxyIndexer(2, 5, 2, "cpu", share=bad)
    with pytest.raises(ValueError, match="share_score='mean': expected one of \\('max', 'last'\\)"):
        select_blocks_proxy(q, cache, table, req, pos, share=8, share_score="mean")
    # the backend plans with the indexer's runs: predecoding needs more tokens per slot when runs share selections
    assert [ProxyIndexer(2, 5, 2, "cpu", share=share).selection_run for share in (1, 8)] == [1, 8]


def test_fp8_rounding_of_queries_and_keys_by_hand():
    # a row whose largest magnitude is 1.5 is scaled by 2**7 (1.5 * 128 = 192 in [128, 256)); E4M3 keeps 4 bits
    row = torch.tensor([1.5, 0.3, -0.1, 0.07421875, 0.998, 1e-4, 0.0])
    got = round_queries_fp8(torch.stack([row, torch.zeros(7), row / 1024]))
    # 38.4 -> 40 (step 4); -12.8 -> -13; 9.5 -> 10 (a tie, to the even mantissa); 127.74 -> 128 (carries into
    # the next power of two); 0.0128 -> 7 * 2**-9 (subnormal step)
    want = torch.tensor([1.5, 40 / 128, -13 / 128, 10 / 128, 1.0, 7 / 2**9 / 128, 0.0])
    assert torch.equal(got[0], want) and torch.equal(got[1], torch.zeros(7))
    assert torch.equal(got[2], want / 1024)  # the scale follows the row's magnitude: the same bits
    # keys / 8: 13 -> 1.625 (exact); 2688 -> 336, a tie between 320 and 352, to the even 320; 0.75 exact
    assert torch.equal(round_keys_fp8(torch.tensor([13.0, 2688.0, -0.75, 3.3])),
                       torch.tensor([13.0, 2560.0, -0.75, 3.25]))


@pytest.mark.parametrize("groups", [1, None])
def test_fp8_selection_follows_the_documented_rounding(groups):
    q, cache, table, req, pos = random_problem(0)
    fp8 = select_blocks_proxy(q, cache, table, req, pos, topk=6, groups=groups, precision="fp8", impl="torch")
    fp16 = select_blocks_proxy(q, cache, table, req, pos, topk=6, groups=groups, impl="torch")
    assert not torch.equal(fp8, fp16)  # the rounding is applied, and it moves some selections on this problem
    assert torch.equal(fp8, brute_force_f64(q, cache, table, req, pos, 6, 1, 1, groups or 4, precision="fp8"))
    with pytest.raises(ValueError, match="precision='fp4': expected one of \\('fp16', 'fp8'\\)"):
        select_blocks_proxy(q, cache, table, req, pos, precision="fp4")


def test_proxy_indexer_keeps_no_state_and_is_configurable():
    from sglang_nvfp4.sglang.config import DEFAULT_TOPK, load_config

    ix = ProxyIndexer(2, 5, 2, "cpu", topk=8, sink_blocks=1, local_blocks=1)
    assert isinstance(ix, BlockIndexer) and ix.state_nbytes() == 0
    assert ProxyIndexer.state_bytes(2, 2, topk=8) == StateBytes()
    q, cache, table, req, pos = exact_problem(2, [1300], [10])
    assert torch.equal(ix.select(0, q, cache, table, req, pos),
                       select_blocks_proxy(q, cache, table, req, pos, topk=8, sink_blocks=1, local_blocks=1))
    config = load_config({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_TOPK": "8"})
    selection = {"topk": 8, "sink_blocks": 1, "local_blocks": 1, "groups": None, "precision": "fp8",
                 "share": 8, "share_score": "last"}  # the defaults
    assert config.indexer_kind(0, 2) == (ProxyIndexer, selection)
    assert config.indexer_state_bytes(2, 2) == StateBytes()
    grouped = load_config({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_PROXY_GROUPS": "4"})
    grouped = grouped.build_indexer(2, 5, 2, "cpu")
    want = select_blocks_proxy(q, cache, table, req, pos, topk=DEFAULT_TOPK, groups=4, share=8, share_score="last")
    assert grouped.groups == 4 and torch.equal(grouped.select(0, q, cache, table, req, pos), want)
    assert load_config({"NVFP4_SPARSE_PROXY_GROUPS": "2"}).proxy_groups == 2  # proxy is the default indexer
    with pytest.raises(ValueError, match="PROXY_GROUPS=2: applies to NVFP4_SPARSE_INDEXER=proxy only"):
        load_config({"NVFP4_SPARSE_INDEXER": "quest", "NVFP4_SPARSE_PROXY_GROUPS": "2"})
    with pytest.raises(ValueError, match="PROXY_GROUPS=0: expected 1..64"):
        load_config({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_PROXY_GROUPS": "0"})
    with pytest.raises(ValueError, match="PROXY_GROUPS='four': expected 'all' or an integer 1..64"):
        load_config({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_PROXY_GROUPS": "four"})
    fp16 = load_config({"NVFP4_SPARSE_PROXY_PRECISION": "fp16"}).build_indexer(2, 5, 2, "cpu")
    assert fp16.precision == "fp16" and torch.equal(
        fp16.select(0, q, cache, table, req, pos),
        select_blocks_proxy(q, cache, table, req, pos, topk=DEFAULT_TOPK, groups=None, precision="fp16", share=8,
                            share_score="last"))
    with pytest.raises(ValueError, match="PROXY_PRECISION=fp8: applies to NVFP4_SPARSE_INDEXER=proxy only"):
        load_config({"NVFP4_SPARSE_INDEXER": "quest", "NVFP4_SPARSE_PROXY_PRECISION": "fp8"})
    with pytest.raises(ValueError, match="PROXY_PRECISION='bf16': expected one of \\('fp16', 'fp8'\\)"):
        load_config({"NVFP4_SPARSE_PROXY_PRECISION": "bf16"})
    every_head = load_config({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_PROXY_GROUPS": "all"})
    every_head.check_model(2, fmt.HEAD_DIM, heads_per_kv=12)  # any head count: one query per head
    every_head = every_head.build_indexer(2, 5, 2, "cpu")
    assert every_head.groups is None and torch.equal(every_head.select(0, q, cache, table, req, pos), want)
    with pytest.raises(ValueError, match="INDEXER='bogus': expected one of \\('mean', 'quest', 'proxy'\\)"):
        load_config({"NVFP4_SPARSE_INDEXER": "bogus"})
    shared = load_config({"NVFP4_SPARSE_PROXY_SHARE": "8"}).build_indexer(2, 5, 2, "cpu")
    q, cache, table, req, pos = prefill_problem(2, [1300], [1250])
    assert shared.share == 8 and torch.equal(
        shared.select(0, q, cache, table, req, pos),
        select_blocks_proxy(q, cache, table, req, pos, topk=DEFAULT_TOPK, groups=None, precision="fp8", share=8))
    with pytest.raises(ValueError, match="PROXY_SHARE=8: applies to NVFP4_SPARSE_INDEXER=proxy only"):
        load_config({"NVFP4_SPARSE_INDEXER": "quest", "NVFP4_SPARSE_PROXY_SHARE": "8"})
    with pytest.raises(ValueError, match="PROXY_SHARE=12: expected one of \\(1, 2, 4, 8, 16, 32, 64, 128\\)"):
        load_config({"NVFP4_SPARSE_PROXY_SHARE": "12"})
    with pytest.raises(ValueError, match="PROXY_SHARE=256: expected 1..128"):
        load_config({"NVFP4_SPARSE_PROXY_SHARE": "256"})
    last = load_config({"NVFP4_SPARSE_PROXY_SHARE": "8", "NVFP4_SPARSE_PROXY_SHARE_SCORE": "last"})
    assert last.build_indexer(2, 5, 2, "cpu").share_score == "last"
    with pytest.raises(ValueError, match="PROXY_SHARE_SCORE=last: applies to NVFP4_SPARSE_PROXY_SHARE > 1 only"):
        load_config({"NVFP4_SPARSE_PROXY_SHARE": "1", "NVFP4_SPARSE_PROXY_SHARE_SCORE": "last"})
    with pytest.raises(ValueError, match="PROXY_SHARE_SCORE=max: applies to NVFP4_SPARSE_INDEXER=proxy only"):
        load_config({"NVFP4_SPARSE_INDEXER": "quest", "NVFP4_SPARSE_PROXY_SHARE_SCORE": "max"})
    # the default: runs of 8 scored by their last token; PROXY_SHARE=1 selects per token (top-4 on a problem where
    # the two differ)
    q, cache, table, req, pos = prefill_problem(5, [1400, 700, 200], [1337, 645, 133])
    default = load_config({"NVFP4_SPARSE_TOPK": "4"}).build_indexer(2, 5, 2, "cpu")
    assert (default.share, default.share_score) == (8, "last") and torch.equal(
        default.select(0, q, cache, table, req, pos),
        select_blocks_proxy(q, cache, table, req, pos, topk=4, groups=None, precision="fp8", share=8,
                            share_score="last"))
    per_token = load_config({"NVFP4_SPARSE_TOPK": "4", "NVFP4_SPARSE_PROXY_SHARE": "1"}).build_indexer(2, 5, 2, "cpu")
    assert (per_token.share, per_token.share_score) == (1, "max")
    assert not torch.equal(per_token.select(0, q, cache, table, req, pos), default.select(0, q, cache, table, req, pos))
    assert load_config({"NVFP4_SPARSE_PROXY_SHARE_SCORE": "max"}).build_indexer(2, 5, 2, "cpu").share_score == "max"
    with pytest.raises(ValueError, match="PROXY_SHARE_SCORE='first': expected one of \\('max', 'last'\\)"):
        load_config({"NVFP4_SPARSE_PROXY_SHARE": "8", "NVFP4_SPARSE_PROXY_SHARE_SCORE": "first"})


def check_kernel_on_exact_ties(device):
    # prefill tiles within and across requests, decode-like batches (one token per request), GQA 4, 12 and 16
    # query groups: 1, 2, 4 and 16 per KV head (prefill tiles of 128, 64, 32 and 8 tokens), 4 in decode; 3 groups
    # of GQA 12 pad each token's rows to 4 (a padding row scores 0 and must not enter the max over groups).
    # Every case selects top-16 (sink 1, local 1) and one more rule; each other rule meets a prefill across
    # requests, a one-request prefill and a decode batch (the interpreter takes ~1 s per rule and case at
    # top-16, up to ~10 s at format.MAX_TOPK).
    budgets = {"few": (5, 2, 0), "32": (32, 1, 1), "max": (fmt.MAX_TOPK, 2, 3)}
    cases = [(4, [1900, 700, 130], [40, 25, 9], 4, 1, "max"), (5, [5000], [70], 16, 1, "few"),
             (6, [2800, 2500, 1300], [1, 1, 1], 4, 1, "32"), (7, [1900, 700, 130], [40, 25, 9], 4, 2, "32"),
             (8, [3000], [70], 16, 4, "max"), (9, [2800, 2500, 1300], [1, 1, 1], 4, 4, "few"),
             (10, [1900, 700, 130], [40, 25, 9], 12, 3, "few"), (11, [2800, 2500, 1300], [1, 1, 1], 12, 3, "max"),
             (12, [3000], [70], 16, 16, "32")]
    for seed, seq_lens, tokens, group, groups, budget in cases:
        q, cache, table, req, pos = exact_problem(seed, seq_lens, tokens, group=group)
        if group % 4:  # every logit negative (keys >= 0, queries <= 0), so a padding row's 0 would win the max
            cache[:, : cache.shape[1] // 2, :, : fmt.SCALE_OFFSET] &= 0x77  # clear both E2M1 sign bits
            q = -q.abs()
        if tokens[0] == 1:
            pos = torch.tensor(seq_lens, dtype=torch.int32) - 1
        args = [x.to(device) for x in (q, cache, table, req, pos)]
        for topk, sink, local in [(16, 1, 1), budgets[budget]]:
            want = select_blocks_proxy(*args, topk=topk, sink_blocks=sink, local_blocks=local, groups=groups,
                                       impl="torch")
            got = select_blocks_proxy(*args, topk=topk, sink_blocks=sink, local_blocks=local, groups=groups,
                                      impl="triton")
            assert torch.equal(got, want), (seed, topk, groups)


def check_shared_kernel(device):
    """Shared selections (``share``): the Triton path against the torch path on a prefill batch whose chunks start
    mid-run, with every query head and with 2 groups, and once scored in token chunks of 32 (runs then span chunks:
    their maxima meet in the run rows)."""
    from sglang_nvfp4.indexer.rules import max_runs, token_runs
    from sglang_nvfp4.kernels.triton_indexer import select_proxy_blocks

    q, cache, table, req, pos = prefill_problem(7, [1400, 700, 200], [1337, 645, 133])
    args = [x.to(device) for x in (q, cache, table, req, pos)]
    for share, groups, score in [(8, None, "max"), (16, 2, "max"), (8, None, "last")]:
        want = select_blocks_proxy(*args, topk=6, groups=groups, share=share, share_score=score, impl="torch")
        got = select_blocks_proxy(*args, topk=6, groups=groups, share=share, share_score=score, impl="triton")
        assert torch.equal(got, want), (share, groups, score)
    runs = token_runs(args[3], args[4], 8, max_runs(len(q), table.shape[0], 8))
    queries = q.to(device).half()  # every head its own query: one group per head
    chunked = select_proxy_blocks(queries, *args[1:], 6, 1, 1, groups=4, runs=runs,
                                  score_bytes=4 * 2 * 32 * table.shape[1])
    assert torch.equal(chunked, select_blocks_proxy(*args, topk=6, groups=None, share=8, impl="torch"))


def fp8_block_scores_f64(queries, cache, table, req, pos, groups):
    """float64 ``[Hkv, T, S]`` block scores of the fp8 proxy in the kernels' tile units (value / 64): the documented
    rounding of ``queries [T, Hkv * groups, 128]`` and of the keys, max over each block's 128 keys (all of them,
    as the kernel) and over the KV head's groups; NaN past each token's own block (the kernel stores none there)."""
    hkv, t = cache.shape[1] // 2, queries.shape[0]
    out = torch.full((hkv, t, table.shape[1]), float("nan"), dtype=torch.float64)
    rounded = round_queries_fp8(queries.float()).double()
    for i in range(t):
        own = int(pos[i]) // fmt.PAGE_SIZE
        data = cache[table[int(req[i]), : own + 1].long(), :hkv]
        k = round_keys_fp8(fmt.dequantize_nvfp4(data[..., : fmt.SCALE_OFFSET], data[..., fmt.SCALE_OFFSET :], 1.0))
        for h in range(hkv):
            logits = torch.einsum("gd,bkd->gbk", rounded[i, h * groups : (h + 1) * groups], k[:, h].double())
            out[h, i, : own + 1] = logits.amax(dim=(0, 2)) / 64
    return out


def check_fp8_kernel(device):
    """The fp8 score kernel against :func:`fp8_block_scores_f64` on Gaussian queries and spread K scales (the E4M3
    rounding moves logits there; exact_problem's values are all E4M3 already): prefill tiles of 16 tokens (every
    head of GQA 16) and 64 (one group of GQA 4), and a decode-like batch. Interpreted, the products are exact and
    summed in fp32, so the selections also equal the torch path's; Hopper's fp8 tensor cores accumulate with fewer
    bits (about 14), which moves scores by ~1e-4 of their scale and can swap near-equal blocks, so on a GPU the
    scores are compared within 1e-3 of their scale. On Hopper the prefill problems are scored by the Gluon kernel
    too (:mod:`sglang_nvfp4.kernels.gluon_proxy`, where the dispatch sends fp8 prefill scores), with the same
    checks: two requests in one tile (scored token by token), 16 groups, 1, and 3 padded to 4; one request over
    several tiles (each scored in one pass; GPU only: too slow interpreted); and again in programs of 4 blocks
    (several programs per row, some with nothing to score) and with 2 subtiles per consumer (the default is 4).
    With predecoded key tiles (:mod:`sglang_nvfp4.kernels.triton_predecode`) the Gluon kernel gives its own scores
    bit for bit, except in a request's last, partial block, where the tiles hold zeros past the forward's last
    position: that block is every such token's own, which the rule selects whatever its score."""
    from sglang_nvfp4.kernels.triton_indexer import (PROXY_PREFILL_ROWS, _gluon_proxy_scores, learned_tiling,
                                                     proxy_block_scores)

    cases = [(seed, group, groups, decode, (1500, 700), (20, 9))
             for seed, group, groups, decode in [(0, 16, 16, False), (1, 4, 1, False), (3, 12, 3, False),
                                                 (2, 16, 16, True)]]
    if device != "cpu":
        cases.append((4, 16, 16, False, (1500,), (100,)))
    for seed, group, groups, decode, seq_lens, token_counts in cases:
        q, cache, table, req, pos = random_problem(seed, group=group, seq_lens=seq_lens, tokens=token_counts)
        if decode:
            q, req, pos = q[:2], torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1499, 699], dtype=torch.int32)
        queries = q.view(len(q), -1, group // groups, fmt.HEAD_DIM).float().mean(2).half()  # the proxy's means
        want = fp8_block_scores_f64(queries, cache, table, req, pos, groups)
        args = [x.to(device) for x in (q, cache, table, req, pos)]
        tokens, blocks = learned_tiling(len(q), table.shape[0], groups, PROXY_PREFILL_ROWS)
        kernels = {"triton": lambda out: proxy_block_scores(queries.to(device), *args[1:], out, tokens, blocks, groups,
                                                            fp8=True)}
        gluon = _gluon_proxy_scores(torch.device(device), len(q), table.shape[0], groups)
        if gluon is not None:
            kernels["gluon"] = lambda out: gluon(queries.to(device), *args[1:], out, groups)
            kernels["gluon, 4 blocks per program"] = lambda out: gluon(queries.to(device), *args[1:], out, groups,
                                                                       blocks=4)
            kernels["gluon, 2 subtiles"] = lambda out: gluon(queries.to(device), *args[1:], out, groups, subtiles=2)
        outs = {}
        for name, kernel in kernels.items():
            got = torch.full(want.shape, float("nan"), device=device)  # poison: only blocks up to the own are written
            kernel(got)
            outs[name] = got
            got = got.cpu().double()
            assert torch.equal(got.isnan(), want.isnan()), (name, seed, groups, decode)
            scale = want.nan_to_num().abs().max()
            tol = 1e-6 if device == "cpu" else 1e-3
            assert (got - want).nan_to_num().abs().max() <= tol * scale, (name, seed, groups, decode)
        if gluon is not None:
            from sglang_nvfp4.kernels import triton_predecode

            predecoded = triton_predecode.prepare(*args[2:], cache.shape[1] // 2, key_tiles=True)
            triton_predecode.launch(args[1], args[2], predecoded)
            got = torch.full(want.shape, float("nan"), device=device)
            gluon(queries.to(device), *args[1:], got, groups, key_tiles=predecoded.key_tiles)
            full = (torch.arange(table.shape[1], device=device)[None, :] + 1) * fmt.PAGE_SIZE \
                <= predecoded.kv_len[args[3].long()][:, None]  # [T, S]: blocks wholly before the forward's end
            assert torch.equal(got.isnan(), outs["gluon"].isnan()), (seed, groups)
            # NaN where both left a score unwritten (blocks past a token's own, before the forward's end)
            assert torch.equal(got[:, full].nan_to_num(), outs["gluon"][:, full].nan_to_num()), (seed, groups)
        if device == "cpu":
            ids = [select_blocks_proxy(*args, topk=6, groups=groups, precision="fp8", impl=impl)
                   for impl in ("torch", "triton")]
            assert torch.equal(*ids), (seed, groups, decode)


def check_query_operands(device):
    """The score kernels read the layer's queries as they are: bf16 heads in a strided view (as of a fused QKV
    output), in order or picked by ``query_rows`` from shuffled rows, give the scores of the same values converted to
    contiguous fp16 first (the kernels round them to fp16 as they load) bit for bit, on the Triton kernel (fp16 and
    fp8 products) and, on Hopper, the Gluon one; and the selection too when scored in chunks (each chunk its rows)."""
    from sglang_nvfp4.kernels.triton_indexer import (PROXY_PREFILL_ROWS, _gluon_proxy_scores, learned_tiling,
                                                     proxy_block_scores, select_proxy_blocks)

    q, cache, table, req, pos = random_problem(5, group=16, seq_lens=(1500, 700), tokens=(20, 9))
    t, heads = q.shape[:2]
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(t, heads + 8, fmt.HEAD_DIM, generator=gen).bfloat16()  # the heads, then other columns
    fused[:, :heads] = q.bfloat16()
    perm = torch.randperm(t, generator=gen)
    shuffled = torch.empty_like(fused[:, :heads])
    shuffled[perm] = fused[:, :heads]  # token i's queries at row perm[i]
    fused, shuffled, perm = fused.to(device), shuffled.to(device), perm.int().to(device)
    view = fused[:, :heads]
    assert not view.is_contiguous()
    fp16 = view.half().contiguous()
    cache, table, req, pos = (x.to(device) for x in (cache, table, req, pos))
    tokens, blocks = learned_tiling(t, table.shape[0], heads // 2, PROXY_PREFILL_ROWS)
    kernels = {f"triton fp8={fp8}": lambda queries, out, rows, fp8=fp8: proxy_block_scores(
        queries, cache, table, req, pos, out, tokens, blocks, heads // 2, fp8, query_rows=rows)
        for fp8 in (False, True)}
    gluon = _gluon_proxy_scores(torch.device(device), t, table.shape[0], heads // 2)
    if gluon is not None:
        kernels["gluon"] = lambda queries, out, rows: gluon(queries, cache, table, req, pos, out, heads // 2,
                                                            query_rows=rows)
    for name, kernel in kernels.items():
        outs = []
        for queries, rows in [(fp16, None), (view, None), (shuffled, perm)]:
            out = torch.full((2, t, table.shape[1]), -12345.0, device=device)  # poison: only visible blocks written
            kernel(queries, out, rows)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), name
        assert (outs[0] != -12345.0).any()
    chunked = [select_proxy_blocks(queries, cache, table, req, pos, 6, 1, 1, groups=heads // 2, fp8=True,
                                   query_rows=rows, score_bytes=4 * 2 * 16 * table.shape[1])
               for queries, rows in [(fp16, None), (shuffled, perm)]]
    assert torch.equal(*chunked)
    with pytest.raises(ValueError, match="query_rows"):
        select_proxy_blocks(shuffled, cache, table, req, pos, 6, 1, 1, groups=heads // 2, query_rows=perm.long())


def check_key_tiles_selection(device):
    """A long prefill's plan predecodes fp8 key tiles (Hopper); the proxy's selection with them equals the selection
    without them, in both share modes."""
    from sglang_nvfp4 import kernels

    q, cache, table, req, pos = (x.to(device) for x in random_problem(6, group=16, seq_lens=(3000,), tokens=(3000,)))
    plan = kernels.plan_attention("prefill", table, req, pos, num_kv_heads=cache.shape[1] // 2, key_tiles=True)
    assert plan.predecodes
    predecoded = plan.predecode(cache, q.shape[1], 16)
    for share, share_score in [(1, "max"), (8, "last")]:
        ids = [select_blocks_proxy(q, cache, table, req, pos, topk=16, groups=None, precision="fp8", share=share,
                                   share_score=share_score, key_tiles=tiles)
               for tiles in (None, predecoded.key_tiles)]
        assert torch.equal(*ids), share
    predecoded.key_tiles.view(torch.uint8).fill_(0x7F)  # NaN: the selection must read the tiles it is given
    poisoned = select_blocks_proxy(q, cache, table, req, pos, topk=16, groups=None, precision="fp8",
                                   key_tiles=predecoded.key_tiles)
    assert not torch.equal(poisoned, ids[0])


if INTERPRETED:

    def test_proxy_kernel_matches_torch_on_exact_ties():
        check_kernel_on_exact_ties("cpu")

    def test_fp8_proxy_kernel_matches_torch():
        check_fp8_kernel("cpu")

    def test_shared_selection_kernel_matches_torch():
        check_shared_kernel("cpu")

    def test_score_kernels_read_the_layers_queries():
        check_query_operands("cpu")

else:

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    def test_proxy_kernels_under_the_triton_interpreter():
        assert_module_passed(__file__)

    @pytest.mark.gpu
    @pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
    def test_compiled_proxy_kernels_match_torch():
        check_kernel_on_exact_ties("cuda")
        check_fp8_kernel("cuda")
        check_shared_kernel("cuda")
        check_query_operands("cuda")

    @pytest.mark.gpu
    @pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()
                             and torch.cuda.get_device_capability() == (9, 0)), reason="needs a Hopper GPU")
    def test_key_tiles_give_the_same_selection(monkeypatch):
        from sglang_nvfp4 import kernels

        monkeypatch.setenv(kernels.PREDECODE_ENV, "auto")  # whatever the environment sets
        check_key_tiles_selection("cuda")
