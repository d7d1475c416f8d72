"""What the Gluon kernels take on sm_90, compiled on any host (no GPU needed): shared memory, registers and stack
(spills) per thread, and the wgmma (``QGMMA`` fp8, ``HGMMA`` fp16) and ``WARPGROUP.DEPBAR`` of their SASS.

    python bench/gluon_resources.py [--kernel proxy] [--groups 16 3 1]
    python bench/gluon_resources.py --kernel prefill [--producer-warps 4 8]

``proxy`` compiles ``gluon_proxy._ws_proxy_scores_kernel`` as ``tests/test_gluon_proxy.py`` does (pointers 16-byte
aligned, ``MAX_BLOCKS_PER_PROGRAM`` blocks per program, the default ``SUBTILES``), one line per ``--groups`` value;
``prefill`` compiles ``gluon_prefill._ws_prefill_kernel`` as ``tests/test_gluon_prefill.py`` does (64/4 heads, 32 ids
per token), one line per ``--producer-warps`` value (``REGISTER_PLANS``). The Triton on ``sys.path`` compiles: CI's,
or the GPU host's with ``PYTHONPATH=.venv/gpu-host-triton:.``. The cubin is read with the ``cuobjdump`` that Triton
bundles.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


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
    """``(label, kernel, signature, constexprs, maxnreg)`` per line of output."""
    import triton

    tests = Path(__file__).resolve().parent.parent / "tests"
    sys.path.insert(0, str(tests))
    if args.kernel == "proxy":
        from test_gluon_proxy import _signature

        from sglang_nvfp4.kernels import gluon_proxy

        for groups in args.groups:
            constexprs = {"HKV": 4, "HEADS": groups, "HP": triton.next_power_of_2(groups),
                          "TOKENS": gluon_proxy.tokens_per_subtile(groups),
                          "BLOCKS": gluon_proxy.MAX_BLOCKS_PER_PROGRAM, "SUBTILES": gluon_proxy.SUBTILES}
            yield (f"proxy, {groups} groups, {gluon_proxy.SUBTILES} subtiles", gluon_proxy._ws_proxy_scores_kernel,
                   _signature(), constexprs, gluon_proxy.MAX_REGS)
    else:
        from test_gluon_prefill import _signature

        from sglang_nvfp4.kernels import gluon_prefill

        tokens = gluon_prefill.tokens_per_consumer(16)
        for warps in args.producer_warps:
            max_regs, consumer_regs, producer_regs = gluon_prefill.REGISTER_PLANS[warps]
            constexprs = {"HKV": 4, "GROUP": 16, "GROUP_POW2": 16, "TOKENS": tokens, "WIDTH": 2 * tokens * 32,
                          "K_SCALE_BY_POINTER": False, "V_SCALE_BY_POINTER": False, "PRODUCER_WARPS": warps,
                          "CONSUMER_REGS": consumer_regs, "PRODUCER_REGS": producer_regs}
            yield (f"prefill, 64/4, {warps} producer warps ({consumer_regs} / {producer_regs} registers)",
                   gluon_prefill._ws_prefill_kernel, _signature(False), constexprs, max_regs)


def main(argv=None):
    args = parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    print(f"triton {triton.__version__}")
    for label, kernel, signature, constexprs, max_regs in _compiled_variants(args):
        attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
        compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "maxnreg": max_regs})
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "kernel.cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
        print(f"{label}: shared {compiled.metadata.shared} B, registers {regs} at launch, stack {stack} B, "
              f"LDL {sass.count('LDL')}, STL {sass.count('STL')}, QGMMA {sass.count('QGMMA')}, "
              f"HGMMA {sass.count('HGMMA')}, WARPGROUP.DEPBAR {sass.count('WARPGROUP.DEPBAR')}")


if __name__ == "__main__":
    main()
