"""The Gluon decode's launch variants against each other and across source trees, on one Hopper GPU: its register
prefetch (on, off, or the launch's own choice), in a tree that has it, how many pages ahead each program has its
pages brought into L2 (``gluon_decode.launch(l2_pages=)``), and its split count (``gluon_decode.launch(splits=)``).

    PYTHONPATH=TREE python bench/bench_decode_variants.py --out DIR/NAME.json [--batch 1 32 256] [--ctx 32768]
        [--topk 16] [--variants auto:0 auto:2 auto:auto:4]

A variant is ``PREFETCH:L2_PAGES[:SPLITS]`` with ``PREFETCH`` one of ``auto`` (the launch's choice), ``on``, ``off``,
``L2_PAGES`` a count or ``auto`` (the launch's choice) and ``SPLITS`` a power of two or ``auto`` (the default: the
launch's choice); a split count outside the launch's range for a batch is skipped with a line saying so. A tree
whose ``gluon_decode.launch`` takes no ``l2_pages`` runs the variants with ``L2_PAGES`` 0 only (its launch as is).
``TREE`` is the source tree whose ``sglang_nvfp4`` is measured, so two trees compare by running this script once per
tree on the same machine. Problems as in ``bench_kernels.py``'s decode rows (``decode_problem``, same seeds): 64
query / 4 KV heads, ``--ctx`` tokens per request, one query token each at the last position, random top-``--topk``
blocks. Each case is ``gluon_decode.launch`` replayed from a CUDA graph after an untimed run, the median of
``triton.testing.do_bench`` (L2 flushed between runs); every output is hashed, so equal hashes across variants and
trees mean the same bits.
"""

from __future__ import annotations

import argparse
import inspect

import torch
from timing import graph_ms, output_hash, write_tree_record

PREFETCH = {"auto": None, "on": True, "off": False}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=["auto:0", "auto:2"], help="PREFETCH:L2_PAGES[:SPLITS]")
    args = parser.parse_args(argv)
    variants = []
    for v in args.variants:
        fields = v.split(":") + (["auto"] if v.count(":") == 1 else [])
        prefetch, pages, splits = fields if len(fields) == 3 else ("", "", "")
        power_of_two = splits.isdigit() and int(splits) > 0 and not int(splits) & (int(splits) - 1)
        if (prefetch not in PREFETCH or not (pages.isdigit() or pages == "auto")
                or not (power_of_two or splits == "auto")):
            parser.error(f"--variants: PREFETCH:L2_PAGES[:SPLITS] with PREFETCH in {sorted(PREFETCH)}, L2_PAGES a "
                         f"count or auto and SPLITS a power of two or auto, got {v!r}")
        variants.append((prefetch, None if pages == "auto" else int(pages), None if splits == "auto" else int(splits)))
    args.variants = variants
    return args


def main(argv=None):
    args = parse_args(argv)
    from bench_kernels import decode_problem

    from sglang_nvfp4 import __file__ as package_file
    from sglang_nvfp4.kernels import gluon_decode

    has_l2 = "l2_pages" in inspect.signature(gluon_decode.launch).parameters
    variants = args.variants if has_l2 else [v for v in args.variants if v[1] == 0]
    if variants != args.variants:
        print(f"{package_file}: no l2_pages; variants {[v for v in args.variants if v[1] != 0]} not run", flush=True)
    rows = []
    for batch in args.batch:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, cache, ids, table, req, pos, k_scale, v_scale, sm_scale = decode_problem(batch, args.ctx, gen, args.topk)
        out = torch.empty_like(q)
        case = f"decode_b{batch}_ctx{args.ctx}_top{args.topk}"
        width = ids.shape[2]
        fewest, most = gluon_decode.split_range(width)
        auto_splits = gluon_decode.decode_splits(batch, ids.shape[0], width, q.device)
        for prefetch, pages, splits in variants:
            if splits is not None and not fewest <= splits <= most:
                print(f"  {case}: splits={splits} outside [{fewest}, {most}], not run", flush=True)
                continue
            extra = {"l2_pages": pages} if has_l2 else {}

            def run():
                gluon_decode.launch(q, cache, ids, table, req, pos, k_scale, v_scale, sm_scale, out,
                                    splits=splits, prefetch=PREFETCH[prefetch], **extra)

            us = 1000 * graph_ms(run)
            digest = output_hash(out)
            label = "auto" if pages is None else pages
            ran = auto_splits if splits is None else splits
            rows.append({"case": case, "batch": batch, "prefetch": prefetch, "l2_pages": label, "splits": ran,
                         "us": us, "hash": digest})
            print(f"  {case} prefetch={prefetch} l2_pages={label} splits={ran}: {us:.1f} us  {digest}", flush=True)
        del out, cache
    write_tree_record(args.out, "bench_decode_variants.py", argv, package_file, rows)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
