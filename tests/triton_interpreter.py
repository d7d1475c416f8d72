"""Run a test module again in a child pytest with ``TRITON_INTERPRET=1`` (shared by the Triton test modules).

Interpreted mode must be chosen before triton is imported, and other test modules import triton
(through SGLang) in compiled mode, so interpreted kernels run in their own process.

The child runs numpy's BLAS on one thread. The interpreter computes ``tl.dot`` with numpy's matmul, and the
OpenBLAS that numpy 2.4 ships (0.3.31) splits a product between threads by its shape: a row's bits then
depended on how many rows shared the product, and the batch-invariance tests failed on 2 cores (a 2.4e-4
difference). Those tests check the kernels' order of work, not the BLAS library's.

The children are single-threaded and the main run only waits on them, which left one of CI's two cores idle for
about 6 minutes. So ``tests/conftest.py`` starts them in the background, one at a time, as soon as the tests are
collected (:func:`start_interpreted_runs`); :func:`run_module_interpreted` then takes the finished (or running)
child's result, and runs the child itself when none was started (a single module run by hand)."""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

BACKGROUND_TIMEOUT_S = 1500  # per child started in the background (the tests' own timeouts are at most 1200 s)
_results: dict[str, dict] = {}  # module path -> {"done": Event, "returncode", "stdout", "stderr"}
_running: list[subprocess.Popen] = []  # the background child alive now, killed if the main run exits first


def _run_child(module_file: str, timeout: float) -> tuple[int, str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
                            cwd=Path(module_file).resolve().parent.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _running.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\n[timed out after {timeout} s]"
    finally:
        _running.remove(proc)
    return proc.returncode, stdout, stderr


def _kill_running() -> None:
    for proc in list(_running):
        proc.kill()


def start_interpreted_runs(module_files) -> None:
    """Start the interpreted children of ``module_files`` (paths, in the order the tests will need them) in a
    background thread, one after another."""
    todo = [str(Path(f).resolve()) for f in module_files if str(Path(f).resolve()) not in _results]
    if not todo:
        return
    for key in todo:
        _results[key] = {"done": threading.Event()}

    def run_all():
        for key in todo:
            result = _results[key]
            try:
                result["returncode"], result["stdout"], result["stderr"] = _run_child(key, BACKGROUND_TIMEOUT_S)
            except Exception as exc:  # reported by the test that waits for this child
                result["returncode"], result["stdout"], result["stderr"] = -1, "", f"background run failed: {exc!r}"
            finally:
                result["done"].set()

    atexit.register(_kill_running)
    threading.Thread(target=run_all, name="triton-interpreter-runs", daemon=True).start()


def run_module_interpreted(module_file: str, expected_passed: int, timeout: float) -> None:
    """Assert the child run of ``module_file`` passes exactly ``expected_passed`` tests."""
    started = _results.get(str(Path(module_file).resolve()))
    if started is None:
        returncode, stdout, stderr = _run_child(module_file, timeout)
    else:
        started["done"].wait()  # the background run has its own timeout
        returncode, stdout, stderr = started["returncode"], started["stdout"], started["stderr"]
    assert returncode == 0, stdout[-6000:] + stderr[-3000:]
    summary = stdout.strip().splitlines()[-1]
    assert re.match(rf"{expected_passed} passed in ", summary), stdout[-3000:]
