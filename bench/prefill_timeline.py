"""Where one CTA of the Gluon prefill spends its cycles, per union entry and partition, on one Hopper GPU.

    PYTHONPATH=TREE python bench/prefill_timeline.py --out FILE.json [--t 32768] [--ctas 1000:0 2000:0 3000:0]
        [--predecoded] [--groups]

``TREE`` is a source tree built with ``bench/experiments/consumer_timeline_probe.patch``: its kernel stores
``%clock64`` (SM cycles) at fixed points of each union entry of one CTA (``gluon_prefill.TRACE_AT``: program id 0
and KV head) into ``gluon_prefill.TRACE`` (int64 ``[3, 256, 8]``: consumer 0, consumer 1, producer x entry x point):

* consumer: 0 before the ``k_ready`` wait, 1 after it, 2 after ``S = Q.K^T`` (its entries only), 3 after the
  softmax, 4 after the ``v_ready`` wait, 5 after ``O += P.V`` (then the ``empty`` arrival and the next entry's plan
  loads, until the next entry's point 0);
* producer: 0 before the ``empty`` wait, 1 after it, 2 after the K hand-off, 3 after the V^T hand-off (then the next
  page's V^T loads are issued and the next entry's live keys reduced, until the next entry's point 0); with
  ``--predecoded`` (the pages decoded once into fp16 tiles, ``triton_predecode``, which the producer copies with the
  TMA) 2 and 3 follow the issue of the K and V^T copies, which land later (the consumers' ``k_ready`` / ``v_ready``).

``--groups`` gives the tiles regrouped tokens (``gluon_prefill.group_tokens``), as the dispatcher does for per-token
selections.

For each problem of ``bench_prefill_variants.py`` (64/4 random, shared8, indexer; 16/1 random) and each traced CTA
(``--ctas PID:KV_HEAD``, default three CTAs away from the first and last waves), after an untimed launch of the same
shape, it prints and writes the mean cycles of each step per entry (consumer steps over the entries that consumer
runs products for), the CTA's cycles per union entry, and the raw stamps. All CTAs run as in a timed launch; the
stores of the traced CTA add a few instructions to every CTA.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

STEPS = {"consumer": ("wait K", "S", "softmax", "wait V^T", "P.V"), "producer": ("wait slot", "K", "V^T")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--t", type=int, default=32768, help="tokens per problem")
    parser.add_argument("--ctas", nargs="+", default=["1000:0", "2000:0", "3000:0"],
                        help="PID:KV_HEAD of each traced CTA")
    parser.add_argument("--predecoded", action="store_true", help="trace the predecoded mode (the producer copies)")
    parser.add_argument("--groups", action="store_true", help="tiles of regrouped tokens (group_tokens)")
    args = parser.parse_args(argv)
    try:
        args.ctas = [tuple(int(x) for x in c.split(":")) for c in args.ctas]
    except ValueError:
        parser.error(f"--ctas: PID:KV_HEAD pairs of integers, got {args.ctas}")
    if any(len(c) != 2 or min(c) < 0 for c in args.ctas):
        parser.error(f"--ctas: PID:KV_HEAD pairs of non-negative integers, got {args.ctas}")
    return args


def summarize(stamps: torch.Tensor, union_len: int) -> dict:
    """Mean cycles per step from one CTA's stamps (int64 ``[3, 256, 8]``, entries ``< union_len``)."""
    s = stamps[:, :union_len].double()
    summary = {"union_len": union_len}
    for half in (0, 1):
        c = s[half]
        mine = c[:, 2] > 0
        steps = [c[:, 1] - c[:, 0], c[:, 2] - c[:, 1], c[:, 3] - c[:, 2], c[:, 4] - c[:, 3], c[:, 5] - c[:, 4]]
        rows = {name: steps[i][mine].mean().item() if mine.any() else 0.0 for i, name in enumerate(STEPS["consumer"])}
        rows["wait K, other entries"] = steps[0][~mine].mean().item() if (~mine).any() else 0.0
        done = torch.maximum(c[:-1, 4], c[:-1, 5])  # an entry's last stamp
        rows["to the next entry"] = (c[1:, 0] - done).mean().item() if union_len > 1 else 0.0
        rows["entries with products"] = int(mine.sum())
        rows["span"] = (c[:, 4].max() - c[:, 0].min()).item()
        summary[f"consumer{half}"] = rows
    p = s[2]
    summary["producer"] = {name: (p[:, i + 1] - p[:, i]).mean().item() for i, name in enumerate(STEPS["producer"])}
    summary["producer"]["to the next entry"] = (p[1:, 0] - p[:-1, 3]).mean().item() if union_len > 1 else 0.0
    summary["producer"]["span"] = (p[:, 3].max() - p[:, 0].min()).item()
    summary["cycles per entry"] = summary["consumer0"]["span"] / max(union_len, 1)
    return summary


