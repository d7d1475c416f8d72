"""The probe patches of ``bench/experiments/`` (``README.md``, "Probes") still apply to main's kernels: a device
session applies them to a copy of ``sglang_nvfp4`` and measures, so a probe that no longer applies would be found
only there, at the price of device time."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBES = sorted((ROOT / "bench" / "experiments").glob("*_probe.patch"))


def test_every_probe_is_listed():
    listed = (ROOT / "bench" / "experiments" / "README.md").read_text()
    assert PROBES and all(f"`{p.name}`" in listed for p in PROBES), [p.name for p in PROBES]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.stem)
def test_probe_applies_to_main(probe, tmp_path):
    shutil.copytree(ROOT / "sglang_nvfp4", tmp_path / "sglang_nvfp4")
    run = subprocess.run(["git", "apply", "--check", str(probe)], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
