"""Does a dense first layer pay for itself in answers? (issue 17, item 3) CPU, real SGLang servers.

The trained retrieval model (``tests/fixtures/retrieval_model``, 2 layers) answers key-value questions about
shared documents (:func:`sglang_nvfp4.quality.task.make_shared_prompts`, as the CI quality gate): every prompt
is a two-token extend over its document's cached pages. Every setting is served by ``nvfp4_sparse``; the
baseline attends every block through the same NVFP4 cache (``DENSE_LAYERS=all``), so a difference is the
selection alone. Settings: the default (top-32 quest), top-16 quest, each with and without layer 0 attending
every block (``DENSE_LAYERS=0``), and top-16 with layer 1 attending every block (``DENSE_LAYERS=1``).

    python bench/quality_dense_layers_cpu.py --out DIR [--length 8192] [--documents 8] [--first-seed 100]

Writes ``DIR/dense_layers.json``: per setting the rows (one per prompt), the accuracy with its 95% Wilson
interval, the paired difference to every-block in points with its 95% interval, and the wall time. CPU
wall times show nothing about GPU cost (``bench/results/selection_h200.md`` has that).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from sglang_nvfp4.quality import task
from sglang_nvfp4.quality.evaluate import Setting, accuracy, run_setting
from sglang_nvfp4.quality.stats import paired_difference_interval, wilson_interval

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "retrieval_model")
SETTINGS = {
    "every_block": {"DENSE_LAYERS": "all"},
    "default": {},
    "default_dense0": {"DENSE_LAYERS": "0"},
    "top16": {"TOPK": "16"},
    "top16_dense0": {"TOPK": "16", "DENSE_LAYERS": "0"},
    "top16_dense1": {"TOPK": "16", "DENSE_LAYERS": "1"},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=100, help="the CI gate uses seeds 0-3")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = ap.parse_args(argv)
    if "every_block" not in args.settings:
        ap.error("--settings: every_block is the baseline and must be included")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    documents = [task.make_shared_prompts(seed, args.length)
                 for seed in range(args.first_seed, args.first_seed + args.documents)]
    prompts = [p for _, doc_prompts in documents for p in doc_prompts]
    result = {"argv": vars(args), "prompts": len(prompts),
              "pair_prompts": sum(p.family == "pair" for p in prompts), "settings": {}}
    path = os.path.join(args.out, "dense_layers.json")
    for name in sorted(args.settings, key=lambda n: n != "every_block"):  # the baseline first
        setting = Setting(name, "nvfp4_sparse", {f"NVFP4_SPARSE_{k}": v for k, v in SETTINGS[name].items()})
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        t0 = time.perf_counter()
        rows = run_setting(FIXTURE, setting, prompts, out_dir=os.path.join(args.out, name), batch=4,
                           prefixes=[tokens for tokens, _ in documents])
        entry = {"env": setting.env, "wall_s": time.perf_counter() - t0, "rows": rows,
                 "accuracy": accuracy(rows), "accuracy_95": wilson_interval(sum(r["correct"] for r in rows), len(rows))}
        if name != "every_block":
            base = result["settings"]["every_block"]["rows"]
            d, lo, hi = paired_difference_interval([r["correct"] for r in rows], [r["correct"] for r in base])
            entry["vs_every_block_points"] = [100 * d, 100 * lo, 100 * hi]
        result["settings"][name] = entry
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=float)
        diff = entry.get("vs_every_block_points")
        print(f"{name}: accuracy {entry['accuracy']:.3f} on {len(rows)} prompts"
              + (f", {diff[0]:+.1f} points [{diff[1]:+.1f}, {diff[2]:+.1f}] vs every block" if diff else "")
              + f" ({entry['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
