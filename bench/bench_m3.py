"""MiniMax-M3 served natively: ``nvfp4_sparse`` against SGLang's in-tree M3 path (``--attention-backend
triton``: its Triton sparse backend over bf16 K/V and bf16 index keys; on Hopper the NVFP4 M3 stack is
Blackwell-only) on one GPU, in one run, on the reduced M3 config of ``e2e_models`` (``m3``, dummy weights).
Writes ``m3.json`` under ``--out`` after every step, with a ``summary``.

Steps (``--steps``, comma list, default ``kernels,one_batch,server``; run in the order below):

* ``kernels``: per prefill length (``--kernel-t``), one request, 64 query / 4 KV heads, 4 index heads of 128,
  random bf16 ``idx_q``/``idx_k`` (normed scale, like the model's) and K/V: the selections of both paths on
  the same index keys (% identical block sets per (head, token)), where per-layer prefill time goes
  (ours: block scores, top-k, NVFP4 attention; in-tree: ``flash_prefill_with_topk_index`` (scores + top-k),
  ``flash_prefill_with_gqa_share_sparse`` over bf16 K/V holding the same values, each with its own
  selections), and the overlap of the selections (mean distinct pages per 4-token tile, against per-token
  random top-16 on the same shape). Every call runs once untimed first (compilation, autotuning).
  Decode: one step's selection and attention per layer as CUDA-graph replays (batch 1 and 8, 8K and 32K),
  with the block table as wide as SGLang's decode graphs make it for one_batch's context length.
  fp8 index keys (``NVFP4_SPARSE_INDEX_KEYS=fp8``) beside both: the same keys quantized
  (:func:`sglang_nvfp4.indexer.fp8.quantize_rows`), their selection time (prefill and decode), their
  write, and the % of (head, token) block sets identical to the bf16 keys' and to the in-tree path's.
* ``one_batch``: ``e2e_one_batch`` on ``m3``, ``--backends`` (default ``nvfp4_sparse triton``) at
  ``--input-lens`` x ``--batch-sizes``: prefill and decode throughput, KV capacity (``max_total_num_tokens``)
  at the same ``--mem-fraction-static``. The children inherit the environment: ``NVFP4_SPARSE_INDEX_KEYS=fp8``
  gives ``nvfp4_sparse`` fp8 index keys (recorded as ``index_keys``; the in-tree path ignores it).
* ``server``: ``e2e_server`` on ``m3``: a real server per backend, ``--short-prompts`` short prompts (every
  block selected: only NVFP4 storage differs) with first-token agreement (95% Wilson interval), logprob
  deltas and the in-tree path's top-1/top-2 margins, a long prompt, a radix hit, batch invariance.
* ``chunked`` (not in the default steps): ``e2e_chunked`` on ``m3``: a server per variant (ours with predecoding
  ``auto`` and ``off``, then the other backends) under SGLang's chunked prefill (``--chunk-size``), prompts of
  ``--chunked-input-lens`` tokens: prefill latency, the GPU memory each request adds, first-token agreement.

``summary``: ``prefill_speedup_32k`` / ``prefill_speedup_128k`` (batch 1), ``decode_speedup_32k`` (batch 8),
``capacity_ratio`` (nvfp4_sparse over the in-tree path), ``selection_identical``, and the per-layer breakdown.

``python bench/bench_m3.py --out DIR [--steps ...]`` (CUDA and SGLang; bench/gpu_m3.sh sets up the host).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

import e2e_chunked
import e2e_one_batch
import e2e_server
from bench_e2e import gpu_description, runnable_backends
from e2e_models import context_len, dummy_model
from e2e_summary import one_batch_summary
from harness import BenchRun, exit_on_sigterm, log

STEPS = ("kernels", "one_batch", "server", "chunked")
DEFAULT_STEPS = STEPS[:3]
MODEL = "m3"
IN_TREE = "triton"
HEADS, HKV, INDEX_HEADS, TOPK, INIT_BLOCKS, LOCAL_BLOCKS = 64, 4, 4, 16, 1, 1  # the reduced M3 config
LAYERS = 2
DEV = "cuda"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS), help=f"comma list of {', '.join(STEPS)}")
    ap.add_argument("--budget-s", type=float, default=520.0)
    ap.add_argument("--backends", nargs="+", default=["nvfp4_sparse", IN_TREE])
    ap.add_argument("--kernel-t", type=int, nargs="*", default=[32768, 131072],
                    help="prefill lengths of the kernels step (none: decode rows only)")
    ap.add_argument("--score-sweep", action="store_true",
                    help="kernels step: also time launch variants of the learned indexer's scores and top-k")
    ap.add_argument("--decode-table-cols", type=int, default=1032,
                    help="block-table width of the decode timings (one_batch's context for 128K inputs, "
                         "132096 tokens: 1032)")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--sglang-args", default="")
    ap.add_argument("--run-timeout", type=float, default=200.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--short-prompts", type=int, default=256,
                    help="server step: short prompts per backend (every block selected), for first-token "
                         "agreement with a 95%% interval")
    ap.add_argument("--chunk-size", type=int, default=8192, help="chunked step: --chunked-prefill-size")
    ap.add_argument("--chunked-input-lens", type=int, nargs="+", default=[32768, 131072],
                    help="chunked step: prompt lengths")
    ap.add_argument("--chunked-repeats", type=int, default=2,
                    help="chunked step: timed prompts per length (after one untimed)")
    args = ap.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    if args.short_prompts < 1:
        ap.error(f"--short-prompts must be at least 1, got {args.short_prompts}")
    if set(args.steps) - set(STEPS):
        ap.error(f"--steps: unknown {sorted(set(args.steps) - set(STEPS))}")
    args.models, args.torch_native_max_tokens = [MODEL], 0
    return args


# ---- kernels ---------------------------------------------------------------------------------------------
# Launch variants of the learned indexer's two prefill stages timed by --score-sweep, the first of each the default:
# scores (tokens per program, blocks per program, warps, pipeline stages, registers per thread; None = Triton's
# default) and top-k (tokens per program, blocks per merge step, warps). The default's bf16 build takes 129
# registers on sm_90 (Triton 3.6), one CTA of 8 warps per SM; capped at 128 it takes 121 without spilling, and two
# CTAs (96 KB of shared memory each) fit on an SM.
SCORE_VARIANTS = ((32, 16, 8, 2, None), (32, 16, 8, 2, 128), (64, 16, 8, 2, None), (64, 16, 4, 2, None),
                  (32, 16, 8, None, None), (32, 32, 8, 2, None), (16, 16, 8, 2, None), (32, 16, 4, None, None))
TOPK_VARIANTS = ((32, 16, 4), (32, 32, 4), (16, 16, 4), (32, 8, 4))


def score_sweep(idx_q, keys, block_table, req, pos, expected_ids) -> tuple[list, list]:
    """Each of SCORE_VARIANTS and TOPK_VARIANTS timed (after an untimed run) over one reused score buffer, with
    the fraction of block sets equal to ``expected_ids`` (the default chain's) when the other stage is the
    default."""
    from timing import bench_ms

    from sglang_nvfp4.kernels import triton_indexer as ti

    t, cols = pos.shape[0], block_table.shape[1]
    flat = torch.empty(ti.LEARNED_SCORE_BYTES // 4 + INDEX_HEADS * 128 * cols, dtype=torch.float32, device=DEV)
    ids = torch.empty_like(expected_ids)

    def chunk_views(tokens):
        return [(c0, n, flat[: INDEX_HEADS * n * cols].view(INDEX_HEADS, n, cols))
                for c0, n in ti.learned_score_chunks(t, INDEX_HEADS, cols, tokens)]

    def score_chunk(score_variant, c0, n, scores):
        tokens, blocks, warps, stages, registers = score_variant
        part = slice(c0, c0 + n)
        ti.learned_block_scores(idx_q[part], keys, block_table, req[part], pos[part], scores, tokens, blocks,
                                num_warps=warps, num_stages=stages, max_registers=registers)

    def select_chunk(topk_variant, c0, n, scores):
        sel_tokens, step, sel_warps = topk_variant
        ti.select_scored_blocks(scores, pos[c0 : c0 + n], ids, c0, TOPK, INIT_BLOCKS, LOCAL_BLOCKS - 1, sel_tokens,
                                step, num_warps=sel_warps)

    def chain(score_variant, topk_variant):
        for c0, n, scores in chunk_views(score_variant[0]):
            score_chunk(score_variant, c0, n, scores)
            select_chunk(topk_variant, c0, n, scores)

    score_rows, topk_rows = [], []
    for variant in SCORE_VARIANTS:
        views = chunk_views(variant[0])
        launch = dict(zip(("tokens", "blocks", "warps", "stages", "max_registers"), variant))

        def scores_only():
            for c0, n, scores in views:
                score_chunk(variant, c0, n, scores)
        try:
            chain(variant, TOPK_VARIANTS[0])
            same = identical_sets(ids, expected_ids)
            score_rows.append(dict(launch, identical=same, ms=bench_ms(scores_only)))
        except Exception as exc:  # e.g. out of shared memory or registers: recorded, the sweep goes on
            score_rows.append(dict(launch, error=repr(exc)[:300]))
        log(f"  scores {variant}: {score_rows[-1]}")
    views = chunk_views(SCORE_VARIANTS[0][0])
    for variant in TOPK_VARIANTS:
        sel_tokens, step, sel_warps = variant

        def topk_only():  # per chunk as in the chain; the one buffer holds the last chunk's scores (same masks)
            for c0, n, scores in views:
                select_chunk(variant, c0, n, scores)
        try:
            chain(SCORE_VARIANTS[0], variant)
            same = identical_sets(ids, expected_ids)
            topk_rows.append(dict(tokens=sel_tokens, step=step, warps=sel_warps, identical=same, ms=bench_ms(topk_only)))
        except Exception as exc:
            topk_rows.append(dict(tokens=sel_tokens, step=step, warps=sel_warps, error=repr(exc)[:300]))
        log(f"  top-k {variant}: {topk_rows[-1]}")
    return score_rows, topk_rows


def identical_sets(ids: torch.Tensor, other: torch.Tensor) -> float:
    """Fraction of (head, token) rows of two ``[heads, T, topk]`` selections holding the same block set."""
    return (torch.sort(ids, dim=-1).values == torch.sort(other, dim=-1).values).all(dim=-1).float().mean().item()


def kernel_case(t: int, gen: torch.Generator, sweep: bool = False) -> dict:
    from bench_kernels import InTreeSparse, one_request, random_blocks
    from sglang.kernels.ops.attention.minimax_sparse.prefill.flash_with_topk_idx import flash_prefill_with_topk_index
    from timing import bench_ms

    from sglang_nvfp4 import format as fmt
    from sglang_nvfp4 import kernels
    from sglang_nvfp4.indexer.fp8 import quantize_rows
    from sglang_nvfp4.kernels import triton_indexer as ti
    from sglang_nvfp4.kernels import triton_prefill

    cache, block_table, slots = one_request(t, HKV, gen)
    pos = torch.arange(t, device=DEV, dtype=torch.int32)
    req = torch.zeros_like(pos)
    q = (torch.randn(t, HEADS, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    idx_q = torch.randn(t, INDEX_HEADS, 128, device=DEV, generator=gen).bfloat16()
    idx_k = torch.randn(t, 1, 128, device=DEV, generator=gen).bfloat16()
    keys = torch.zeros(cache.shape[0] * fmt.PAGE_SIZE, 128, dtype=torch.bfloat16, device=DEV)
    keys[slots] = idx_k[:, 0]
    row = {"T": t, "H": HEADS, "Hkv": HKV, "index_heads": INDEX_HEADS, "topk": TOPK}

    # ours: block scores, then the top-k, as select_learned_blocks chains them
    def ours_select():
        return ti.select_learned_blocks(idx_q, keys, block_table, req, pos, TOPK, INIT_BLOCKS, LOCAL_BLOCKS - 1)

    ours_ids = ours_select()
    tokens, blocks, stages = ti.learned_launch(t, 1, INDEX_HEADS)
    chunks = ti.learned_score_chunks(t, INDEX_HEADS, block_table.shape[1], tokens)
    scores = [torch.empty(INDEX_HEADS, n, block_table.shape[1], dtype=torch.float32, device=DEV) for _, n in chunks]
    scratch_ids = torch.empty_like(ours_ids)

    def ours_scores():  # the two stages of the chained call, timed apart (one score buffer per chunk)
        for (c0, n), chunk_scores in zip(chunks, scores):
            part = slice(c0, c0 + n)
            ti.learned_block_scores(idx_q[part], keys, block_table, req[part], pos[part], chunk_scores, tokens, blocks,
                                    num_stages=stages)

    def ours_topk():
        for (c0, n), chunk_scores in zip(chunks, scores):
            ti.select_scored_blocks(chunk_scores, pos[c0 : c0 + n], scratch_ids, c0, TOPK, INIT_BLOCKS,
                                    LOCAL_BLOCKS - 1, ti.SCORED_SELECT_TOKENS, ti.SCORED_SELECT_STEP)

    ours_scores()
    ours_topk()
    fp8_codes, fp8_exponents = quantize_rows(keys)

    def ours_fp8_select():
        return ti.select_learned_blocks(idx_q, fp8_codes, block_table, req, pos, TOPK, INIT_BLOCKS, LOCAL_BLOCKS - 1,
                                        key_exponents=fp8_exponents)

    fp8_ids = ours_fp8_select()
    row["ours_fp8_select_ms"] = bench_ms(ours_fp8_select)
    row["fp8_vs_bf16_identical"] = identical_sets(fp8_ids, ours_ids)
    if sweep:
        row["score_sweep"], row["topk_sweep"] = score_sweep(idx_q, keys, block_table, req, pos, ours_ids)
    row["score_chunks"] = len(chunks)
    row["ours_select_ms"] = bench_ms(ours_select)
    row["ours_scores_ms"] = bench_ms(ours_scores)
    row["ours_topk_ms"] = bench_ms(ours_topk)
    out = torch.empty_like(q)
    attend_args = (q, cache, ours_ids, block_table, req, pos, 1.0, 1.0, fmt.HEAD_DIM**-0.5)
    kernels.sparse_prefill(*attend_args, out=out)
    row["ours_attention_ms"] = bench_ms(lambda: kernels.sparse_prefill(*attend_args, out=out))

    # in-tree: index scores + top-k over bf16 index keys (slot-addressed), attention over bf16 K/V
    i32 = dict(dtype=torch.int32, device=DEV)
    common = dict(v_cache=None, sink=None, req_to_token=slots.int()[None].contiguous(), slot_ids=torch.zeros(1, **i32),
                  cu_seqlens=torch.tensor([0, t], **i32), seq_lens=torch.tensor([t], **i32),
                  prefix_lens=torch.zeros(1, **i32), max_seqlen_q=t, max_seqlen_k=t, block_size_q=1,
                  block_size_k=fmt.PAGE_SIZE, topk=TOPK, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS,
                  disable_index_value=True, page_size=fmt.PAGE_SIZE)

    def in_tree_select():
        return flash_prefill_with_topk_index(q=idx_q, k_cache=keys[:, None], **common)[1]

    theirs = in_tree_select()
    row["in_tree_select_ms"] = bench_ms(in_tree_select)
    row["selection_identical"] = identical_sets(ours_ids, theirs)
    row["fp8_selection_identical"] = identical_sets(fp8_ids, theirs)
    peer = InTreeSparse(cache, block_table, theirs, t)
    peer.attend(q, theirs, 1)
    row["in_tree_attention_ms"] = bench_ms(lambda: peer.attend(q, theirs, 1))

    # overlap: distinct pages a 4-token tile visits (the prefill kernel's union), ours vs per-token random
    tile = triton_prefill.default_prefill_config(HEADS // HKV).tokens_per_tile
    union, _ = triton_prefill.plan_tiles(ours_ids, block_table, req, pos, tile)
    random_union, _ = triton_prefill.plan_tiles(random_blocks(pos, HKV, gen, block_table.shape[1]), block_table, req,
                                                pos, tile)
    row.update(tokens_per_tile=tile, union_mean=union.float().mean().item(),
               random_union_mean=random_union.float().mean().item())
    row["ours_layer_ms"] = row["ours_select_ms"] + row["ours_attention_ms"]
    row["in_tree_layer_ms"] = row["in_tree_select_ms"] + row["in_tree_attention_ms"]
    return row


def decode_case(batch: int, ctx: int, cols: int, gen: torch.Generator) -> dict:
    """One decode step's selection and attention per layer, as CUDA-graph replays: ``batch`` requests of ``ctx``
    tokens, a block table ``cols`` wide (SGLang's decode graphs size it for the context length)."""
    from bench_kernels import decode_problem
    from timing import graph_ms

    from sglang_nvfp4 import format as fmt
    from sglang_nvfp4 import kernels
    from sglang_nvfp4.indexer import IndexKeys
    from sglang_nvfp4.kernels import triton_decode
    from sglang_nvfp4.kernels import triton_indexer as ti

    q, cache, _, block_table, req, pos, ks, vs, scale = decode_problem(batch, ctx, gen)
    wide = torch.zeros(batch, cols, dtype=torch.int32, device=DEV)
    wide[:, : block_table.shape[1]] = block_table
    idx_q = torch.randn(batch, INDEX_HEADS, 128, device=DEV, generator=gen).bfloat16()
    keys = torch.randn(cache.shape[0] * 128, 128, device=DEV, generator=gen).bfloat16()
    ids = ti.select_learned_blocks(idx_q, keys, wide, req, pos, TOPK, INIT_BLOCKS, LOCAL_BLOCKS - 1)
    out = torch.empty_like(q)
    row = {"batch": batch, "ctx": ctx, "block_table_cols": cols}
    for step in (64, ti.LEARNED_DECODE_STEP):  # blocks per merge step of the one-token selection programs
        row[f"select_step{step}_us"] = 1e3 * graph_ms(lambda: ti.select_learned_blocks(
            idx_q, keys, wide, req, pos, TOPK, INIT_BLOCKS, LOCAL_BLOCKS - 1, decode_blocks_per_step=step))
    row["select_us"] = row[f"select_step{ti.LEARNED_DECODE_STEP}_us"]
    fp8_keys = IndexKeys(cache.shape[0], DEV, dtype=torch.float8_e4m3fn)
    fp8_keys.write(torch.arange(keys.shape[0], device=DEV), keys)
    row["select_fp8_us"] = 1e3 * graph_ms(lambda: ti.select_learned_blocks(
        idx_q, fp8_keys.keys, wide, req, pos, TOPK, INIT_BLOCKS, LOCAL_BLOCKS - 1, key_exponents=fp8_keys.exponents))

    def attend():
        return kernels.sparse_decode(q, cache, ids, wide, req, pos, ks, vs, scale, out=out)

    row["attention_us"] = 1e3 * graph_ms(attend)
    columns = triton_decode.COMBINE_COLUMNS
    try:  # the split combine with one program per (token, KV head), as before COMBINE_COLUMNS
        triton_decode.COMBINE_COLUMNS = fmt.HEAD_DIM
        row["attention_whole_row_combine_us"] = 1e3 * graph_ms(attend)
    finally:
        triton_decode.COMBINE_COLUMNS = columns
    # the step's cache write (each request's token on its own page): two parity launches, or one (the backend's
    # decode write), and the index-key copy beside it
    slots = block_table[req.long(), (pos // fmt.PAGE_SIZE).long()].long() * fmt.PAGE_SIZE + pos.long() % fmt.PAGE_SIZE
    k_new, v_new = torch.randn(2, batch, HKV, fmt.HEAD_DIM, device=DEV, generator=gen).bfloat16()
    for name, one in (("write_two_launches_us", False), ("write_one_launch_us", True)):
        row[name] = 1e3 * graph_ms(lambda: kernels.write_kv(cache, slots, k_new, v_new, ks, vs,
                                                             one_token_per_byte=one))
    idx_k = torch.randn(batch, 1, 128, device=DEV, generator=gen).bfloat16()
    row["index_key_write_us"] = 1e3 * graph_ms(lambda: keys.index_copy_(0, slots, idx_k[:, 0]))
    row["index_key_write_fp8_us"] = 1e3 * graph_ms(lambda: fp8_keys.write(slots, idx_k))
    row["layer_us"] = row["write_one_launch_us"] + row["index_key_write_us"] + row["select_us"] + row["attention_us"]
    row["layer_fp8_us"] = (row["write_one_launch_us"] + row["index_key_write_fp8_us"] + row["select_fp8_us"]
                           + row["attention_us"])
    return row


def run_kernels(bench: BenchRun, args) -> None:
    rows = bench.results.setdefault("kernels", [])
    gen = torch.Generator(device=DEV).manual_seed(0)
    decode_rows = bench.results.setdefault("kernels_decode", [])
    for batch, ctx in ((1, 8192), (8, 8192), (8, 32768)):
        decode_rows.append(decode_case(batch, ctx, args.decode_table_cols, gen))
        r = decode_rows[-1]
        log(f"decode b{batch} ctx {ctx}: select {r['select_us']:.1f} us ({r['select_step64_us']:.1f} with 64 blocks "
            f"per merge step), attention {r['attention_us']:.1f} us ({r['attention_whole_row_combine_us']:.1f} "
            f"whole-row combine), write "
            f"{r['write_one_launch_us']:.1f} us (one launch) / {r['write_two_launches_us']:.1f} us (two), index keys "
            f"{r['index_key_write_us']:.1f} us; layer {r['layer_us']:.1f} us; fp8 index keys: select "
            f"{r['select_fp8_us']:.1f} us, write {r['index_key_write_fp8_us']:.1f} us, layer {r['layer_fp8_us']:.1f} us")
        bench.save()
    for t in args.kernel_t:
        if bench.skip_reason(f"kernels T={t}", 60):
            break
        row = kernel_case(t, gen, args.score_sweep)
        rows.append(row)
        log(f"kernels T={t}: select ours {row['ours_select_ms']:.2f} ms (scores {row['ours_scores_ms']:.2f}, "
            f"top-k {row['ours_topk_ms']:.2f}) vs in-tree {row['in_tree_select_ms']:.2f}; attention ours "
            f"{row['ours_attention_ms']:.2f} vs in-tree {row['in_tree_attention_ms']:.2f}; identical sets "
            f"{row['selection_identical']:.4f}; union {row['union_mean']:.1f} (random {row['random_union_mean']:.1f}); "
            f"fp8 index keys: select {row['ours_fp8_select_ms']:.2f} ms, identical sets {row['fp8_vs_bf16_identical']:.4f} "
            f"of ours (bf16), {row['fp8_selection_identical']:.4f} of in-tree")
        bench.save()


# ---- summary ---------------------------------------------------------------------------------------------
def summarize(results: dict) -> dict:
    """The headline ratios (nvfp4_sparse over the in-tree path) and the per-layer breakdown."""
    summary: dict = {}
    by_model = results.get("one_batch_by_model", {})
    if MODEL in by_model:
        rows = one_batch_summary({MODEL: by_model[MODEL]})[MODEL]
        summary["one_batch"] = rows

        def ratio(phase, batch, input_len):
            for r in rows:
                if (r["batch_size"], r["input_len"]) == (batch, input_len) and f"{phase}_ratio" in r:
                    return r[f"{phase}_ratio"]
            return None

        summary.update(prefill_speedup_32k=ratio("prefill", 1, 32768), prefill_speedup_128k=ratio("prefill", 1, 131072),
                       decode_speedup_32k=ratio("decode", 8, 32768))
        capacity = {b: e.get("max_total_num_tokens") for b, e in by_model[MODEL].items()}
        if capacity.get("nvfp4_sparse") and capacity.get(IN_TREE):
            summary["capacity_ratio"] = capacity["nvfp4_sparse"] / capacity[IN_TREE]
        summary["capacity_tokens"] = capacity
    kernel_rows = results.get("kernels", [])
    if kernel_rows:
        summary["selection_identical"] = {r["T"]: r["selection_identical"] for r in kernel_rows}
        summary["fp8_selection_identical"] = {r["T"]: r.get("fp8_selection_identical") for r in kernel_rows}
        summary["breakdown"] = [_breakdown(r, by_model.get(MODEL, {})) for r in kernel_rows]
    if results.get("server", {}).get("agreement"):
        summary["server_agreement"] = results["server"]["agreement"]
    return summary


def _prefill_latency_ms(entry: dict, input_len: int) -> float | None:
    for a in entry.get("attempts", []):
        if (a["batch_size"], a["input_len"]) == (1, input_len) and a.get("status") == "ok":
            return 1e3 * a["result"]["prefill_latency"]
    return None


def _breakdown(row: dict, one_batch: dict) -> dict:
    """Per backend at T: the layers' index scoring + top-k and attention (kernel timings x LAYERS), and the
    rest of the batch-1 one_batch prefill (projections, MoE, norms, sampling, launch gaps)."""
    out = {"T": row["T"]}
    for name, backend in (("ours", "nvfp4_sparse"), ("in_tree", IN_TREE)):
        part = {"index_and_topk_ms": LAYERS * row[f"{name}_select_ms"],
                "attention_ms": LAYERS * row[f"{name}_attention_ms"]}
        if name == "ours":
            part.update(index_scores_ms=LAYERS * row["ours_scores_ms"], topk_ms=LAYERS * row["ours_topk_ms"])
        total = _prefill_latency_ms(one_batch.get(backend, {}), row["T"])
        if total is not None:
            part.update(prefill_ms=total, rest_ms=total - part["index_and_topk_ms"] - part["attention_ms"])
        out[backend] = part
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    bench = BenchRun(args.out, "m3.json", args.budget_s)
    bench.results["gpu"] = gpu_description()
    bench.results["index_keys"] = os.environ.get("NVFP4_SPARSE_INDEX_KEYS") or "model"  # nvfp4_sparse's, one_batch
    args.backends = runnable_backends(args.backends, bench.results)
    try:
        if "kernels" in args.steps:
            run_kernels(bench, args)
            # The servers size their pools from the GPU memory they find free: what this process's caching
            # allocator still holds would shrink them (by 11 GB in the run of 2026-12-03).
            gc.collect()
            torch.cuda.empty_cache()
            bench.results["gpu_free_bytes_after_kernels"] = torch.cuda.mem_get_info()[0]
        if "one_batch" in args.steps:
            e2e_one_batch.run_step(bench, args)
            bench.save()
        if "server" in args.steps:
            model = dummy_model(bench.out_dir, MODEL, 16384)
            e2e_server.run_step(bench, args.backends, model=model, extra_args=["--load-format", "dummy"],
                                short_prompts=args.short_prompts)
        if "chunked" in args.steps:
            model = dummy_model(bench.out_dir, MODEL, context_len(max(args.chunked_input_lens), 1))
            flags = ["--load-format", "dummy", "--mem-fraction-static", str(args.mem_fraction_static)]
            e2e_chunked.run_step(bench, args.backends, model, args.chunked_input_lens, args.chunk_size,
                                 args.chunked_repeats, extra_args=flags)
    finally:
        bench.stop_children()
        bench.results["wall_s"] = bench.spent()
        bench.results["summary"] = summarize(bench.results)
        bench.save()
    log(f"summary: {bench.results['summary']}")


if __name__ == "__main__":
    main()
