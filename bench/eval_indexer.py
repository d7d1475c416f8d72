"""Evaluate the block indexer: recall of oracle attention mass (CPU) and GPU timing (CUDA only).

Recall. For token ``t`` and KV head ``h`` let ``M[b]`` be the dense causal softmax mass of block
``b`` summed over the KV head's G query heads (:func:`sglang_nvfp4.quality.block_mass.block_attention_mass`).
The recall of a selection of ``k`` blocks (``--topk``, default ``fmt.TOPK`` = 16) is
``sum M[selected] / sum M[oracle top-k]``; the table gives its mean, 5th percentile and the share
of (token, head) pairs reaching 0.9, per method, and the relative error of the sparse attention
output (reference kernel) against dense attention. Two data sets, both written through the NVFP4
cache and summarised by :class:`BlockSummaries` in unaligned prefill chunks:

* ``needle``: Gaussian keys with heavy-tailed channel scales; per KV head 8 needle keys hidden at
  random positions of random far blocks (not sink, local or own), each aligned with the shared
  query direction of the tokens that look for it. ``sigma`` is the std of the background logits,
  and the needle's logit is set so that it holds ``share`` of its heads' attention on average.
* ``realistic``: keys = heavy-tailed channel scales (log-normal, plus 4 outlier channels) times
  (a per-head mean offset + a slowly varying topic + noise), rotated by RoPE (base 10000); each
  query head mixes the directions of 3 random earlier keys (retrieval), the RoPE-rotated offset
  (which makes attention favour recent keys through RoPE) and noise, with per-head weights.

Methods: the library's ``mean`` and ``quest`` (per-head scores summed over the G heads), the same
with the max over heads instead of the sum (``*-maxhead``, eval only: the aggregation choice), the
token-level ``proxy`` indexer with the head-mean query (``proxy``) and with every query head (``proxy-all``,
the default since 2026-12-03), and ``window`` (sink + the ``k - 1`` most recent blocks: what a sliding window
keeps).

GPU timing (runs only when CUDA is available): one request, ``H=64, Hkv=4``, contexts 32K and
128K; a prefill chunk of the last 8192 tokens and a decode batch; indexer (summary update and
block selection, Triton) against the sparse attention kernels of the dispatcher when it serves
CUDA (else the indexer alone, and the output says so). It also checks the compiled kernels
against the torch path. Both sections select ``k`` blocks per KV head and token.

Usage: ``python bench/eval_indexer.py [--section recall|gpu|all] [--out bench/results] [--context N] [--topk K]``;
writes ``indexer_recall_<N/1024>k.{md,json}`` and ``indexer_gpu.{md,json}``, with ``_top<K>`` appended to the
names when ``K`` is not the default (e.g. ``indexer_recall_16k_top32.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from timing import bench_ms

from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.indexer import (BlockSummaries, aggregate_queries, forced_blocks, rank_blocks, select_blocks,
                                  select_blocks_proxy)
from sglang_nvfp4.quality.block_mass import block_attention_mass, oracle_blocks
from sglang_nvfp4.reference import sparse_prefill_reference

SINK, LOCAL = 1, 1
D = fmt.HEAD_DIM


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x [N, ..., 128]`` by RoPE at ``positions [N]`` (half-split pairs)."""
    half = D // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = (positions.double()[:, None] * freq[None, :]).view(len(positions), *([1] * (x.dim() - 2)), half)
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def query_positions(gen, ctx: int, num_queries: int) -> torch.Tensor:
    """Sorted distinct positions in the second half of the context."""
    return (ctx // 2 + torch.randperm(ctx - ctx // 2, generator=gen)[:num_queries]).sort().values


def needle_data(seed: int, ctx: int, hkv: int, group: int, num_queries: int, sigma: float, share: float,
                needles_per_head: int = 8, shared_weight: float = 0.7):
    """Keys, values, queries and positions of the planted-needle set (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    chan = torch.exp(0.5 * torch.randn(hkv, D, generator=gen))
    k = torch.randn(ctx, hkv, D, generator=gen) * chan
    v = torch.randn(ctx, hkv, D, generator=gen)
    qpos = query_positions(gen, ctx, num_queries)
    directions = torch.nn.functional.normalize(torch.randn(hkv, needles_per_head, D, generator=gen), dim=-1)
    which = torch.arange(num_queries) % needles_per_head
    q = (shared_weight * directions[:, which].transpose(0, 1)[:, :, None, :] * math.sqrt(D)
         + math.sqrt(1 - shared_weight**2) * torch.randn(num_queries, hkv, group, D, generator=gen))
    sm = D**-0.5
    background = torch.einsum("thgd,nhd->thgn", q, k[torch.randperm(ctx, generator=gen)[:2048]]) * sm
    q = q * (sigma / background.std())
    # Needle logit so that it holds `share` of its heads' mass against the keys a median query sees.
    visible = float(qpos.median()) + 1
    logit = math.log(visible * share / (1 - share)) + sigma**2 / 2
    far_blocks = int(qpos.min()) // fmt.PAGE_SIZE - LOCAL - 1  # blocks [SINK, far_blocks) are far for all
    for h in range(hkv):
        for i in range(needles_per_head):
            block = SINK + int(torch.randint(0, far_blocks - SINK, (1,), generator=gen))
            j = block * fmt.PAGE_SIZE + int(torch.randint(0, fmt.PAGE_SIZE, (1,), generator=gen))
            along = (q[which == i, h] @ directions[h, i]).mean()  # mean projection of the seeking queries
            k[j, h] = directions[h, i] * (logit / sm / along)
    return k, v, q.reshape(num_queries, hkv * group, D), qpos


def realistic_data(seed: int, ctx: int, hkv: int, group: int, num_queries: int, targets: int = 3):
    """Keys, values, queries and positions of the realistic set (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    chan = torch.exp(0.6 * torch.randn(hkv, D, generator=gen))
    outliers = torch.randperm(D, generator=gen)[:4]
    chan[:, outliers] *= 6.0
    offset = 1.5 * torch.randn(hkv, D, generator=gen)
    knots = torch.randn(ctx // 64 + 2, hkv, D, generator=gen)
    x = torch.arange(ctx) / 64.0
    i0 = x.floor().long()
    frac = (x - i0)[:, None, None]
    topic = knots[i0] * (1 - frac) + knots[i0 + 1] * frac
    positions = torch.arange(ctx)
    k = rope(chan * (offset + 0.8 * topic + 0.6 * torch.randn(ctx, hkv, D, generator=gen)), positions)
    v = torch.randn(ctx, hkv, D, generator=gen)
    qpos = query_positions(gen, ctx, num_queries)
    recency = torch.nn.functional.normalize(rope((chan * offset).expand(num_queries, hkv, D), qpos), dim=-1)
    q = torch.empty(num_queries, hkv, group, D)
    for t in range(num_queries):
        picks = torch.randint(0, int(qpos[t]) + 1, (hkv, targets), generator=gen)
        retrieval = torch.nn.functional.normalize(k[picks, torch.arange(hkv)[:, None]].mean(dim=1), dim=-1)  # [Hkv, D]
        a = 30.0 * torch.rand(hkv, group, 1, generator=gen)
        b = 30.0 * torch.rand(hkv, group, 1, generator=gen)
        noise = 0.5 * torch.randn(hkv, group, D, generator=gen) / chan[:, None, :].clamp(min=1.0)
        q[t] = a * retrieval[:, None] + b * recency[t][:, None] + noise
    return k, v, q.reshape(num_queries, hkv * group, D), qpos


def build_cache(k: torch.Tensor, v: torch.Tensor, seed: int, chunk: int = 3000):
    """Write K/V of one request into a fresh NVFP4 cache on shuffled pages, in unaligned prefill chunks,
    updating the summaries after each chunk. Returns cache, summaries, block table, k_scale."""
    gen = torch.Generator().manual_seed(seed + 1)
    ctx, hkv, _ = k.shape
    blocks = -(-ctx // fmt.PAGE_SIZE)
    pages = torch.randperm(blocks + 3, generator=gen)[:blocks]
    k_scale = float(k.abs().max()) / (6 * fmt.E4M3_MAX)
    v_scale = float(v.abs().max()) / (6 * fmt.E4M3_MAX)
    cache = fmt.alloc_cache(blocks + 3, hkv)
    summaries = BlockSummaries(blocks + 3, hkv, minmax=True)
    slots = pages[torch.arange(ctx) // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + torch.arange(ctx) % fmt.PAGE_SIZE
    for start in range(0, ctx, chunk):
        part = slice(start, min(start + chunk, ctx))
        fmt.write_kv(cache, slots[part], k[part], v[part], k_scale, v_scale)
        summaries.update(cache, slots[part])
    return cache, summaries, pages.int()[None, :], k_scale, v_scale


def head_aggregated_scores(q, summaries, block_table, method):
    """Eval-only variant: per-head scores aggregated by the max over the G heads. [Hkv, T, B]."""
    hkv = summaries.num_kv_heads
    t, h, _ = q.shape
    qg = q.float().view(t, hkv, h // hkv, D).half().float()
    pages = block_table[0].long()
    if method == "mean":
        s = torch.einsum("thgd,bhd->htgb", qg, summaries.mean[pages].float())
    else:
        bounds = summaries.bounds[pages].float()
        s = (torch.einsum("thgd,bhd->htgb", qg.clamp(min=0), bounds[:, :, 0])
             + torch.einsum("thgd,bhd->htgb", qg.clamp(max=0), bounds[:, :, 1]))
    return s.amax(dim=2)


def window_selection(qpos, hkv, num_blocks, topk):
    """Sink + the most recent blocks: scores = block id (later = better), own/sink/local forced."""
    own = qpos.long() // fmt.PAGE_SIZE
    scores = torch.arange(num_blocks, dtype=torch.float32)[None, None, :].expand(hkv, len(qpos), -1)
    return rank_blocks(scores, own, topk, forced_blocks(own, num_blocks, SINK, LOCAL))


def evaluate_set(name, k, v, q, qpos, seed, topk):
    cache, summaries, table, k_scale, v_scale = build_cache(k, v, seed)
    t = q.shape[0]
    hkv = summaries.num_kv_heads
    req = torch.zeros(t, dtype=torch.int32)
    pos = qpos.int()
    sm = D**-0.5
    mass = block_attention_mass(q, cache, table, req, pos, k_scale, sm)  # [Hkv, T, B]
    num_blocks = table.shape[1]
    own = pos.long() // fmt.PAGE_SIZE
    oracle_mass = mass.sort(dim=-1, descending=True).values[..., :topk].sum(-1)
    forced = forced_blocks(own, num_blocks, SINK, LOCAL)
    selections = {
        "mean": select_blocks(q, summaries, table, req, pos, topk=topk, method="mean"),
        "quest": select_blocks(q, summaries, table, req, pos, topk=topk, method="quest"),
        "mean-maxhead": rank_blocks(head_aggregated_scores(q, summaries, table, "mean"), own, topk, forced),
        "quest-maxhead": rank_blocks(head_aggregated_scores(q, summaries, table, "quest"), own, topk, forced),
        "proxy": select_blocks_proxy(q, cache, table, req, pos, topk=topk, impl="torch"),
        "proxy-all": select_blocks_proxy(q, cache, table, req, pos, topk=topk, groups=None, impl="torch"),
        "window": window_selection(qpos, hkv, num_blocks, topk),
        "oracle": oracle_blocks(mass, pos, topk),  # the bound any top-k selection can reach
    }
    group = q.shape[1] // hkv
    all_blocks = torch.arange(num_blocks, dtype=torch.int32)[None, None, :].expand(hkv, t, -1).contiguous()
    dense = sparse_prefill_reference(q, cache, all_blocks, table, req, pos, k_scale, v_scale, sm, mode="ideal")
    stats = {
        "tokens": t, "kv_heads": hkv, "group": group, "context": k.shape[0], "topk": topk,
        "visible_blocks_mean": float((own + 1).float().mean()),
        "oracle_topk_share": float((oracle_mass / group).mean()),
        "forced_blocks_share": float(((mass * forced[None]).sum(-1) / group).mean()),
    }
    rows = {}
    for method, sel in selections.items():
        got = torch.gather(mass, -1, sel.long().clamp(min=0)).masked_fill(sel < 0, 0).sum(-1)
        recall = (got / oracle_mass).flatten()
        out = sparse_prefill_reference(q, cache, sel, table, req, pos, k_scale, v_scale, sm, mode="ideal")
        rows[method] = {
            "recall_mean": float(recall.mean()),
            "recall_p05": float(recall.quantile(0.05)),
            "share_ge_0.9": float((recall >= 0.9).double().mean()),
            "output_rel_err": float((out - dense).norm() / dense.norm()),
        }
    return {"name": name, "stats": stats, "methods": rows}


def recall_section(args):
    ctx, hkv, group, queries, topk = args.context, 2, 16, args.queries, args.topk
    sets = []
    for sigma, share in ((1.0, 0.5), (0.5, 0.5), (1.0, 0.8), (2.0, 0.5)):
        k, v, q, qpos = needle_data(100, ctx, hkv, group, queries, sigma, share)
        sets.append(evaluate_set(f"needle sigma={sigma} share={share}", k, v, q, qpos, 100, topk))
        print_set(sets[-1])
    for seed in (200, 201):
        k, v, q, qpos = realistic_data(seed, ctx, hkv, group, queries)
        sets.append(evaluate_set(f"realistic seed={seed}", k, v, q, qpos, seed, topk))
        print_set(sets[-1])
    return {"context": ctx, "kv_heads": hkv, "group": group, "queries": queries, "topk": topk, "sets": sets}


def print_set(result):
    s = result["stats"]
    print(f"\n{result['name']}: ctx {s['context']}, {s['tokens']} tokens x {s['kv_heads']} KV heads, "
          f"G={s['group']}, visible blocks {s['visible_blocks_mean']:.0f}, oracle top-{s['topk']} share "
          f"{s['oracle_topk_share']:.3f}, forced-block share {s['forced_blocks_share']:.3f}")
    print(f"  {'method':14s} {'recall':>7s} {'p05':>7s} {'>=0.9':>7s} {'out err':>8s}")
    for m, r in result["methods"].items():
        print(f"  {m:14s} {r['recall_mean']:7.3f} {r['recall_p05']:7.3f} {r['share_ge_0.9']:7.3f} "
              f"{r['output_rel_err']:8.4f}")


def recall_markdown(res, command):
    lines = [
        "# Indexer recall of oracle attention mass",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Hardware: CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}  ",
        f"Context {res['context']} tokens, {res['queries']} query tokens at random positions in its second half, "
        f"Hkv={res['kv_heads']}, G={res['group']}, top-{res['topk']}, sink={SINK}, local={LOCAL}.",
        "",
        f"recall = mass(selected) / mass(oracle top-{res['topk']}), per (token, KV head): mean, 5th percentile, "
        "share >= 0.9; out err = ||sparse - dense|| / ||dense|| of the attention output (reference kernel, float64). "
        "Targets: recall >= 0.95 on planted needles, >= 0.9 on realistic data. Data sets and methods: "
        "docstring of `bench/eval_indexer.py`.",
        "",
    ]
    lines += ["## Summary against the targets", "",
              "| method | needle (sigma=1, share=0.5) | needle, all four settings (mean) | realistic (mean of seeds) |",
              "| --- | --- | --- | --- |"]
    needles = [s for s in res["sets"] if s["name"].startswith("needle")]
    realistic = [s for s in res["sets"] if s["name"].startswith("realistic")]
    for m in res["sets"][0]["methods"]:
        main = needles[0]["methods"][m]["recall_mean"]
        every = sum(s["methods"][m]["recall_mean"] for s in needles) / len(needles)
        real = sum(s["methods"][m]["recall_mean"] for s in realistic) / len(realistic)
        lines.append(f"| {m} | {main:.3f} {'(>= 0.95)' if main >= 0.95 else '(< 0.95)'} | {every:.3f} | "
                     f"{real:.3f} {'(>= 0.9)' if real >= 0.9 else '(< 0.9)'} |")
    lines.append("")
    for s in res["sets"]:
        st = s["stats"]
        lines += [f"## {s['name']}", "",
                  f"oracle top-{st['topk']} share of all mass {st['oracle_topk_share']:.3f}; share in own/sink/local "
                  f"blocks {st['forced_blocks_share']:.3f}; visible blocks (mean) {st['visible_blocks_mean']:.0f}", "",
                  "| method | recall | p05 | share >= 0.9 | out err |", "| --- | --- | --- | --- | --- |"]
        for m, r in s["methods"].items():
            lines.append(f"| {m} | {r['recall_mean']:.3f} | {r['recall_p05']:.3f} | {r['share_ge_0.9']:.3f} | "
                         f"{r['output_rel_err']:.4f} |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- GPU


def random_cache(num_pages, hkv, device, gen):
    """Random NVFP4 bytes with finite, moderate scales (E4M3 codes 0x20..0x47, either sign for codes)."""
    cache = torch.randint(0, 256, (num_pages, 2 * hkv, fmt.PAGE_SIZE, fmt.ROW_BYTES), dtype=torch.uint8,
                          device=device, generator=gen)
    cache[..., fmt.SCALE_OFFSET:] = torch.randint(0x20, 0x48, cache[..., fmt.SCALE_OFFSET:].shape, dtype=torch.uint8,
                                                  device=device, generator=gen)
    return cache


def gpu_check(device):
    """Compiled Triton vs torch path: summaries and selections on a random multi-request problem."""
    gen = torch.Generator(device=device).manual_seed(5)
    hkv, heads, seqs = 4, 64, [9000, 3000, 300]
    blocks = [-(-n // fmt.PAGE_SIZE) for n in seqs]
    num_pages = sum(blocks) + 8
    cache = random_cache(num_pages, hkv, device, gen)
    perm = torch.randperm(num_pages, device=device, generator=gen)
    table = torch.full((len(seqs), max(blocks)), -1, dtype=torch.int32, device=device)
    slots, used = [], 0
    for r, n in enumerate(seqs):
        table[r, : blocks[r]] = perm[used: used + blocks[r]].int()
        used += blocks[r]
        slots.append(table[r].long()[torch.arange(n, device=device) // 128] * 128 + torch.arange(n, device=device) % 128)
    slots = torch.cat(slots)
    a, b = BlockSummaries(num_pages, hkv, device), BlockSummaries(num_pages, hkv, device)
    a.update(cache, slots, impl="torch")
    b.update(cache, slots, impl="triton")
    result = {"summary_bounds_equal": bool(torch.equal(a.bounds, b.bounds)), "fill_equal": bool(torch.equal(a.fill, b.fill)),
              "summary_mean_max_abs_diff": float((a.mean.float() - b.mean.float()).abs().max())}
    req = torch.cat([torch.full((e,), r, dtype=torch.int32, device=device) for r, e in enumerate((2000, 700, 300))])
    pos = torch.cat([torch.arange(n - e, n, dtype=torch.int32, device=device) for n, e in zip(seqs, (2000, 700, 300))])
    q = torch.randn(len(req), heads, D, device=device, generator=gen).to(torch.bfloat16)
    for method in ("mean", "quest"):
        x = select_blocks(q, a, table, req, pos, method=method, impl="torch")
        y = select_blocks(q, a, table, req, pos, method=method, impl="triton")
        result[f"{method}_rows_identical"] = float((x == y).all(-1).double().mean())
    # decode-shaped call: one token per request
    last = torch.tensor([n - 1 for n in seqs], dtype=torch.int32, device=device)
    qd = torch.randn(len(seqs), heads, D, device=device, generator=gen).to(torch.bfloat16)
    rd = torch.arange(len(seqs), dtype=torch.int32, device=device)
    result["decode_rows_identical"] = float((select_blocks(qd, a, table, rd, last, impl="torch")
                                             == select_blocks(qd, a, table, rd, last, impl="triton")).all(-1).double().mean())
    return result


def gpu_section(args):
    import triton

    from sglang_nvfp4.kernels.triton_indexer import select_top_blocks

    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "topk": args.topk}
    print(f"GPU {out['device']}, torch {out['torch']}, triton {out['triton']}")
    try:
        out["check"] = gpu_check(device)
    except Exception as e:  # record and go on to the timings
        out["check"] = {"error": f"{type(e).__name__}: {e}"}
    print("compiled kernels vs torch path:", out["check"])
    try:
        attention_impl = kernels.resolve_implementation(device)
    except NotImplementedError as e:
        attention_impl = None
        print(f"attention kernels: not timed ({e})")
    out["attention_impl"] = attention_impl
    heads, hkv, chunk, batch = 64, 4, 8192, 32
    gen = torch.Generator(device=device).manual_seed(0)
    out["runs"] = []
    for ctx in (32768, 131072):
        blocks = ctx // fmt.PAGE_SIZE
        cache = random_cache(blocks, hkv, device, gen)
        table = torch.randperm(blocks, device=device, generator=gen).int()[None, :]
        summaries = BlockSummaries(blocks, hkv, device)
        all_slots = (table[0].long()[:, None] * fmt.PAGE_SIZE + torch.arange(fmt.PAGE_SIZE, device=device)).flatten()
        summaries.update(cache, all_slots)
        chunk_slots = all_slots[-chunk:]
        q = (torch.randn(chunk, heads, D, device=device, generator=gen)).to(torch.bfloat16)
        req = torch.zeros(chunk, dtype=torch.int32, device=device)
        pos = torch.arange(ctx - chunk, ctx, dtype=torch.int32, device=device)
        run = {"context": ctx, "prefill_tokens": chunk, "heads": heads, "kv_heads": hkv}
        run["update_chunk_ms"] = bench_ms(lambda: summaries.update(cache, chunk_slots))
        for method in ("mean", "quest"):
            run[f"select_{method}_ms"] = bench_ms(lambda: select_blocks(q, summaries, table, req, pos, topk=args.topk,
                                                                        method=method))
        qa = aggregate_queries(q, hkv, "quest")
        keys = summaries.keys("quest")
        for tokens in (16, 32, 64):
            run[f"select_quest_tile{tokens}_ms"] = bench_ms(
                lambda: select_top_blocks(qa, keys, table, req, pos, args.topk, SINK, LOCAL, tokens_per_tile=tokens))
        block_ids = select_blocks(q, summaries, table, req, pos, topk=args.topk)
        if attention_impl is not None:
            try:
                o = torch.empty_like(q)
                run["attention_prefill_ms"] = bench_ms(lambda: kernels.sparse_prefill(q, cache, block_ids, table, req, pos,
                                                                                       1.0, 1.0, D**-0.5, out=o))
            except Exception as e:  # the attention kernels are developed concurrently
                run["attention_error"] = f"{type(e).__name__}: {e}"
        # decode: `batch` requests of this context on distinct pages (one token each)
        dpages = blocks * batch
        dcache = random_cache(dpages, hkv, device, gen)
        dtable = torch.randperm(dpages, device=device, generator=gen).int().view(batch, blocks)
        dsum = BlockSummaries(dpages, hkv, device)
        dsum.update(dcache, torch.arange(dpages, device=device) * fmt.PAGE_SIZE + fmt.PAGE_SIZE - 1)
        dq = torch.randn(batch, heads, D, device=device, generator=gen).to(torch.bfloat16)
        dreq = torch.arange(batch, dtype=torch.int32, device=device)
        dpos = torch.full((batch,), ctx - 1, dtype=torch.int32, device=device)
        dslots = dtable[:, -1].long() * fmt.PAGE_SIZE + fmt.PAGE_SIZE - 1
        run["decode_batch"] = batch
        run["update_decode_ms"] = bench_ms(lambda: dsum.update(dcache, dslots))
        run["select_decode_quest_ms"] = bench_ms(lambda: select_blocks(dq, dsum, dtable, dreq, dpos, topk=args.topk,
                                                                       method="quest"))
        run["select_decode_mean_ms"] = bench_ms(lambda: select_blocks(dq, dsum, dtable, dreq, dpos, topk=args.topk,
                                                                      method="mean"))
        if attention_impl is not None:
            try:
                decode_block_ids = select_blocks(dq, dsum, dtable, dreq, dpos, topk=args.topk)
                do = torch.empty_like(dq)
                run["attention_decode_ms"] = bench_ms(lambda: kernels.sparse_decode(dq, dcache, decode_block_ids, dtable, dreq, dpos,
                                                                                     1.0, 1.0, D**-0.5, out=do))
            except Exception as e:
                run["attention_decode_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(run))
        out["runs"].append(run)
        del cache, dcache, summaries, dsum
        torch.cuda.empty_cache()
    return out


def gpu_markdown(res, command):
    lines = ["# Indexer GPU timing", "", f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}  ",
             f"Hardware: {res['device']}, torch {res['torch']}, triton {res['triton']}  ",
             f"Medians of `triton.testing.do_bench`. One request, H=64, Hkv=4, top-{res['topk']}; prefill = the last "
             "8192 tokens of the context (the costliest chunk: every token sees the whole context); decode = a batch "
             f"of {res['runs'][0]['decode_batch']} requests of that context on distinct pages. Random NVFP4 cache bytes.",
             "", f"Compiled kernels vs torch path: `{json.dumps(res['check'])}`", ""]
    if res["attention_impl"] is None:
        lines += ["The dispatcher did not serve CUDA: the attention kernels were not timed, the indexer alone was.", ""]
    lines += ["| context | update (8192 slots) | select mean | select quest | attention prefill | quest / attention |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in res["runs"]:
        att = r.get("attention_prefill_ms")
        ratio = f"{(r['select_quest_ms'] + r['update_chunk_ms']) / att:.1%}" if att else "n/a"
        lines.append(f"| {r['context']} | {r['update_chunk_ms']:.3f} ms | {r['select_mean_ms']:.3f} ms | "
                     f"{r['select_quest_ms']:.3f} ms | {f'{att:.3f} ms' if att else r.get('attention_error', 'not run')} | {ratio} |")
    lines += ["", "| context | decode update | select mean | select quest | attention decode |", "| --- | --- | --- | --- | --- |"]
    for r in res["runs"]:
        att = r.get("attention_decode_ms")
        lines.append(f"| {r['context']} | {r['update_decode_ms']:.3f} ms | {r['select_decode_mean_ms']:.3f} ms | "
                     f"{r['select_decode_quest_ms']:.3f} ms | {f'{att:.3f} ms' if att else r.get('attention_decode_error', 'not run')} |")
    lines += ["", "Tile size sweep (select quest, prefill): " + ", ".join(
        f"ctx {r['context']}: " + " / ".join(f"{t} tok {r[f'select_quest_tile{t}_ms']:.3f} ms" for t in (16, 32, 64))
        for r in res["runs"]), ""]
    return "\n".join(lines)


def topk_argument(text: str) -> int:
    """``--topk``: blocks per KV head and token, from the forced sink + local + own blocks up to ``fmt.MAX_TOPK``."""
    try:
        topk = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    lowest = SINK + LOCAL + 1
    if not lowest <= topk <= fmt.MAX_TOPK:
        raise argparse.ArgumentTypeError(f"must be in {lowest}..{fmt.MAX_TOPK} (the sink, local and own blocks are "
                                         f"always selected; {fmt.MAX_TOPK} = fmt.MAX_TOPK), got {topk}")
    return topk


def output_name(stem: str, topk: int) -> str:
    """File name stem of a section's results: ``stem``, plus ``_top<topk>`` for a non-default budget."""
    return stem if topk == fmt.TOPK else f"{stem}_top{topk}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("recall", "gpu", "all"), default="all")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--topk", type=topk_argument, default=fmt.TOPK,
                        help=f"blocks selected per KV head and token (default {fmt.TOPK})")
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section in ("recall", "all"):
        t0 = time.time()
        res = recall_section(args)
        res.update(command=command, date=datetime.date.today().isoformat(), seconds=time.time() - t0)
        name = output_name(f"indexer_recall_{args.context // 1024}k", args.topk)
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
        (args.out / f"{name}.md").write_text(recall_markdown(res, command))
    if args.section in ("gpu", "all"):
        if not torch.cuda.is_available():
            print("GPU timing: no CUDA device, skipped")
        else:
            res = gpu_section(args)
            res.update(command=command, date=datetime.date.today().isoformat())
            name = output_name("indexer_gpu", args.topk)
            (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
            (args.out / f"{name}.md").write_text(gpu_markdown(res, command))


if __name__ == "__main__":
    main()
