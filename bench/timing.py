"""Timing of GPU work for the bench scripts: medians of ``triton.testing.do_bench`` (device events, L2
flushed between runs), eagerly or as CUDA-graph replays. Imports nothing of ``sglang_nvfp4``, so a script
that measures another source tree of the package (``bench_regression.py``) can use it too."""

from __future__ import annotations


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph (no launch gaps, no Python): ``fn`` runs
    once untimed first (compilation, autotuning), then is captured."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)
