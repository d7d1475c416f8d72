"""What a selection setting costs on a CUDA GPU: the indexer (``quest`` summaries or the token-level ``proxy``,
``proxy/G`` with G query groups per KV head, ``proxy/G/fp8`` with its products in fp8, ``proxy/G/fp8/sN`` with runs of
N positions sharing a selection in prefill, ``proxy/G/fp8/sNlast`` with each run scored by its last token) and the
sparse attention it feeds, per budget (top-16/32/64 blocks), prefill and decode (issue 17).

    python bench/bench_selection.py --out DIR [--prefill-t 32768] [--decode-batch 32 256] [--decode-ctx 32768]

Data: ``bench_kernels.one_request`` (random K/V through the cache write kernel, shuffled pages) with random
queries, the same for every setting. Random data give near-random selections, so union sizes (pages decoded
per 4-token tile) are the pessimistic case; the time of each setting still counts every page it visits.

Prefill, one request of T tokens, (H, Hkv) in {(64, 4), (16, 1)}: per setting, ``select_ms`` (the indexer's
selection: for quest the Triton scoring of the page summaries, which the cache write keeps up to date and
which are built here once, untimed; for proxy the Triton scoring of every visible NVFP4 key) and
``attention_ms`` (the dispatcher's plan with that selection, told a proxy's shared runs, as the backend tells it),
``total_ms``, ``union_mean``, and ``vs_quest16`` (total over top-16 quest, the default until 2026-12-01); fp8 rows
add ``same_as_fp16``, the fraction of (KV head, token) block sets equal to the fp16 proxy's. One more row,
``indexer`` ``every_block`` (``topk`` null), is what a ``NVFP4_SPARSE_DENSE_LAYERS`` layer costs: every visible block
through the same kernels (``select_ms``: building that selection, which the backend does once per forward). Peer in
the same run: dense causal SDPA over bf16 K/V (``dense_sdpa_ms``).

Decode, batch x 32K context, 64/4 heads, one query at each request's last position: the same settings timed
as CUDA-graph replays (``select_ms``, ``attention_ms``).

Every measured call runs once untimed first (Triton compiles and autotunes per shape). Writes
``DIR/selection_h200.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from bench_kernels import DEV, dense_causal_ms, one_request
from harness import log
from timing import bench_ms, graph_ms

from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.indexer import BlockSummaries, all_visible_blocks, select_blocks, select_blocks_proxy
from sglang_nvfp4.indexer.proxy import PRECISIONS
from sglang_nvfp4.kernels import triton_prefill

INDEXERS = ("quest", "proxy", "proxy/4")
BUDGETS = (16, 32, 64)
# (indexer, top-k) per row; "proxy/G" is the proxy with G query groups per KV head
# (NVFP4_SPARSE_PROXY_GROUPS), "proxy/G/fp8" with fp8 products (NVFP4_SPARSE_PROXY_PRECISION);
# ("every_block", None) is a dense layer's selection.
SETTINGS = (*((indexer, topk) for indexer in INDEXERS for topk in BUDGETS), ("every_block", None))
PREFILL_HEADS = ((64, 4), (16, 1))
DECODE_HEADS = (64, 4)


def selector(indexer: str, topk: int | None, cache, slots):
    """``select(q, block_table, req, pos) -> block_ids`` for one setting (sink and local blocks: 1 and 1, the
    defaults). Quest's page summaries are built here, untimed: serving keeps them current at each cache write."""
    if indexer == "every_block":
        kv_heads = cache.shape[1] // 2
        return lambda q, bt, req, pos: all_visible_blocks(pos, bt.shape[1]).expand(kv_heads, -1, -1)
    if indexer.startswith("proxy"):
        groups, precision, share, share_score = proxy_setting(indexer)
        return lambda q, bt, req, pos: select_blocks_proxy(q, cache, bt, req, pos, topk=topk, groups=groups,
                                                           precision=precision, share=share, share_score=share_score)
    summaries = BlockSummaries(cache.shape[0], cache.shape[1] // 2, device=DEV)
    summaries.update(cache, slots)
    return lambda q, bt, req, pos: select_blocks(q, summaries, bt, req, pos, topk=topk, method=indexer)


def proxy_setting(indexer: str) -> tuple[int, str, int, str]:
    """(query groups per KV head, precision, positions per shared selection, how a run scores) of a
    ``proxy[/G[/PRECISION[/sN[last]]]]`` setting name."""
    parts = indexer.split("/")
    shared = parts[3] if len(parts) > 3 else "s1"
    share_score = "last" if shared.endswith("last") else "max"
    share = int(shared.removeprefix("s").removesuffix("last"))
    return int(parts[1]) if len(parts) > 1 else 1, parts[2] if len(parts) > 2 else "fp16", share, share_score


def prefill_rows(t: int, heads: int, hkv: int, gen: torch.Generator, settings=SETTINGS) -> list[dict]:
    cache, block_table, slots = one_request(t, hkv, gen)
    pos = torch.arange(t, device=DEV, dtype=torch.int32)
    req = torch.zeros_like(pos)
    q = (torch.randn(t, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    out = torch.empty_like(q)
    tile = triton_prefill.default_prefill_config(heads // hkv).tokens_per_tile
    rows = []
    for indexer, topk in settings:
        select = selector(indexer, topk, cache, slots)
        block_ids = select(q, block_table, req, pos)  # untimed first call: compile
        # The attention planned as the SGLang backend plans it: a proxy's shared runs say so (selection_run).
        run = proxy_setting(indexer)[2] if indexer.startswith("proxy") else 1
        plan = kernels.plan_attention("prefill", block_table, req, pos, num_kv_heads=hkv, selection_run=run)

        def attend():
            return plan.run(q, cache, block_ids, 1.0, 1.0, fmt.HEAD_DIM**-0.5, out=out)

        attend()
        union_len, _ = triton_prefill.plan_tiles(block_ids, block_table, req, pos, tile)
        row = {"T": t, "H": heads, "Hkv": hkv, "indexer": indexer, "topk": topk,
               "select_ms": bench_ms(lambda: select(q, block_table, req, pos)),
               "attention_ms": bench_ms(attend), "union_mean": union_len.float().mean().item()}
        if indexer.endswith("/fp8"):
            fp16_ids = selector(indexer.removesuffix("/fp8"), topk, cache, slots)(q, block_table, req, pos)
            row["same_as_fp16"] = (fp16_ids == block_ids).all(-1).float().mean().item()
            del fp16_ids
        row["total_ms"] = row["select_ms"] + row["attention_ms"]
        rows.append(row)
        log(f"prefill T={t} {heads}/{hkv} {indexer} top{topk}: select {row['select_ms']:.2f} ms, "
            f"attention {row['attention_ms']:.2f} ms, union {row['union_mean']:.1f}")
        del block_ids, plan
    base = _quest16_total(rows)
    k_dense = torch.randn(t, hkv, fmt.HEAD_DIM, device=DEV, generator=gen).bfloat16()
    v_dense = torch.randn(t, hkv, fmt.HEAD_DIM, device=DEV, generator=gen).bfloat16()
    dense_ms = dense_causal_ms(q, k_dense, v_dense)
    for row in rows:
        row["vs_quest16"] = row["total_ms"] / base if base else None
        row["dense_sdpa_ms"] = dense_ms
    return rows


def decode_rows(batch: int, ctx: int, gen: torch.Generator, settings=SETTINGS) -> list[dict]:
    heads, hkv = DECODE_HEADS
    blocks = ctx // fmt.PAGE_SIZE
    cache = fmt.alloc_cache(batch * blocks, hkv, device=DEV)
    block_table = torch.randperm(batch * blocks, device=DEV, generator=gen).int().view(batch, blocks)
    tokens = torch.arange(ctx, device=DEV)
    for r in range(batch):
        slots = block_table[r].long()[tokens // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + tokens % fmt.PAGE_SIZE
        k = torch.randn(ctx, hkv, fmt.HEAD_DIM, device=DEV, generator=gen).bfloat16()
        kernels.write_kv(cache, slots, k, torch.randn_like(k), 1.0, 1.0)
    all_slots = (block_table.long()[:, :, None] * fmt.PAGE_SIZE + torch.arange(fmt.PAGE_SIZE, device=DEV)).flatten()
    pos = torch.full((batch,), ctx - 1, dtype=torch.int32, device=DEV)
    req = torch.arange(batch, dtype=torch.int32, device=DEV)
    q = (torch.randn(batch, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    scales = torch.tensor([1.0], device=DEV), torch.tensor([1.0], device=DEV)
    out = torch.empty_like(q)
    rows = []
    for indexer, topk in settings:
        select = selector(indexer, topk, cache, all_slots)
        block_ids = select(q, block_table, req, pos)
        args = (q, cache, block_ids, block_table, req, pos, *scales, fmt.HEAD_DIM**-0.5)
        row = {"batch": batch, "ctx": ctx, "H": heads, "Hkv": hkv, "indexer": indexer, "topk": topk,
               "select_ms": graph_ms(lambda: select(q, block_table, req, pos)),
               "attention_ms": graph_ms(lambda: kernels.sparse_decode(*args, out=out))}
        row["total_ms"] = row["select_ms"] + row["attention_ms"]
        rows.append(row)
        log(f"decode b{batch} ctx {ctx} {indexer} top{topk}: select {row['select_ms'] * 1e3:.0f} us, "
            f"attention {row['attention_ms'] * 1e3:.0f} us")
    base = _quest16_total(rows)
    for row in rows:
        row["vs_quest16"] = row["total_ms"] / base if base else None
    return rows


def _quest16_total(rows: list[dict]) -> float | None:
    """Total time of the top-16 quest row (the default until 2026-12-01), None when it was not timed."""
    return next((r["total_ms"] for r in rows if r["indexer"] == "quest" and r["topk"] == fmt.TOPK), None)


def proxy_rows_sweep(t: int, gen: torch.Generator, groups: list[int], rows: list[int],
                     precisions: tuple[str, ...] = ("fp16",)) -> list[dict]:
    """Prefill selection time of the proxy indexer (top-32, 64/4 heads, T tokens) per query-group count,
    (token, group) rows per score program (``PROXY_PREFILL_ROWS`` is the shipped one) and product precision."""
    from sglang_nvfp4.indexer.summary import aggregate_queries
    from sglang_nvfp4.kernels.triton_indexer import select_proxy_blocks

    heads, hkv = DECODE_HEADS
    cache, block_table, _ = one_request(t, hkv, gen)
    pos = torch.arange(t, device=DEV, dtype=torch.int32)
    req = torch.zeros_like(pos)
    q = (torch.randn(t, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    out = []
    for g in groups:
        queries = aggregate_queries(q, hkv * g, "mean").contiguous()
        for r in rows:
            for precision in precisions:
                def select():
                    return select_proxy_blocks(queries, cache, block_table, req, pos, 32, 1, 1, groups=g,
                                               prefill_rows=r, fp8=precision == "fp8")
                select()  # untimed: compile
                out.append({"T": t, "H": heads, "Hkv": hkv, "groups": g, "prefill_rows": r, "precision": precision,
                            "select_ms": bench_ms(select)})
                log(f"proxy rows sweep T={t} groups {g} rows {r} {precision}: {out[-1]['select_ms']:.2f} ms")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefill-t", type=int, nargs="*", default=[32768])
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[32, 256])
    ap.add_argument("--decode-ctx", type=int, default=32768)
    ap.add_argument("--settings", nargs="*", default=[f"{i}:{k}" for i, k in SETTINGS],
                    help="INDEXER:TOPK rows to time (every_block:None is a dense layer); default: all")
    ap.add_argument("--proxy-groups-sweep", type=int, nargs="*", default=[],
                    help="query-group counts of the proxy rows sweep (64/4 heads, first --prefill-t); none: skipped")
    ap.add_argument("--proxy-rows", type=int, nargs="*", default=[128, 256], help="rows per score program swept")
    ap.add_argument("--proxy-precisions", nargs="*", default=["fp16"], choices=PRECISIONS,
                    help="product precisions of the proxy rows sweep")
    args = ap.parse_args(argv)
    settings = [(name, None if k == "None" else int(k)) for name, k in (s.split(":") for s in args.settings)]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "selection_h200.json")
    results = {"meta": {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                        "command": " ".join(["bench/bench_selection.py", *(argv or sys.argv[1:])]),
                        "torch": torch.__version__, "implementation": kernels.resolve_implementation(DEV)},
               "prefill": [], "decode": []}
    gen = torch.Generator(device=DEV).manual_seed(0)

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    if args.proxy_groups_sweep:
        results["proxy_rows_sweep"] = proxy_rows_sweep(args.prefill_t[0], gen, args.proxy_groups_sweep, args.proxy_rows,
                                                     args.proxy_precisions)
        save()
    for t in args.prefill_t:
        for heads, hkv in PREFILL_HEADS:
            results["prefill"].extend(prefill_rows(t, heads, hkv, gen, settings))
            save()
            torch.cuda.empty_cache()
    for batch in args.decode_batch:
        results["decode"].extend(decode_rows(batch, args.decode_ctx, gen, settings))
        save()
        torch.cuda.empty_cache()
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
