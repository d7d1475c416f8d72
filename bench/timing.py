"""Timing of GPU work for the bench scripts: medians of ``triton.testing.do_bench`` (device events, L2
flushed between runs), eagerly or as CUDA-graph replays; and the record of a run over one source tree (output
hashes, :func:`write_tree_record`). Imports nothing of ``sglang_nvfp4``, so a script that measures another source
tree of the package (``bench_regression.py``, ``bench_prefill_variants.py``, ``bench_decode_variants.py``) can use
it too."""

from __future__ import annotations

import datetime
import hashlib
import json


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


def output_hash(tensor) -> str:
    """The first 16 hex digits of the SHA-256 of ``tensor``'s bytes: equal hashes mean the same bits."""
    import torch

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def write_tree_record(path: str, script: str, argv, tree: str, rows: list, device: str = "cuda") -> None:
    """Writes one run's JSON record to ``path``: the command (``PYTHONPATH=TREE python bench/SCRIPT ARGV``), the
    measured tree (its ``sglang_nvfp4/__init__.py``), the GPU, the UTC date, torch's version and ``rows``."""
    import torch

    record = {
        "command": f"PYTHONPATH=TREE python bench/{script} " + " ".join(argv or []),
        "tree": tree,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
