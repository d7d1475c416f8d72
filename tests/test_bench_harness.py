"""``bench/harness.py``'s :class:`BenchRun` on the CPU: what every end-to-end result file opens with."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from harness import BenchRun  # noqa: E402


def test_results_record_the_backends_environment(tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith("NVFP4_SPARSE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NVFP4_SPARSE_PREDECODE", "off")
    monkeypatch.setenv("NVFP4_SPARSE_TOPK", "32")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    bench = BenchRun(str(tmp_path), "e2e.json", 60)
    bench.save()
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["env"] == {"NVFP4_SPARSE_PREDECODE": "off", "NVFP4_SPARSE_TOPK": "32"}
    assert saved["budget_s"] == 60 and saved["argv"] == sys.argv