def _steps_line(who: str, steps: dict) -> str:
    """One partition's mean cycles per step, as printed."""
    counted = f" ({steps['entries with products']} with products)" if "entries with products" in steps else ""
    return who + counted + " " + ", ".join(f"{k} {v:.0f}" for k, v in steps.items()
                                           if k not in ("entries with products", "span"))


def main(argv=None):
    args = parse_args(argv)
    from bench_prefill_variants import problems
    from bench_regression import HEAD_DIM

    from sglang_nvfp4.kernels import gluon_prefill, triton_predecode

    if not hasattr(gluon_prefill, "TRACE_AT"):
        raise SystemExit(f"{gluon_prefill.__file__}: not a tree with consumer_timeline_probe.patch")
    records = []
    for name, q, cache, ids, table, req, pos in problems(args.t, "cuda"):
        out = torch.empty_like(q)
        hkv = cache.shape[1] // 2
        group = q.shape[1] // hkv
        predecoded = None
        if args.predecoded:
            predecoded = triton_predecode.prepare(table, req, pos, hkv)
            triton_predecode.launch(cache, table, predecoded)
        slots = table if predecoded is None else predecoded.slot_table
        order = gluon_prefill.group_tokens(ids, slots, req, pos, group) if args.groups else None
        union_len, tiles = gluon_prefill.plan(ids, slots, req, pos, group, order)
        for pid, kv in args.ctas:
            if pid >= union_len.shape[1] or kv >= union_len.shape[0]:
                print(f"{name}: CTA {pid}:{kv} outside the grid {tuple(union_len.shape[::-1])}, skipped")
                continue
            gluon_prefill.TRACE = torch.zeros(3, 256, 8, dtype=torch.int64, device="cuda")
            gluon_prefill.TRACE_AT = (pid, kv)
            for _ in range(2):  # the first launch compiles; the second is traced
                gluon_prefill.TRACE.zero_()
                gluon_prefill.run(q, cache, pos, (union_len, tiles), 1.0, 1.0, HEAD_DIM**-0.5, out,
                                  tiles=None if predecoded is None else predecoded.tiles, order=order)
            torch.cuda.synchronize()
            stamps = gluon_prefill.TRACE.cpu()
            length = int(union_len[kv, union_len.shape[1] - 1 - pid])
            summary = summarize(stamps, length)
            records.append({"case": name, "cta": [pid, kv], "summary": summary,
                            "stamps": stamps[:, :length, :6].tolist()})
            print(f"{name} CTA {pid}:{kv}: {length} entries, {summary['cycles per entry']:.0f} cycles per entry; "
                  + "; ".join(_steps_line(f"c{h}", summary[f"consumer{h}"]) for h in (0, 1))
                  + "; " + _steps_line("producer", summary["producer"]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/prefill_timeline.py " + " ".join(argv or []),
                   "tree": gluon_prefill.__file__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "t": args.t, "predecoded": args.predecoded, "groups": args.groups,
                   "gpu": torch.cuda.get_device_name(), "records": records}, f)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
