"""``bench/bench_wgmma_shapes.py`` on the CPU: its kernel compiled for sm_90 (one wgmma shape per width, a wait after
each product, as the prefill's consumers run them) and its arguments, as rehearsed before a device call."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_wgmma_shapes  # noqa: E402
from gluon_compile import compile_for_hopper, cuobjdump  # noqa: E402


@pytest.mark.parametrize("n", [16, 128])
def test_products_compile_to_wgmma_of_their_width(n):
    compiled = compile_for_hopper(bench_wgmma_shapes._products_kernel, {"out_ptr": "*fp32", "iters": "i32"},
                                  {"N": n}, 4)
    sass = cuobjdump(compiled, "-sass")
    shapes = {word for word in sass.split() if word.startswith("HGMMA.")}
    assert shapes == {f"HGMMA.64x{n}x16.F32"}  # fp16 operands, fp32 accumulators, k-steps of 16
    assert sass.count("WARPGROUP.DEPBAR") >= sass.count("HGMMA") // 8  # each product of 8 k-steps waited for


def test_arguments_parse_and_bad_widths_are_refused(capsys):
    args = bench_wgmma_shapes.parse_args(["--out", "x.json", "--n", "16", "48", "--ctas-per-sm", "2"])
    assert args.n == [16, 48] and args.ctas_per_sm == [2] and args.iters == 512
    for bad in (["--n", "24"], ["--n", "0"], ["--n", "512"], ["--ctas-per-sm", "0"]):
        with pytest.raises(SystemExit):
            bench_wgmma_shapes.parse_args(["--out", "x.json", *bad])
    assert "--n: multiples of 16" in capsys.readouterr().err
