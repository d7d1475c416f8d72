"""Run test modules again in child pytests with ``TRITON_INTERPRET=1`` (shared by the Triton test modules).

Interpreted mode must be chosen before triton is imported, and other test modules import triton
(through SGLang) in compiled mode, so interpreted kernels run in their own processes.

Each module declares its re-run when it is imported (:func:`register_module`); pytest imports every collected
module before the first test runs. The first module test that asks for its result (:func:`assert_module_passed`)
runs the children of every registered module, two at a time, and waits for all of them: the interpreter is
single-threaded Python, so one child left a core of CI's two idle for about five minutes, and children that
outlived that test slowed the server tests behind them (tried and reverted in ``439d892``).

A child runs numpy's BLAS and torch's OpenMP on one thread. The interpreter computes ``tl.dot`` with numpy's
matmul, and the OpenBLAS that numpy 2.4 ships (0.3.31) splits a product between threads by its shape: a row's
bits then depended on how many rows shared the product, and the batch-invariance tests failed on 2 cores (a
2.4e-4 difference). Those tests check the kernels' order of work, not the BLAS library's. One OpenMP thread per
child keeps two children from spinning on each other's cores."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_MODULES: dict[str, tuple[int, float, float]] = {}  # module file -> (tests the child must pass, timeout, run time in s)
CHILDREN_AT_ONCE = 2


def register_module(module_file: str, expected_passed: int, timeout: float, run_s: float) -> None:
    """Declare (at import) that ``module_file`` re-runs under the interpreter, where ``expected_passed``
    tests must pass within ``timeout`` seconds; ``run_s``: about how long its child takes (alone, one core),
    which orders the children. A no-op inside an interpreted child."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _MODULES[str(Path(module_file).resolve())] = (expected_passed, timeout, run_s)


def _run_child(module_file: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
                          cwd=Path(module_file).parent.parent, env=env, capture_output=True, text=True,
                          timeout=_MODULES[module_file][1])


@functools.cache
def _run_all() -> dict[str, subprocess.CompletedProcess]:
    """Every registered module's child run, the longest first (the two workers then finish close together: on
    2026-12-06 the children took about 122, 105, 50 and 40 s, which the former most-tests-first order ran as
    122 + 50 against 40 + 105 s)."""
    order = sorted(_MODULES, key=lambda m: -_MODULES[m][2])
    workers = max(1, min(CHILDREN_AT_ONCE, len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(order, pool.map(_run_child, order)))


def assert_module_passed(module_file: str) -> None:
    """Assert that the interpreted child run of ``module_file`` (registered) passed exactly its tests."""
    module_file = str(Path(module_file).resolve())
    expected_passed = _MODULES[module_file][0]
    proc = _run_all()[module_file]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.match(rf"{expected_passed} passed in ", summary), proc.stdout[-3000:]
