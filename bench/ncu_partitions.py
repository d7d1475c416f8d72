"""Where a warp-specialized kernel's warps stall, per partition, from an ncu source-page export.

    ncu --set full -k regex:KERNEL -o report python3 ...            # on the GPU
    ncu -i report.ncu-rep --page source --print-source sass --csv > sass.csv
    python bench/ncu_partitions.py sass.csv [--top 12]

The export holds one table per profiled launch: per SASS instruction, the warp-stall samples (all, and by reason)
and the instructions executed. A Gluon ``warp_specialize`` kernel lays its partitions out one after another, each
starting at a ``USETMAXREG`` (or the kernel's ``EXIT``); this script splits each launch there and prints, per
partition, its share of the samples, its stall reasons, its most-sampled instructions and its executed
instruction mix by opcode. The partition that holds ``F2FP.F16.E4M3`` instructions is marked as the decoder.
"""

from __future__ import annotations

import argparse
import collections
import csv


def launches(path: str):
    """Yield ``(header, rows)`` per profiled launch of the export."""
    rows = list(csv.reader(open(path)))
    starts = [i for i, row in enumerate(rows) if row and row[0] == "Kernel Name"] + [len(rows)]
    for start, end in zip(starts, starts[1:]):
        yield rows[start + 1], [row for row in rows[start + 2:end] if len(row) > 2]


def opcode(source: str) -> str:
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def partitions(rows, col):
    """Split a launch's instructions at each ``USETMAXREG`` / ``EXIT``; keep the spans longer than 50 instructions."""
    cuts = [i for i, row in enumerate(rows) if opcode(row[col["Source"]]) in ("USETMAXREG", "EXIT")]
    bounds = [0] + cuts + [len(rows)]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:]) if b - a > 50]


def summarize(path: str, top: int = 12) -> list[list[dict]]:
    """Per launch, per partition: ``address``, ``kind``, ``share`` (of the launch's samples), ``reasons``
    (fraction of the partition's stall samples by reason, largest first), ``top`` (``(fraction, instruction)``),
    ``executed`` (warp instructions) and ``mix`` (fraction by opcode, largest first)."""
    result = []
    for header, rows in launches(path):
        col = {name: i for i, name in enumerate(header)}
        samples = col["Warp Stall Sampling (All Samples)"]
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(int(row[samples] or 0) for row in rows) or 1
        parts = []
        for part in partitions(rows, col):
            sources = [row[col["Source"]] for row in part]
            kind = ("decoder (F2FP.F16.E4M3)" if any("F2FP.F16.E4M3" in x for x in sources)
                    else "wgmma (HGMMA)" if any("HGMMA" in x for x in sources) else "other")
            by_reason = collections.Counter()
            for row in part:
                for reason in reasons:
                    by_reason[reason[len("stall_"):]] += int(row[col[reason]] or 0)
            stalls = sum(by_reason.values()) or 1
            mix = collections.Counter()
            for row in part:
                mix[opcode(row[col["Source"]])] += int(row[col["Instructions Executed"]] or 0)
            executed = sum(mix.values()) or 1
            parts.append({
                "address": part[0][col["Address"]], "kind": kind,
                "share": sum(int(row[samples] or 0) for row in part) / total,
                "reasons": [(r, v / stalls) for r, v in by_reason.most_common()],
                "top": [(int(row[samples] or 0) / stalls, row[col["Source"]])
                        for row in sorted(part, key=lambda r: -int(r[samples] or 0))[:top]],
                "executed": sum(mix.values()), "mix": [(op, v / executed) for op, v in mix.most_common()],
            })
        result.append(parts)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12, help="most-sampled instructions per partition")
    args = parser.parse_args()
    for n, parts in enumerate(summarize(args.csv, args.top)):
        print(f"== launch {n}")
        for part in parts:
            print(f"-- partition at {part['address']} ({part['kind']}): {part['share']:.1%} of the samples")
            print("   reasons: " + ", ".join(f"{r} {v:.1%}" for r, v in part["reasons"][:8]))
            for fraction, source in part["top"]:
                print(f"   {fraction:6.1%}  {source[:90]}")
            print(f"   executed warp instructions: {part['executed']}; "
                  + ", ".join(f"{op} {v:.1%}" for op, v in part["mix"][:14]))


if __name__ == "__main__":
    main()
