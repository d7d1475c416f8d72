"""Run a test module again in a child pytest with ``TRITON_INTERPRET=1`` (shared by the Triton test modules).

Interpreted mode must be chosen before triton is imported, and other test modules import triton
(through SGLang) in compiled mode, so interpreted kernels run in their own process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def run_module_interpreted(module_file: str, expected_passed: int, timeout: float) -> None:
    """Assert the child run of ``module_file`` passes exactly ``expected_passed`` tests."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
                          cwd=Path(module_file).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.match(rf"{expected_passed} passed in ", summary), proc.stdout[-3000:]
