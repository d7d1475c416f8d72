"""The Gluon prefill's launch variants against each other and across source trees, on one Hopper GPU: its producer
sizes (4 or 8 warps) and, in a tree that has it, its cluster mode (branch ``next/cluster``: clusters of 2 CTAs per tile
of 16 tokens that share their decoded pages; measured and dropped, ``bench/results/cluster_prefill_h200.md``).

    PYTHONPATH=TREE python bench/bench_prefill_variants.py --out DIR/NAME.json [--t 32768] [--chunk C]
        [--variants 1:8 1:4] [--patterns random shared8 indexer]

A variant is ``CLUSTER:PRODUCER_WARPS``, or ``predecoded`` (the pages decoded once per layer into fp16 tiles that the
kernel copies, ``triton_predecode``; the timed call is ``launch``'s predecoding, planning and kernel, the forward's
``prepare`` made once before), either with ``+groups`` appended for tiles of regrouped tokens (``launch(token_groups=
True)``: ``group_tokens`` is timed too); a tree whose ``gluon_prefill.launch`` takes no ``cluster`` runs the variants
with ``CLUSTER`` 1 only, one without ``predecoded`` or ``token_groups`` skips those variants. ``TREE`` is the source
tree whose ``sglang_nvfp4`` is measured, so two trees compare by running this script once per tree on the same
machine. Problems as in ``bench_regression.py``, same seeds: T =
``--t`` tokens of one request, 64 query / 4 KV heads with per-token random top-16, top-16 shared by runs of 8 (or 16:
``shared16``) tokens and the quest indexer's selection; 16/1 random. ``--chunk C`` times only the prompt's last ``C``
tokens (their selections as in the whole prompt): an extend over a prefix of ``T - C`` tokens, the last chunk of a
long prompt under SGLang's chunked prefill, where the forward has ``C / (T / 128)`` query tokens per block-table slot,
the density that ``triton_predecode.pays`` decides on. Each case is ``gluon_prefill.launch`` (planner
and kernel) replayed from a CUDA graph after an untimed run, the median of ``triton.testing.do_bench``; every output
is hashed, so equal hashes across variants and trees mean the same bits.
"""

from __future__ import annotations

import argparse
import inspect

import torch
from bench_regression import HEAD_DIM, prefill_problem, random_ids, shared_ids, token_slots
from timing import graph_ms, output_hash, write_tree_record


PREDECODED = "predecoded"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--t", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=0,
                        help="time the last C tokens only (0: all T); a multiple of 8, so that the shared patterns' "
                             "runs stay those of the whole prompt")
    parser.add_argument("--variants", nargs="+", default=["1:8", "1:4"],
                        help="CLUSTER:PRODUCER_WARPS or predecoded, either with +groups")
    parser.add_argument("--patterns", nargs="+", default=["random", "shared8", "indexer"],
                        help="64/4 selections: random, shared8, shared16 (runs of 16 tokens), indexer")
    parser.add_argument("--device", default="cuda", help="cpu: check the arguments and the problems only")
    args = parser.parse_args(argv)
    if not 0 <= args.chunk <= args.t or args.chunk % 8:
        parser.error(f"--chunk {args.chunk}: expected a multiple of 8 in [0, --t]")
    return args


def problems(t: int, dev: str, patterns=("random", "shared8", "indexer"), chunk: int = 0):
    """Yields ``(name, q, cache, ids, table, req, pos)`` for the cases above (fixed seeds); with ``chunk``, the last
    ``chunk`` tokens' ``q``, ``ids``, ``req`` and ``pos`` only."""
    from sglang_nvfp4.indexer import BlockSummaries, select_blocks

    for heads, hkv, patterns in ((64, 4, tuple(patterns)), (16, 1, ("random",))):
        gen, cache, table, pos, req, q = prefill_problem(heads, hkv, t, dev)
        for pattern in patterns:
            if pattern == "random":
                ids = random_ids(gen, pos, hkv)
            elif pattern.startswith("shared"):
                ids = shared_ids(gen, pos, hkv, int(pattern[len("shared"):]))
            else:
                summaries = BlockSummaries(cache.shape[0], hkv, device=dev)
                summaries.update(cache, token_slots(table[0], t))
                ids = select_blocks(q, summaries, table, req, pos)
            if chunk:
                last = slice(t - chunk, t)
                yield (f"prefill_T{t}_C{chunk}_{heads}x{hkv}_{pattern}", q[last], cache, ids[:, last].contiguous(),
                       table, req[last], pos[last])
            else:
                yield f"prefill_T{t}_{heads}x{hkv}_{pattern}", q, cache, ids, table, req, pos


