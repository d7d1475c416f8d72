"""The Gluon kernels' CPU compile checks again, with the Triton of the H200 host (``requirements/gpu-host-triton.txt``,
installed by ``make venv`` into ``.venv/gpu-host-triton``) instead of CI's newer one.

Gluon's API moves between Triton releases (for one, 3.6's ``gl.thread_barrier`` is ``gl.barrier`` in 3.8): a kernel
that compiles only with CI's Triton would pass here and fail on the GPU, where each session has 30 minutes. The
checks run in a child pytest whose ``PYTHONPATH`` puts the host's Triton first; without it this test fails (run
``make venv``), it does not skip."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST_TRITON = Path(sys.prefix) / "gpu-host-triton"
PINNED = re.search(r"^triton==(\S+)", (ROOT / "requirements" / "gpu-host-triton.txt").read_text(), re.M).group(1)
COMPILE_CHECKS = ["tests/test_gluon_decode.py", "tests/test_gluon_prefill.py", "tests/test_gluon_proxy.py"]


def _child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOST_TRITON), str(ROOT), os.environ.get("PYTHONPATH", "")]))


def test_host_triton_is_installed_and_first_on_the_path():
    assert HOST_TRITON.is_dir(), f"{HOST_TRITON} missing: run `make venv`"
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=_child_env(),
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == PINNED


def test_gluon_compile_checks_pass_with_the_host_triton():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *COMPILE_CHECKS],
                           cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=900)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else child.stderr[-2000:]
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert re.search(r"\b\d+ passed", summary) and "failed" not in summary, summary
