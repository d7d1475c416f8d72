"""The Gluon kernels compiled for sm_90 on any host, as their launches compile them (Gluon has no interpreter: this is
their CPU twin), and what the compiled kernel takes. Used by ``tests/test_gluon_{prefill,proxy,decode}.py`` and
``bench/gluon_resources.py``; the Triton on ``sys.path`` compiles (CI's, or the GPU host's with
``PYTHONPATH=.venv/gpu-host-triton:.``)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton


def compile_for_hopper(kernel, signature: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None):
    """``kernel`` (a ``gluon.jit`` function) compiled for sm_90 with its pointer arguments 16-byte aligned, as the
    JIT specializes them for torch allocations (the alignment decides which loads are vectorized)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_triton_for_hopper(kernel, signature: dict, constexprs: dict, options: dict, divisible=None):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90; ``divisible``: the arguments a launch specializes as
    16-divisible (default: the pointers, as torch allocations are; sizes too where the caller passes them)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if divisible is None:
        divisible = [name for name, kind in signature.items() if kind.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in divisible}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def cuobjdump(compiled, flag: str) -> str:
    """The output of the ``cuobjdump`` that Triton bundles, with ``flag`` (``-res-usage``, ``-sass``), on the cubin of
    ``compiled``."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True, check=True).stdout


def registers_and_stack(compiled) -> tuple[int, int]:
    """Registers per thread at launch and bytes of stack per thread (spilled registers) of ``compiled``."""
    usage = cuobjdump(compiled, "-res-usage")
    return tuple(int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