def main(argv=None):
    args = parse_args(argv)
    from sglang_nvfp4 import __file__ as package_file
    from sglang_nvfp4.kernels import gluon_prefill

    try:
        from sglang_nvfp4.kernels import triton_predecode
    except ImportError:  # a tree without the predecoded mode
        triton_predecode = None

    launch_parameters = inspect.signature(gluon_prefill.launch).parameters
    has_clusters = "cluster" in launch_parameters
    has_predecoded = "predecoded" in launch_parameters
    has_groups = "token_groups" in launch_parameters
    variants, skipped = [], []
    for v in args.variants:
        base, _, suffix = v.partition("+")
        if suffix not in ("", "groups"):
            raise SystemExit(f"--variants {v}: the only suffix is +groups")
        mode = (0, 0) if base == PREDECODED else tuple(int(x) for x in base.split(":"))
        has_mode = has_predecoded if mode == (0, 0) else mode[0] == 1 or has_clusters
        if has_mode and (not suffix or has_groups):
            variants.append(mode + (suffix == "groups",))
        else:
            skipped.append(v)
    if skipped:
        print(f"{package_file}: variants {skipped} not run (no such mode)", flush=True)
    dev = args.device
    rows = []
    for name, q, cache, ids, table, req, pos in problems(args.t, dev, args.patterns, args.chunk):
        if dev == "cpu":
            print(f"{name}: ids {tuple(ids.shape)}; variants {variants}", flush=True)
            continue
        out = torch.empty_like(q)
        scale = torch.ones(1, device=dev)
        for cluster, warps, groups in variants:
            extra = {"cluster": cluster} if has_clusters and cluster else {}
            if (cluster, warps) == (0, 0):  # predecoded
                extra = {"predecoded": triton_predecode.prepare(table, req, pos, cache.shape[1] // 2)}
                warps = None
            if groups:
                extra["token_groups"] = True

            def run():
                if "predecoded" in extra:
                    triton_predecode.launch(cache, table, extra["predecoded"])
                gluon_prefill.launch(q, cache, ids, table, req, pos, scale, scale, HEAD_DIM**-0.5, out,
                                     producer_warps=warps, **extra)

            ms = graph_ms(run)
            digest = output_hash(out)
            # The tiles' mean union (pages per tile and KV head) and, with +groups, the regrouping alone.
            plan_table = extra["predecoded"].slot_table if "predecoded" in extra else table
            group = q.shape[1] // (cache.shape[1] // 2)
            order = gluon_prefill.group_tokens(ids, plan_table, req, pos, group) if groups else None
            union = gluon_prefill.plan(ids, plan_table, req, pos, group, *([order] if groups else []))[0]
            union = union.float().mean().item()
            timings = {"union_mean": union}
            if groups:
                timings["group_tokens_ms"] = graph_ms(lambda: gluon_prefill.group_tokens(ids, plan_table, req, pos,
                                                                                        group))
            variant = (PREDECODED if "predecoded" in extra else f"{cluster}:{warps}") + ("+groups" if groups else "")
            rows.append({"case": name, "variant": variant, "cluster": cluster, "producer_warps": warps,
                         "token_groups": groups, "ms": ms, "hash": digest,
                         "tokens_per_slot": q.shape[0] / table.numel(), **timings})
            print(f"  {name} {variant}: {ms:.3f} ms  {digest}  union {union:.1f}"
                  + (f"  group_tokens {timings['group_tokens_ms']:.3f} ms" if groups else ""), flush=True)
        del out
    write_tree_record(args.out, "bench_prefill_variants.py", argv, package_file, rows, dev)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
