"""How fast Hopper's wgmma runs the products of a sparse-prefill consumer, by their width N, on one GPU: the rate of
``m64 x N x k128`` fp16 products (fp32 accumulators, operands in shared memory), each issued and waited for as the
Gluon prefill's consumers do (``warpgroup_mma`` without ``is_async``), by ``--ctas-per-sm`` one-warpgroup CTAs per
multiprocessor.

    python bench/bench_wgmma_shapes.py --out DIR/wgmma.json [--n 16 32 64 128] [--ctas-per-sm 1 2 3] [--iters 512]

Why. The prefill's consumers alone (no decoding, ``bench/results/consumers_alone_h100.json``) take 77-87% of the
kernel's time, in proportion to the union pages they visit: each visit runs ``S = Q.K^T`` and ``O += P.V`` over 64
rows (4 tokens x 16 query heads at 64/4) whichever of the 4 tokens selected the page. A consumer that worked per
(page, token) instead, ``S^T = K.Q_t^T`` and ``O_t^T += V^T.P_t^T`` with the 16 heads of one token as N, would run
only the selected rows: 4 products of ``m64 x 16 x k128`` per selection instead of 2 of ``m64 x 128 x k128`` per
page and 4 tokens. It pays off only if a narrow product costs little more than its share of the work; this script
measures that share. It measures the products only, not the softmax or the hand-offs around them.

Each CTA runs ``--iters`` products ``acc += A.B`` (A ``[64, 128]``, B ``[128, N]``, both in NVMMA shared layouts, B
K-major as the consumers' ``K^T`` and ``V^T`` views are) on one accumulator; the grid is the multiprocessor count
times ``--ctas-per-sm``. Reported: µs per launch (median of ``triton.testing.do_bench`` after an untimed run),
TFLOP/s, and ns per product and multiprocessor.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from timing import bench_ms

ROWS = gl.constexpr(64)  # wgmma's M per warpgroup
DEPTH = gl.constexpr(128)  # k: head_dim for S = Q.K^T, a page's keys for O += P.V


@gluon.jit
def _products_kernel(out_ptr, iters, N: gl.constexpr):
    """``iters`` products ``acc += A.B`` of one warpgroup; A and B hold 1/64 (exact in fp16), so ``acc`` ends at
    ``iters * DEPTH / 4096`` everywhere and is stored (``out_ptr``: fp32 ``[grid, 64, N]``) to keep the loop."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, DEPTH], gl.float16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, DEPTH], gl.float16)
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    a = gl.allocate_shared_memory(gl.float16, [ROWS, DEPTH], a_layout,
                                  gl.full([ROWS, DEPTH], 1.0 / 64, gl.float16, fill))
    b = gl.allocate_shared_memory(gl.float16, [N, DEPTH], b_layout, gl.full([N, DEPTH], 1.0 / 64, gl.float16, fill))
    fence_async_shared()  # the generic-proxy stores above before wgmma's reads (without it, wrong sums were seen)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    acc = gl.zeros([ROWS, N], gl.float32, mma)
    for _ in range(iters):
        acc = warpgroup_mma(a, b.permute((1, 0)), acc)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))[:, None]
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, mma))[None, :]
    gl.store(out_ptr + gl.program_id(0) * ROWS * N + rows * N + cols, acc)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--n", type=int, nargs="+", default=[16, 32, 64, 128], help="product widths (N)")
    parser.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--iters", type=int, default=512, help="products per CTA")
    args = parser.parse_args(argv)
    if any(n % 16 or not 16 <= n <= 256 for n in args.n):
        parser.error(f"--n: multiples of 16 in [16, 256], got {args.n}")
    if any(c < 1 for c in args.ctas_per_sm) or args.iters < 1:
        parser.error("--ctas-per-sm and --iters: positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n in args.n:
        for per_sm in args.ctas_per_sm:
            grid = sms * per_sm
            out = torch.full((grid, ROWS.value, n), float("nan"), device="cuda")

            def run():
                _products_kernel[(grid,)](out, args.iters, N=n, num_warps=4)

            run()
            wrong = out != args.iters * DEPTH.value / 4096
            first_wrong = float(out[wrong][0]) if wrong.any() else None
            ms = bench_ms(run)
            flops = 2.0 * ROWS.value * n * DEPTH.value * args.iters * grid
            row = {"n": n, "ctas_per_sm": per_sm, "iters": args.iters, "us": 1000 * ms,
                   "tflops": flops / ms / 1e9, "ns_per_product_per_sm": 1e6 * ms / (args.iters * per_sm),
                   "wrong_values": int(wrong.sum()), "ctas_with_wrong_values": int(wrong.flatten(1).any(1).sum()),
                   "first_wrong_value": first_wrong}
            rows.append(row)
            print(f"  N={n:3d} ctas/SM={per_sm}: {row['us']:8.1f} us  {row['tflops']:6.1f} TF/s  "
                  f"{row['ns_per_product_per_sm']:6.2f} ns per product per SM; wrong values {row['wrong_values']} in "
                  f"{row['ctas_with_wrong_values']} CTAs (first {row['first_wrong_value']})", flush=True)
    record = {"command": "python bench/bench_wgmma_shapes.py " + " ".join(argv or []),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "multiprocessors": sms, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
