"""Summarize torch-profiler chrome traces of one_batch decode steps (``--profile --profile-stage decode``; see
``e2e_one_batch``): per traced step, its wall time, the GPU's busy time, and when the host launched the decode
CUDA graph; then GPU kernel time by kernel over all traced steps.

    python bench/trace_summary.py TRACE.json.gz [TRACE.json.gz ...]

A step is one ``sglang/benchmark/one_batch.py(...): decode`` Python event (the trace must hold Python stacks,
as one_batch's profiler records them). GPU busy time counts the kernels, copies and memsets that start within
the step. The Python tracing makes the host side several times slower than an untraced run. Compare host
phases between traces, not with untimed figures.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize(path: str) -> None:
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("sglang/benchmark/one_batch.py(")
                    and e["name"].endswith(": decode") and e.get("cat") == "python_function"),
                   key=lambda e: e["ts"])
    # one_batch's decode() wraps model_runner.decode(); keep the outer event of each nested pair
    steps = [s for i, s in enumerate(steps) if not (i and s["ts"] < steps[i - 1]["ts"] + steps[i - 1]["dur"])]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"]
    print(f"== {path}: {len(steps)} traced decode steps")
    for i, s in enumerate(steps):
        end = s["ts"] + s["dur"]
        busy = sum(e["dur"] for e in gpu if s["ts"] <= e["ts"] < end)
        graph = [e["ts"] - s["ts"] for e in launches if s["ts"] <= e["ts"] < end]
        print(f"step {i}: wall {s['dur'] / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, graph launched at "
              f"{graph[0] / 1e3 if graph else float('nan'):.3f} ms")
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        by_kernel[e["name"][:100]][0] += 1
        by_kernel[e["name"][:100]][1] += e["dur"]
    print("GPU time by kernel (all traced steps):")
    for name, (count, dur) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {dur / 1e3:8.3f} ms {count:4d}x  {name}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
