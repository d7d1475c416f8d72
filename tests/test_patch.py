"""patches/: the in-tree variant applies cleanly to the installed SGLang 0.5.23 and, with the plugin
disabled, the patched tree alone selects and configures ``nvfp4_sparse``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sglang = pytest.importorskip("sglang")

PATCH = Path(__file__).resolve().parents[1] / "patches" / "sglang-0.5.23-nvfp4-sparse.patch"
SITE = Path(sglang.__file__).resolve().parents[1]


def test_patch_applies_cleanly_to_installed_sglang():
    assert sglang.__version__ == "0.5.23"
    run = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(SITE), "-i", str(PATCH)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAILED" not in run.stdout and "fuzz" not in run.stdout


def test_patched_tree_selects_the_backend_without_the_plugin(tmp_path):
    tree = tmp_path / "site"
    shutil.copytree(SITE / "sglang", tree / "sglang", ignore=shutil.ignore_patterns("__pycache__", "multimodal_gen", "test"))
    run = subprocess.run(["patch", "-p1", "-d", str(tree), "-i", str(PATCH)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    model = tmp_path / "model"
    from sglang_nvfp4.tiny_model import make_tiny_model

    make_tiny_model(str(model))
    probe = f"""
import sglang, sglang_nvfp4.sglang.plugin as plugin
from sglang.srt.plugins import load_plugins
load_plugins()
assert sglang.__file__.startswith({str(tree)!r}), sglang.__file__
assert not plugin._registered, "the plugin ran; this test is about the patched tree alone"
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.overrides import resolved_view
assert "nvfp4_sparse" in ATTENTION_BACKEND_CHOICES and "nvfp4_sparse" in ATTENTION_BACKENDS
args = prepare_server_args(["--model-path", {str(model)!r}, "--device", "cpu", "--attention-backend", "nvfp4_sparse"])
args.resolve_once()
print("PAGE_SIZE", resolved_view(args).page_size)
"""
    env = {**os.environ, "PYTHONPATH": str(tree), "SGLANG_PLUGINS": "none-selected"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "PAGE_SIZE 128" in run.stdout
