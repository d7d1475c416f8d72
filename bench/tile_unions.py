"""How many distinct pages a prefill tile of N tokens visits, on the kernel benchmark's selections (no GPU needed).

    python bench/tile_unions.py --out DIR [--prefill-t 32768] [--heads 16/1 64/4] [--tiles 8 16 32]

The Gluon prefill decodes every page of its tile's union once (``gluon_prefill``: tiles of 8 tokens, two consumer
warpgroups of 4 tokens x 16 heads); the decoding is most of its time (``results/kernels_gluon_h200.md``). A tile of
more tokens, e.g. the 8-token tiles of a CTA cluster sharing their decoded pages, visits fewer pages per token where
neighbouring tokens' selections overlap. This script measures that overlap: the problems, seeds and selections of
``bench_kernels.py`` (one request of ``--prefill-t`` tokens; ``random``, ``shared8``, ``indexer``, top-16), and
per pattern and tile size the mean union (distinct selected pages per tile and KV head) and union pages per token.
Tile size 8 is today's kernel (its union is the benchmark's ``gluon_union_mean``). Writes ``DIR/tile_unions.json``.
Runs on the GPU when there is one, else on the CPU (about 2 minutes per head layout at 32K on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels  # noqa: E402  (the benchmark's problems and selections)

from sglang_nvfp4 import format as fmt  # noqa: E402


def tile_unions(block_ids: torch.Tensor, tile: int) -> torch.Tensor:
    """Distinct non-negative ids per tile of ``tile`` consecutive tokens and KV head: ``block_ids`` int32
    ``[Hkv, T, K]`` (``T`` a multiple of ``tile``) -> int64 ``[Hkv, T / tile]``."""
    hkv, t, k = block_ids.shape
    ids = torch.sort(block_ids.reshape(hkv, t // tile, tile * k), dim=-1).values
    new = torch.ones_like(ids, dtype=torch.bool)
    new[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return (new & (ids >= 0)).sum(-1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefill-t", type=int, default=32768)
    parser.add_argument("--heads", nargs="+", default=["16/1", "64/4"], help="query/KV heads, e.g. 64/4")
    parser.add_argument("--tiles", type=int, nargs="+", default=[8, 16, 32], help="tokens per tile")
    args = parser.parse_args(argv)
    if any(t < 1 or args.prefill_t % t for t in args.tiles):
        parser.error(f"--tiles: each must divide --prefill-t {args.prefill_t}, got {args.tiles}")
    return args


def main(argv=None):
    args = parse_args(argv)
    bench_kernels.DEV = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for layout in args.heads:
        heads, hkv = (int(x) for x in layout.split("/"))
        gen = torch.Generator(device=bench_kernels.DEV).manual_seed(0)
        cache, block_table, slots = bench_kernels.one_request(args.prefill_t, hkv, gen)
        pos = torch.arange(args.prefill_t, dtype=torch.int32, device=bench_kernels.DEV)
        q = (torch.randn(args.prefill_t, heads, fmt.HEAD_DIM, device=bench_kernels.DEV, generator=gen) * 0.3)
        q = q.bfloat16()
        for pattern in bench_kernels.PATTERNS:
            block_ids = bench_kernels.selection(pattern, q, cache, block_table, slots, pos, gen)
            for tile in args.tiles:
                union = tile_unions(block_ids, tile).float().mean().item()
                rows.append({"T": args.prefill_t, "H": heads, "Hkv": hkv, "pattern": pattern, "topk": fmt.TOPK,
                             "tile_tokens": tile, "union_mean": union, "pages_per_token": union / tile})
                print(f"{layout:>5} {pattern:>8} tile {tile:3d}: union {union:6.1f} pages, "
                      f"{union / tile:5.2f} per token", flush=True)
    for row in rows:  # against today's 8-token tiles of the same problem
        base = [r for r in rows if r["tile_tokens"] == 8 and all(r[k] == row[k] for k in ("H", "Hkv", "pattern"))]
        if base:
            row["pages_per_token_vs_tile8"] = row["pages_per_token"] / base[0]["pages_per_token"]
    os.makedirs(args.out, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "device": bench_kernels.DEV,
            "command": "python bench/tile_unions.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    with open(os.path.join(args.out, "tile_unions.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
