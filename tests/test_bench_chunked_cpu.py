"""bench/e2e_chunked.py (the ``chunked`` step of bench_e2e and bench_m3) against a real SGLang server on CPU: a prompt
cut into chunks by ``--chunked-prefill-size``, fresh prompts that never hit the radix cache, the same prompts for every
variant, and the records the GPU runs rely on."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

pytest.importorskip("sglang.srt")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import e2e_chunked  # noqa: E402
from harness import BenchRun  # noqa: E402

from sglang_nvfp4.tiny_model import make_tiny_model  # noqa: E402


def test_variants_run_ours_with_and_without_predecoding_then_the_others():
    assert e2e_chunked.variants(["triton", "nvfp4_sparse"]) == [
        ("triton", "triton", {}),
        ("nvfp4_sparse_predecode_auto", "nvfp4_sparse", {"NVFP4_SPARSE_PREDECODE": "auto"}),
        ("nvfp4_sparse_predecode_off", "nvfp4_sparse", {"NVFP4_SPARSE_PREDECODE": "off"}),
    ]


def test_prompts_are_fixed_per_length_and_index_and_stay_inside_the_vocabulary():
    assert e2e_chunked.prompt_ids(300, 1, 32000) == e2e_chunked.prompt_ids(300, 1, 32000)
    assert e2e_chunked.prompt_ids(300, 0, 32000) != e2e_chunked.prompt_ids(300, 1, 32000)
    ids = e2e_chunked.prompt_ids(3000, 2, 32000)
    assert len(ids) == 3000 and 0 < min(ids) and max(ids) == e2e_chunked.TOKEN_ID_LIMIT - 1
    assert max(e2e_chunked.prompt_ids(3000, 2, 512)) == 511  # a small vocabulary bounds them


def test_agreement_counts_same_first_tokens_over_the_prompts_both_answered():
    def rows(tokens):
        return {"requests": [{"input_len": 8, "index": i, "first_token": t} for i, t in enumerate(tokens)]}

    by_label = {"a": rows([5, 6, 7]), "b": rows([5, 9]), "c": {"error": "x", "requests": []}}
    assert e2e_chunked.agreement(by_label) == {"a vs b": {"same": 1, "prompts": 2}}


def test_summary_averages_the_timed_requests_and_keeps_the_first_requests_memory():
    rows = [{"input_len": 8, "index": 0, "timed": False, "seconds": 9.0, "memory_peak_bytes": 700},
            {"input_len": 8, "index": 1, "timed": True, "seconds": 1.0, "memory_peak_bytes": 0},
            {"input_len": 8, "index": 2, "timed": True, "seconds": 2.0, "memory_peak_bytes": 0}]
    assert e2e_chunked.summarize({"a": {"requests": rows}, "b": {"skipped": "budget"}}) == {
        "a": {"8": {"mean_seconds": 1.5, "first_request_memory_peak_bytes": 700}}}


def test_memory_peak_is_the_most_above_the_level_at_entry_and_samples_at_exit():
    readings = iter([1000, 1400, 1900])  # at entry; then every later sample (the poll's and the exit's) sees 1900

    def read_used():
        return next(readings, 1900)

    with e2e_chunked.MemoryPeak(read_used, period=60.0) as memory:  # the poll's first sample waits 60 s
        pass
    assert memory.peak == 400  # the exit's sample: 1400 - 1000
    with e2e_chunked.MemoryPeak(None) as memory:
        pass
    assert memory.peak is None


def test_a_chunked_prefill_through_a_cpu_server(tmp_path):
    bench = BenchRun(str(tmp_path), "e2e.json", budget_s=900)
    model = make_tiny_model(str(tmp_path / "tiny"), kv_heads=1, layers=2)
    e2e_chunked.run_step(bench, ["nvfp4_sparse"], model, [640], chunk=256, repeats=1,
                         extra_args=["--max-total-tokens", "65536"], chosen={"nvfp4_sparse_predecode_auto"})
    saved = json.load(open(tmp_path / "e2e.json"))["chunked"]
    assert saved["chunked_prefill_size"] == 256 and saved["agreement"] == {}
    assert saved["summary"]["nvfp4_sparse_predecode_auto"]["640"]["mean_seconds"] > 0
    entry = saved["variants"]["nvfp4_sparse_predecode_auto"]
    assert "error" not in entry, entry.get("error")
    assert entry["env"] == {"NVFP4_SPARSE_PREDECODE": "auto"}
    requests = entry["requests"]
    assert [(r["index"], r["timed"]) for r in requests] == [(0, False), (1, True)]
    for r in requests:
        assert r["prompt_tokens"] == 640 and r["cached_tokens"] == 0  # fresh prompts: no radix hit
        assert isinstance(r["first_token"], int) and r["first_logprob"] <= 0 and r["seconds"] > 0
        assert r["memory_peak_bytes"] is None  # no NVML or GPU here
    # Each prompt went in as chunks of 256 new tokens (256, 256, 128), not as one forward.
    log = open(tmp_path / "chunked_nvfp4_sparse_predecode_auto.log").read()
    chunks = [int(n) for n in re.findall(r"Prefill batch.*?#new-token: (\d+)", log)]
    assert chunks.count(256) >= 4 and 640 not in chunks, chunks
