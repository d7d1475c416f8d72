"""Kernel regression check between two source trees of ``sglang_nvfp4``, in one run on one GPU.

    python bench/bench_regression.py --trees BASE_DIR NEW_DIR --out DIR [--rounds 3]

Each tree is imported in its own child process (``PYTHONPATH`` = the tree), which times a fixed set
of cases through the public API only (``kernels.sparse_prefill`` / ``sparse_decode`` / ``write_kv``,
``indexer.BlockSummaries`` / ``select_blocks``, the default indexer as the server builds it:
``SparseConfig().build_indexer`` then ``select``; the same arguments in both trees), each
replayed from a CUDA graph (no launch gaps, no Python overhead) after an untimed compile-and-warm run,
median of ``triton.testing.do_bench``. The trees alternate ``--rounds`` times (base, new, base, new,
...) so that clock drift hits both; per case the report takes the median over rounds and the ratio
new / base, next to the spread of the base's own rounds (the noise). Every case's output is hashed:
inputs are identical (fixed seeds), so equal hashes mean bit-identical results.

Cases: prefill at T = ``--prefill-t`` (one request), 64 query / 4 KV heads with per-token random
top-16, top-16 shared by runs of 8 tokens, and the indexer's own selection; 16/1 random; decode at
``--decode-ctx`` context, batch 32 and 256, random top-16; the cache write of ``--prefill-t`` tokens;
the quest indexer's summary update and selection at ``--prefill-t``; the default indexer's selection (what a
server builds with no ``NVFP4_SPARSE_*`` variable set: top-16 ``proxy`` over every query head, fp8 products) in
that prefill and in both decode batches.
Writes ``DIR/regression.json`` and ``DIR/regression.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HEAD_DIM = 128
PAGE = 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, metavar=("BASE", "NEW"), help="two source trees holding sglang_nvfp4/")
    parser.add_argument("--out", default="regression_out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-t", type=int, default=32768)
    parser.add_argument("--decode-ctx", type=int, default=32768)
    parser.add_argument("--device", default="cuda", help="cpu: a rehearsal of the flow (one untimed-graph call per "
                        "case; set NVFP4_SPARSE_KERNEL=triton and TRITON_INTERPRET=1 for the kernels)")
    parser.add_argument("--measure", metavar="JSON", help=argparse.SUPPRESS)  # child: write this tree's timings
    args = parser.parse_args(argv)
    if not args.measure and not args.trees:
        parser.error("--trees BASE NEW is required")
    return args


# ---------------------------------------------------------------------------------------------- child


def token_slots(table_row, tokens: int):
    """The cache slots of a request's first ``tokens`` tokens, from its block-table row: int64 ``[tokens]``."""
    import torch

    offsets = torch.arange(tokens, device=table_row.device)
    return table_row.long()[offsets // PAGE] * PAGE + offsets % PAGE


def filled_cache(gen, requests, tokens, hkv, dev):
    """``requests`` requests of ``tokens`` tokens on shuffled pages, written by ``kernels.write_kv`` of the
    ``sglang_nvfp4`` on ``sys.path``: ``(cache, table)``, the block table int32 ``[requests, tokens / PAGE]``
    (also ``bench_prefill_variants.py``'s)."""
    import torch

    from sglang_nvfp4 import format as fmt
    from sglang_nvfp4 import kernels

    blocks = tokens // PAGE
    cache = fmt.alloc_cache(requests * blocks, hkv, device=dev)
    table = torch.randperm(requests * blocks, device=dev, generator=gen).int().view(requests, blocks)
    for r in range(requests):
        for part in token_slots(table[r], tokens).split(65536):
            k, v = (torch.randn(part.shape[0], hkv, HEAD_DIM, device=dev, generator=gen).bfloat16() for _ in range(2))
            kernels.write_kv(cache, part, k, v, 1.0, 1.0)
    return cache, table


def random_ids(gen, pos, hkv, width=16):
    """The cases' selections (also ``bench_prefill_variants.py``'s): per KV head and token its own block, then random
    distinct earlier blocks, then -1; int32 ``[Hkv, T, width]`` on ``pos``'s device, drawn from ``gen``."""
    import torch

    dev = pos.device
    own = (pos.long() // PAGE)[None, :, None]
    blocks = torch.arange(int(own.max()) + 1, device=dev)
    out = []
    for chunk in own.split(4096, dim=1):
        score = torch.rand(hkv, chunk.shape[1], blocks.numel(), device=dev, generator=gen)
        score = torch.where(blocks > chunk, -1.0, torch.where(blocks == chunk, 2.0, score))
        top, ids = torch.topk(score, min(width, blocks.numel()), dim=-1)
        out.append(torch.where(top < 0, -1, ids).int())
    ids = torch.cat(out, dim=1)
    return torch.nn.functional.pad(ids, (0, width - ids.shape[2]), value=-1).contiguous()


def prefill_problem(heads: int, hkv: int, t: int, dev: str):
    """The prefill cases' problem (also ``bench_prefill_variants.py``'s) for ``heads`` query / ``hkv`` KV heads and
    ``t`` tokens of one request: ``(gen, cache, table, pos, req, q)``, drawn in this order from a generator seeded
    with ``heads``, whose further draws make the selections."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(heads)
    cache, table = filled_cache(gen, 1, t, hkv, dev)
    pos = torch.arange(t, dtype=torch.int32, device=dev)
    req = torch.zeros_like(pos)
    q = (torch.randn(t, heads, HEAD_DIM, device=dev, generator=gen) * 0.3).bfloat16()
    return gen, cache, table, pos, req, q


def shared_ids(gen, pos, hkv, run: int):
    """:func:`random_ids` drawn for the last token of each run of ``run`` tokens and shared by the whole run."""
    return random_ids(gen, pos[run - 1::run], hkv).repeat_interleave(run, dim=1)[:, :pos.numel()].contiguous()


def measure(args) -> dict:
    """Time every case with the ``sglang_nvfp4`` on ``sys.path``; returns ``{case: {ms, hash}}``."""
    import torch
    from timing import graph_ms, output_hash

    from sglang_nvfp4 import format as fmt
    from sglang_nvfp4 import kernels
    from sglang_nvfp4.indexer import BlockSummaries, select_blocks
    from sglang_nvfp4.sglang.config import SparseConfig

    dev = args.device
    results = {}

    def timed(name, fn, output):
        if dev == "cpu":  # rehearsal: no graphs, no timing worth the name
            fn()
            start = time.perf_counter()
            fn()
            ms = (time.perf_counter() - start) * 1e3
        else:
            ms = graph_ms(fn)  # an untimed compile-and-warm run first
        digest = output_hash(output())
        results[name] = {"ms": ms, "hash": digest}
        print(f"  {name}: {ms:.4f} ms  {digest}", flush=True)

    def default_selection(name, q, cache, table, req, pos):
        """Times the selection of the indexer a server builds when no ``NVFP4_SPARSE_*`` variable is set."""
        indexer = SparseConfig().build_indexer(1, cache.shape[0], cache.shape[1] // 2, dev)
        picked = indexer.select(0, q, cache, table, req, pos).clone()
        timed(name, lambda: picked.copy_(indexer.select(0, q, cache, table, req, pos)), lambda: picked)

    t = args.prefill_t
    scale = torch.ones(1, device=dev)
    for heads, hkv, patterns in ((64, 4, ("random", "shared8", "indexer")), (16, 1, ("random",))):
        gen, cache, table, pos, req, q = prefill_problem(heads, hkv, t, dev)
        out = torch.empty_like(q)
        for pattern in patterns:
            if pattern == "random":
                ids = random_ids(gen, pos, hkv)
            elif pattern == "shared8":
                ids = shared_ids(gen, pos, hkv, 8)
            else:
                summaries = BlockSummaries(cache.shape[0], hkv, device=dev)
                slots = token_slots(table[0], t)
                summaries.update(cache, slots)
                ids = select_blocks(q, summaries, table, req, pos)
                if heads == 64:
                    default_selection(f"default_select_T{t}", q, cache, table, req, pos)
                    timed(f"indexer_update_T{t}", lambda: summaries.update(cache, slots), lambda: summaries.bounds)
                    picked = torch.empty_like(ids)
                    timed(f"indexer_select_T{t}", lambda: picked.copy_(select_blocks(q, summaries, table, req, pos)),
                          lambda: picked)
            timed(f"prefill_T{t}_{heads}x{hkv}_{pattern}",
                  lambda: kernels.sparse_prefill(q, cache, ids, table, req, pos, scale, scale, HEAD_DIM**-0.5, out=out),
                  lambda: out)
        if heads == 64:
            k, v = (torch.randn(t, hkv, HEAD_DIM, device=dev, generator=gen).bfloat16() for _ in range(2))
            target = fmt.alloc_cache(t // PAGE, hkv, device=dev)
            slots = torch.randperm(t, device=dev, generator=gen)
            timed(f"write_N{t}", lambda: kernels.write_kv(target, slots, k, v, scale, scale), lambda: target)
        del cache, q, out
        torch.cuda.empty_cache()

    ctx = args.decode_ctx
    for batch in (32, 256) if dev == "cuda" else (2,):
        gen = torch.Generator(device=dev).manual_seed(batch)
        hkv = 4
        cache, table = filled_cache(gen, batch, ctx, hkv, dev)
        pos = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)
        req = torch.arange(batch, dtype=torch.int32, device=dev)
        ids = random_ids(gen, pos, hkv)
        q = (torch.randn(batch, 64, HEAD_DIM, device=dev, generator=gen) * 0.3).bfloat16()
        out = torch.empty_like(q)
        timed(f"decode_ctx{ctx}_b{batch}",
              lambda: kernels.sparse_decode(q, cache, ids, table, req, pos, scale, scale, HEAD_DIM**-0.5, out=out),
              lambda: out)
        default_selection(f"default_select_ctx{ctx}_b{batch}", q, cache, table, req, pos)
        del cache
        torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------------------------- parent


def run_tree(tree: str, args, path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", path, "--prefill-t", str(args.prefill_t),
           "--decode-ctx", str(args.decode_ctx), "--device", args.device]
    from harness import log  # not at the top: the child imports only the measured tree's package

    log(f"measuring {tree}")
    subprocess.run(cmd, env=env, check=True)
    with open(path) as f:
        return json.load(f)


def report(trees, runs, args) -> dict:
    base, new = trees
    cases = list(runs[base][0])
    rows = []
    for case in cases:
        base_ms = [r[case]["ms"] for r in runs[base]]
        new_ms = [r[case]["ms"] for r in runs[new]]
        rows.append({
            "case": case, "base_ms": statistics.median(base_ms), "new_ms": statistics.median(new_ms),
            "ratio_new_over_base": statistics.median(new_ms) / statistics.median(base_ms),
            "base_spread": (max(base_ms) - min(base_ms)) / statistics.median(base_ms),
            "identical_output": len({r[case]["hash"] for r in runs[base] + runs[new]}) == 1,
            "base_rounds_ms": base_ms, "new_rounds_ms": new_ms,
        })
    return {"meta": {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "trees": trees,
                     "rounds": args.rounds}, "rows": rows}


def main():
    args = parse_args()
    if args.measure:
        with open(args.measure, "w") as f:
            json.dump(measure(args), f, indent=1)
        return
    os.makedirs(args.out, exist_ok=True)
    runs = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        for tag, tree in zip(("base", "new"), args.trees):
            runs[tree].append(run_tree(tree, args, os.path.join(args.out, f"round{round_}_{tag}.json")))
    result = report(args.trees, runs, args)
    import torch

    result["meta"]["gpu"] = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    with open(os.path.join(args.out, "regression.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Kernel regression: {args.trees[1]} vs {args.trees[0]}", "",
             f"{result['meta']['gpu']}, {result['meta']['date']}, `{result['meta']['command']}`, "
             f"medians of {args.rounds} alternating rounds (CUDA-graph replays).", "",
             "| case | base ms | new ms | new/base | base spread | identical output |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['base_ms']:.4f} | {r['new_ms']:.4f} | {r['ratio_new_over_base']:.3f} | "
                     f"{100 * r['base_spread']:.1f}% | {'yes' if r['identical_output'] else 'NO'} |")
    with open(os.path.join(args.out, "regression.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
