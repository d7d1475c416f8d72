"""What the Gluon kernels take on sm_90, compiled on any host (no GPU needed): shared memory, registers and stack
(spills) per thread, and the wgmma (``QGMMA`` fp8, ``HGMMA`` fp16) and ``WARPGROUP.DEPBAR`` of their SASS.

    python bench/gluon_resources.py [--kernel proxy] [--groups 16 3 1]
    python bench/gluon_resources.py --kernel prefill [--producer-warps 4 8]

``proxy`` compiles ``gluon_proxy._ws_proxy_scores_kernel`` with ``tests/test_gluon_proxy.py``'s ``compile_sm90``
(``MAX_BLOCKS_PER_PROGRAM`` blocks per program, the default ``SUBTILES``), one line per ``--groups`` value;
``prefill`` compiles ``gluon_prefill._ws_prefill_kernel`` with ``tests/test_gluon_prefill.py``'s ``compile_sm90`` (64/4
heads, 32 ids per token), one line per ``--producer-warps`` value (``REGISTER_PLANS``). The Triton on ``sys.path`` compiles: CI's,
or the GPU host's with ``PYTHONPATH=.venv/gpu-host-triton:.``. The cubin is read with the ``cuobjdump`` that Triton
bundles (``tests/gluon_compile.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=["proxy", "prefill"], default="proxy")
    parser.add_argument("--groups", type=int, nargs="+", default=[16, 3, 1],
                        help="proxy: query groups per KV head (1-16)")
    parser.add_argument("--producer-warps", type=int, nargs="+", default=[4, 8], choices=[4, 8],
                        help="prefill: producer warps")
    args = parser.parse_args(argv)
    if not all(1 <= g <= 16 for g in args.groups):
        parser.error(f"--groups: 1 to 16 each, got {args.groups}")
    return args


def _compiled_variants(args):
    """``(label, compiled kernel)`` per line of output, compiled by the tests' own helpers."""
    if args.kernel == "proxy":
        from test_gluon_proxy import compile_sm90

        from sglang_nvfp4.kernels import gluon_proxy

        for groups in args.groups:
            yield (f"proxy, {groups} groups, {gluon_proxy.SUBTILES} subtiles",
                   compile_sm90(groups, gluon_proxy.SUBTILES))
    else:
        from test_gluon_prefill import compile_sm90

        from sglang_nvfp4.kernels import gluon_prefill

        for warps in args.producer_warps:
            _, consumer_regs, producer_regs = gluon_prefill.REGISTER_PLANS[warps]
            yield (f"prefill, 64/4, {warps} producer warps ({consumer_regs} / {producer_regs} registers)",
                   compile_sm90(16, 32, False, warps))


def main(argv=None):
    args = parse_args(argv)
    import triton
    from gluon_compile import cuobjdump, registers_and_stack

    print(f"triton {triton.__version__}")
    for label, compiled in _compiled_variants(args):
        regs, stack = registers_and_stack(compiled)
        sass = cuobjdump(compiled, "-sass")
        print(f"{label}: shared {compiled.metadata.shared} B, registers {regs} at launch, stack {stack} B, "
              f"LDL {sass.count('LDL')}, STL {sass.count('STL')}, QGMMA {sass.count('QGMMA')}, "
              f"HGMMA {sass.count('HGMMA')}, WARPGROUP.DEPBAR {sass.count('WARPGROUP.DEPBAR')}")


if __name__ == "__main__":
    main()
