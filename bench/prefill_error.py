"""The Gluon prefill's error against the float64 reference, per source tree, on one Hopper GPU: for a change to the
kernel's numerics (a different softmax step, a different reduction order), whether it stays as close to the exact
result as main.

    PYTHONPATH=TREE python bench/prefill_error.py --tag NAME --dir DIR [--t 4096]
    python bench/prefill_error.py --compare DIR NAME_A NAME_B [--out FILE.json]

The first form runs ``gluon_prefill.launch`` of ``TREE``'s package on ``bench_prefill_variants.py``'s problems at
``--t`` tokens (64/4 random, shared8, indexer; 16/1 random; same seeds), K and V scales 1, and saves each output as
``DIR/NAME_CASE.pt``; the first tree to run also saves ``sparse_prefill_reference(mode="ideal")`` (float64, no
intermediate rounding) as ``DIR/ref_CASE.pt``. The second form prints, per case, the max and mean absolute error
of both trees against the reference, their difference, and whether they are bit-identical (and writes them to
``--out``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", help="name of this tree's outputs")
    parser.add_argument("--dir", help="folder of the saved outputs")
    parser.add_argument("--t", type=int, default=4096, help="tokens per problem")
    parser.add_argument("--compare", nargs=3, metavar=("DIR", "NAME_A", "NAME_B"))
    parser.add_argument("--out", help="--compare: JSON file to write")
    args = parser.parse_args(argv)
    if args.compare is None and not (args.tag and args.dir):
        parser.error("either --tag and --dir (run a tree) or --compare DIR NAME_A NAME_B")
    if args.compare is not None and (args.tag or args.dir):
        parser.error("--compare takes its folder and names itself; --tag and --dir are for running a tree")
    return args


def compare(folder: str, a: str, b: str) -> list[dict]:
    """Per case saved in ``folder``: both trees' errors against the reference and against each other."""
    rows = []
    for name in sorted(os.listdir(folder)):
        if not name.startswith("ref_"):
            continue
        case = name[len("ref_"):-len(".pt")]
        ref = torch.load(os.path.join(folder, name)).double()
        out_a = torch.load(os.path.join(folder, f"{a}_{case}.pt")).double()
        out_b = torch.load(os.path.join(folder, f"{b}_{case}.pt")).double()
        err_a, err_b, diff = (out_a - ref).abs(), (out_b - ref).abs(), (out_b - out_a).abs()
        rows.append({"case": case, f"{a}_max": err_a.max().item(), f"{a}_mean": err_a.mean().item(),
                     f"{b}_max": err_b.max().item(), f"{b}_mean": err_b.mean().item(),
                     "difference_max": diff.max().item(), "difference_mean": diff.mean().item(),
                     "reference_mean_abs": ref.abs().mean().item(), "identical": torch.equal(out_a, out_b)})
    return rows


def run_tree(tag: str, folder: str, t: int) -> None:
    from bench_prefill_variants import problems
    from bench_regression import HEAD_DIM

    from sglang_nvfp4.kernels import gluon_prefill
    from sglang_nvfp4.reference import sparse_prefill_reference

    os.makedirs(folder, exist_ok=True)
    print(f"{tag}: {gluon_prefill.__file__}", flush=True)
    for name, q, cache, ids, table, req, pos in problems(t, "cuda"):
        out = torch.full_like(q, float("nan"))
        gluon_prefill.launch(q, cache, ids, table, req, pos, 1.0, 1.0, HEAD_DIM**-0.5, out)
        torch.save(out.cpu(), os.path.join(folder, f"{tag}_{name}.pt"))
        reference = os.path.join(folder, f"ref_{name}.pt")
        if not os.path.exists(reference):
            want = sparse_prefill_reference(q, cache, ids, table, req, pos, 1.0, 1.0, HEAD_DIM**-0.5, mode="ideal")
            torch.save(want.cpu(), reference)
        print(f"  {name}: {'NaN in the output' if out.isnan().any() else 'saved'}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.compare is None:
        return run_tree(args.tag, args.dir, args.t)
    folder, a, b = args.compare
    rows = compare(folder, a, b)
    for r in rows:
        print(f"{r['case']}: |{a}-ref| max {r[f'{a}_max']:.3e} mean {r[f'{a}_mean']:.3e}; |{b}-ref| max "
              f"{r[f'{b}_max']:.3e} mean {r[f'{b}_mean']:.3e}; |{b}-{a}| max {r['difference_max']:.3e} mean "
              f"{r['difference_mean']:.3e}; reference mean |x| {r['reference_mean_abs']:.3e}; "
              f"identical {r['identical']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python bench/prefill_error.py --compare " + " ".join(args.compare), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
