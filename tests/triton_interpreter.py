"""Run a test module again in a child pytest with ``TRITON_INTERPRET=1`` (shared by the Triton test modules).

Interpreted mode must be chosen before triton is imported, and other test modules import triton
(through SGLang) in compiled mode, so interpreted kernels run in their own process.

The child runs numpy's BLAS on one thread. The interpreter computes ``tl.dot`` with numpy's matmul, and the
OpenBLAS that numpy 2.4 ships (0.3.31) splits a product between threads by its shape: a row's bits then
depended on how many rows shared the product, and the batch-invariance tests failed on 2 cores (a 2.4e-4
difference). Those tests check the kernels' order of work, not the BLAS library's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def run_module_interpreted(module_file: str, expected_passed: int, timeout: float) -> None:
    """Assert the child run of ``module_file`` passes exactly ``expected_passed`` tests."""
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
                          cwd=Path(module_file).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.match(rf"{expected_passed} passed in ", summary), proc.stdout[-3000:]
