"""CUDA time by kernel of one proxy selection (``indexer.select_blocks_proxy``) on a GPU: where a selection's time
goes, per share setting.

    python bench/profile_selection.py OUT.json [--t 32768]

One request of ``--t`` tokens, 64 query / 4 KV heads, random K/V on shuffled pages (``bench_kernels.one_request``),
bf16 queries, every query head its own group, fp8 products, top-16; settings: per token (``share=1``), runs of 8 and
of 16 scored as their last token. Per setting: 3 untimed calls, then ``torch.profiler`` over 5 calls; the CUDA time
per call of the 25 costliest kernels (the profiler's totals / 5) printed and written to ``OUT.json`` as
``{setting: [[kernel, count, ms per call], ...]}``. Run it with another tree first on ``PYTHONPATH`` to compare
trees (``bench/results/prefill_glue_h100.json``, ``score_order_profile_h100.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SETTINGS = [("default", 1, "max"), ("s8last", 8, "last"), ("s16last", 16, "last")]  # (name, share, share_score)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the per-kernel times")
    parser.add_argument("--t", type=int, default=32768, help="prompt tokens")
    args = parser.parse_args(argv)
    if args.t <= 0:
        parser.error(f"--t: a positive token count, got {args.t}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        sys.exit("profile_selection.py needs a CUDA GPU")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import DEV, one_request

    import sglang_nvfp4
    from sglang_nvfp4 import format as fmt
    from sglang_nvfp4.indexer import select_blocks_proxy

    print("tree", sglang_nvfp4.__file__)
    gen = torch.Generator(device=DEV).manual_seed(0)
    heads, kv_heads = 64, 4
    cache, block_table, _ = one_request(args.t, kv_heads, gen)
    pos = torch.arange(args.t, device=DEV, dtype=torch.int32)
    req = torch.zeros_like(pos)
    q = (torch.randn(args.t, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    results = {}
    for name, share, score in SETTINGS:
        def select():
            return select_blocks_proxy(q, cache, block_table, req, pos, topk=16, groups=None, precision="fp8",
                                       share=share, share_score=score)

        for _ in range(3):
            select()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                select()
            torch.cuda.synchronize()
        rows = sorted(((e.key[:90], e.count, e.device_time_total / 5 / 1000) for e in prof.key_averages()
                       if e.device_time_total > 0 and e.device_type.name == "CUDA"), key=lambda r: -r[2])
        results[name] = rows[:25]
        print(f"== {name}: total {sum(r[2] for r in rows):.3f} ms per call")
        for kernel, count, ms in rows[:25]:
            print(f"  {ms:8.3f} ms  x{count // 5:<3} {kernel}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
