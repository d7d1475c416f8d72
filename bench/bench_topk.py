"""Block selection's top-k on a CUDA GPU: the indexer's fused Triton kernel against materialized scores
ranked by ``torch.topk`` and by FlashInfer's ``top_k`` (tie-break: smaller index, as the selection rule).

    python bench/bench_topk.py --out DIR [--t 32768] [--decode-batch 256]

Problems (64 query / 4 KV heads, quest summaries of a random cache, one sink and one local block):
prefill of one request of ``--t`` tokens, and decode of ``--decode-batch`` requests at ``--t`` context.
Ours: :func:`sglang_nvfp4.kernels.triton_indexer.select_top_blocks` (scores, forced blocks, top-k and the
ascending sort in one pass over the blocks). The materialized variants compute the fp32 scores
``[Hkv, T, blocks]`` with one matmul, apply the same rule (:func:`sglang_nvfp4.indexer.rules.forced_blocks`,
visibility), take the top 16 and sort the ids; ``materialized_without_topk`` does all of that but picks the
first 16 columns instead of ranking, a lower bound for any top-k kernel on materialized scores. Each
variant: CUDA-graph median ms, and the share of (token, KV head) rows whose block set equals ours. FlashInfer's top-k module is used only when it is
already compiled (prebuilt, or in FlashInfer's JIT cache): its build is not timed here
(``flashinfer_topk`` in the JSON says which). Writes ``DIR/topk.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
from harness import log
from timing import graph_ms

from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import BlockSummaries
from sglang_nvfp4.indexer.rules import forced_blocks
from sglang_nvfp4.indexer.summary import aggregate_queries
from sglang_nvfp4.kernels.triton_indexer import select_top_blocks

DEV = "cuda"
HEADS, HKV = 64, 4
SINK, LOCAL = 1, 1


def flashinfer_topk():
    """``(top_k function or None, why)``: FlashInfer's top-k when its module is compiled already."""
    try:
        import flashinfer
        from flashinfer.jit.topk import gen_topk_module
    except ImportError as exc:
        return None, f"flashinfer does not import: {exc}"
    spec = gen_topk_module()
    if not spec.is_compiled:
        return None, f"not compiled (no {spec.get_library_path()})"
    return flashinfer.top_k, f"compiled: {spec.get_library_path()}"


def problem(t: int, batch: int, gen: torch.Generator):
    """Aggregated queries ``[T, Hkv, 256]``, quest keys, block table, req, pos of ``batch`` requests of ``t``
    tokens (``batch == 1``: a prefill of all ``t`` tokens; else one decode token per request)."""
    blocks = t // fmt.PAGE_SIZE
    cache = fmt.alloc_cache(batch * blocks, HKV, device=DEV).random_(0, 256, generator=gen)
    cache[..., fmt.SCALE_OFFSET:].random_(0x28, 0x40, generator=gen)
    summaries = BlockSummaries(batch * blocks, HKV, device=DEV)
    summaries.update(cache, torch.arange(batch * blocks * fmt.PAGE_SIZE, device=DEV))
    table = torch.randperm(batch * blocks, device=DEV, generator=gen).int().view(batch, blocks)
    if batch == 1:
        pos = torch.arange(t, device=DEV, dtype=torch.int32)
        req = torch.zeros_like(pos)
    else:
        pos = torch.full((batch,), t - 1, device=DEV, dtype=torch.int32)
        req = torch.arange(batch, device=DEV, dtype=torch.int32)
    q = (torch.randn(pos.shape[0], HEADS, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    return aggregate_queries(q, HKV, "quest"), summaries.keys("quest"), table, req, pos


def materialized(queries, keys, table, req, pos, topk_fn):
    """Scores ``[Hkv, T, blocks]`` in one matmul (keys gathered per token's request), the selection rule,
    ``topk_fn(scores [rows, blocks], 16) -> ids``, ids sorted ascending, -1 for invisible picks."""
    own = pos.long() // fmt.PAGE_SIZE
    num_blocks = table.shape[1]
    if table.shape[0] == 1:  # one request: every token scores the same keys
        k = keys[table[0].long()].float()  # [B, Hkv, D]
        scores = torch.einsum("thd,bhd->htb", queries.float(), k)
    else:  # one token per request
        k = keys[table[req.long()].long()].float()  # [T, B, Hkv, D]
        scores = torch.einsum("thd,tbhd->htb", queries.float(), k)
    forced = forced_blocks(own, num_blocks, SINK, LOCAL)
    visible = torch.arange(num_blocks, device=DEV)[None, :] <= own[:, None]
    scores = torch.where(forced, math.inf, torch.where(visible, scores, -math.inf))
    ids = topk_fn(scores.view(-1, num_blocks), fmt.TOPK)
    picked_visible = torch.gather(scores.view(-1, num_blocks), 1, ids.long()) > -math.inf
    ids = torch.where(picked_visible, ids.int(), torch.iinfo(torch.int32).max)
    ids = torch.sort(ids, dim=-1).values
    return torch.where(ids == torch.iinfo(torch.int32).max, -1, ids).view(HKV, -1, fmt.TOPK)


def run_case(name, t, batch, fi_topk, gen):
    queries, keys, table, req, pos = problem(t, batch, gen)
    variants = {
        "ours_fused_triton": lambda: select_top_blocks(queries, keys, table, req, pos, fmt.TOPK, SINK, LOCAL),
        "torch_topk": lambda: materialized(queries, keys, table, req, pos,
                                           lambda s, k: torch.topk(s, k, dim=-1, sorted=False).indices),
    }
    variants["materialized_without_topk"] = lambda: materialized(
        queries, keys, table, req, pos, lambda s, k: torch.arange(k, device=DEV).expand(s.shape[0], k))
    if fi_topk is not None:
        variants["flashinfer_top_k"] = lambda: materialized(queries, keys, table, req, pos,
                                                            lambda s, k: fi_topk(s, k, tie_break=1)[1])
    ours = variants["ours_fused_triton"]()
    row = {"case": name, "T": t, "batch": batch, "tokens": int(pos.shape[0]), "blocks": int(table.shape[1])}
    for label, fn in variants.items():
        try:
            got = fn()
            row[f"{label}_same_set"] = (got == ours).all(dim=-1).float().mean().item()
            row[f"{label}_ms"] = graph_ms(fn)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded
            row[f"{label}_error"] = repr(exc)[:400]
    log(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--t", type=int, default=32768, help="prefill tokens and decode context (default 32768)")
    ap.add_argument("--decode-batch", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fi_topk, why = flashinfer_topk()
    log(f"FlashInfer top_k: {why}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    results = {"meta": {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                        "command": " ".join(sys.argv), "torch": torch.__version__},
               "flashinfer_topk": why, "rows": []}
    for name, t, batch in (("prefill", args.t, 1), ("decode", args.t, args.decode_batch)):
        results["rows"].append(run_case(name, t, batch, fi_topk, gen))
        with open(os.path.join(args.out, "topk.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
