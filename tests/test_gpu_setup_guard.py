"""``bench/gpu_setup.sh``'s ``NVFP4_REQUIRE_GPU`` guard, on the CPU with a stand-in ``nvidia-smi``: a device call
that got another GPU than the one its figures are for stops before unpacking the bundle, and one that got the right
GPU (or asked for none) goes on."""

import os
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "bench" / "gpu_setup.sh"


def _source_setup(tmp_path, gpu_name, require):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{gpu_name}'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "LC_ALL": "C"}
    env.pop("NVFP4_REQUIRE_GPU", None)
    if require is not None:
        env["NVFP4_REQUIRE_GPU"] = require
    # The working directory has no .gpu bundle: past the guard, the setup stops at the bundle's stat.
    return subprocess.run(["bash", "-c", f"source {SETUP}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def test_another_gpu_stops_the_call_before_the_bundle(tmp_path):
    done = _source_setup(tmp_path, "NVIDIA H100 80GB HBM3", "H200")
    assert done.returncode != 0
    assert "NVFP4_REQUIRE_GPU=H200 but this GPU is 'NVIDIA H100 80GB HBM3': nothing run" in done.stdout
    assert "nothing run" in (tmp_path / "out" / "log.txt").read_text()
    assert "cannot stat" not in done.stderr  # stopped before looking for the bundle


def test_the_required_gpu_or_none_required_goes_on_to_the_bundle(tmp_path):
    for i, (name, require) in enumerate([("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", None)]):
        case = tmp_path / str(i)
        case.mkdir()
        done = _source_setup(case, name, require)
        assert "nothing run" not in done.stdout
        assert "cannot stat" in done.stderr and ".gpu/site.tar.xz" in done.stderr  # the next step: the bundle
