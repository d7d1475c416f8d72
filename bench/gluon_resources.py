"""What the Gluon fp8 proxy score kernel takes on sm_90, compiled on any host (no GPU needed): shared memory,
registers and stack (spills) per thread, and the fp8 wgmma (``QGMMA``) and ``WARPGROUP.DEPBAR`` of its SASS.

    python bench/gluon_resources.py [--groups 16 3 1]

It compiles ``gluon_proxy._ws_proxy_scores_kernel`` as ``tests/test_gluon_proxy.py`` does (pointers 16-byte aligned,
``MAX_BLOCKS_PER_PROGRAM`` blocks per program) with the Triton on ``sys.path``: CI's, or the GPU host's with
``PYTHONPATH=.venv/gpu-host-triton:.``. It reads the cubin with the ``cuobjdump`` that Triton bundles. One line per
``--groups`` value.
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
    parser.add_argument("--groups", type=int, nargs="+", default=[16, 3, 1], help="query groups per KV head (1-16)")
    args = parser.parse_args(argv)
    if not all(1 <= g <= 16 for g in args.groups):
        parser.error(f"--groups: 1 to 16 each, got {args.groups}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_gluon_proxy import _signature

    from sglang_nvfp4.kernels import gluon_proxy

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    print(f"triton {triton.__version__}")
    for groups in args.groups:
        signature = _signature()
        constexprs = {"HKV": 4, "HEADS": groups, "HP": triton.next_power_of_2(groups),
                      "TOKENS": gluon_proxy.tokens_per_subtile(groups), "BLOCKS": gluon_proxy.MAX_BLOCKS_PER_PROGRAM,
                      "SUBTILES": gluon_proxy.SUBTILES}
        attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
        compiled = triton.compile(GluonASTSource(gluon_proxy._ws_proxy_scores_kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "maxnreg": gluon_proxy.MAX_REGS})
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "kernel.cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
        print(f"groups {groups}: shared {compiled.metadata.shared} B, registers {regs}, stack {stack} B, "
              f"QGMMA {sass.count('QGMMA')}, WARPGROUP.DEPBAR {sass.count('WARPGROUP.DEPBAR')}")


if __name__ == "__main__":
    main()
