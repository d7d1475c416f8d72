"""``make demo`` (``python -m sglang_nvfp4.demo``), the README's main job, end to end on CPU: the committed
trained retrieval model served twice with ``nvfp4_sparse`` (every block; the default top-32), questions on
3-6K-token prompts, a radix-cache hit, the KV capacity, and two clean SIGTERM stops (exit code 0; SGLang
SIGKILLed itself, exit code -9, when its whole process group got the SIGTERM)."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt")

from sglang_nvfp4.sglang.config import DEFAULT_TOPK  # noqa: E402


def test_demo_answers_from_the_nvfp4_cache_and_stops_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sglang_nvfp4.demo", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "all blocks: 7 of 7 right" in out, out  # NVFP4 storage alone keeps every answer
    right = int(re.search(rf"top-{DEFAULT_TOPK}: (\d) of 7 right", out)[1])
    assert right >= 6, out  # top-16 had 5 of 7 on 2026-12-01 (two mid-depth records missed)
    cached = int(re.search(r"(\d+) of 3072 tokens came from the radix cache", out)[1])
    assert cached >= 23 * 128, out  # every whole page of the document
    assert re.search(r"KV capacity: [\d,]+ tokens in NVFP4 where a bf16 cache .* \(3\.\d+x\)", out), out
    assert f"exit codes {{'all blocks': 0, 'top-{DEFAULT_TOPK}': 0}}" in out, out
