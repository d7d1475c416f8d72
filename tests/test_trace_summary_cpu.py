"""``bench/trace_summary.py``'s GPU time by class of kernel, on a hand-made trace listed out of order: the classes'
totals, the first matching class winning, and the idle time as the span less the union of the busy intervals
(overlapping, nested and touching ones)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import trace_summary  # noqa: E402


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


GPU = [  # ts and dur in us; listed out of order on purpose
    _kernel("_ws_prefill_kernel", 1500, 400),  # 500 us idle before it
    _kernel("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 0, 1000),
    _kernel("_ws_proxy_scores_kernel", 1800, 300),  # overlaps the previous one by 100 us
    _kernel("fused_moe_kernel", 1600, 100),  # inside the prefill kernel's interval
    _kernel("void flashinfer::norm::FusedAddRMSNormKernel<8u>", 2100, 50),
    _kernel("void at::native::vectorized_gather_kernel<16, long>", 2400, 100),  # 250 us idle before it
    _kernel("nvjet_with_a_fused_moe_epilogue", 2500, 20),  # matches two classes: the first (GEMMs) counts it
]


def test_gpu_time_by_class():
    totals = trace_summary.by_class(GPU)
    assert totals == pytest.approx({
        "linear layers (cuBLAS nvjet GEMMs)": 1.02, "MoE": 0.1, "attention": 0.4,
        "selection, planning, cache writes": 0.3, "RMSNorm": 0.05, "activation, RoPE, q/k norms": 0.0,
        "other kernels and copies": 0.1, "GPU idle": 0.75})


def test_summary_prints_the_classes(tmp_path, capsys):
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": GPU + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -10, "dur": 5}]}, f)
    trace_summary.summarize(str(trace), [])
    out = capsys.readouterr().out
    assert "0.400 ms  attention" in out and "0.750 ms  GPU idle" in out


def test_command_line_summarizes_each_trace(tmp_path):
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": GPU}, f)
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "trace_summary.py")
    out = subprocess.run([sys.executable, script, str(trace)], capture_output=True, text=True, check=True).stdout
    assert f"== {trace}" in out and "0.750 ms  GPU idle" in out
