"""Summarize torch-profiler chrome traces of one_batch decode steps (``--profile --profile-stage decode``; see
``e2e_one_batch``): the periods between consecutive launches of the decode CUDA graph, with the GPU's busy time in
each and the host time before each launch (from the end of the previous step's last GPU work); then the GPU
time by kernel and the GPU's idle gaps over the whole trace (for a prefill trace, which has no graph launches, the
gaps show where the host held the GPU up), and the GPU time by class of kernel (``KERNEL_CLASSES``: what a prefill
spends outside attention).

    python bench/trace_summary.py TRACE.json.gz [TRACE.json.gz ...] [--functions NAME ...]

``--functions``: for traces with Python stacks, the total inclusive time and count of the Python events whose
names contain each NAME (e.g. ``prepare_for_decode``).

Works on traces with Python stacks (one_batch's own profiler) and without (``NVFP4_PROFILE_STACKS=0``). Python
tracing makes the host side several times slower than an untraced run: compare host times between traces taken
the same way, not with untraced step times.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import re
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# (class, pattern searched in the kernel's name); a kernel counts in the first class that matches.
# MiniMax-M3's in-tree path: its sparse attention (``_gqa_share_sparse_fwd``); its indexer's block scores (a
# flash-attention kernel over the index keys) and top-k count as selection.
KERNEL_CLASSES = (
    ("linear layers (cuBLAS nvjet GEMMs)", r"nvjet"),
    ("MoE", r"fused_moe|moe_sum_reduce|moe_align"),
    ("attention", r"PrefillWithKVCache|BatchPrefill|BatchDecode|_ws_prefill_kernel|_sparse_(prefill|decode)_kernel"
                  r"|_combine_splits|_gqa_share_sparse_fwd"),
    ("selection, planning, cache writes",
     r"_ws_proxy_scores|_key_scores|_select_scored|_select_kernel|_summarize|_plan_tiles|_predecode|_write_kv"
     r"|_write_fp8_index_keys|_topk_index|_flash_attn_fwd_with_block_score|store_kvcache|store_kv_index"),
    ("RMSNorm", r"RMSNorm"),
    ("activation, RoPE, q/k norms", r"act_and_mul|fused_rope|qknorm_rope"),
    ("other kernels and copies", r""),
)


def end_of(events) -> float:
    return max(e["ts"] + e["dur"] for e in events)


def summarize(path: str, functions: list[str]) -> None:
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    starts = [e["ts"] for e in gpu]
    launches = sorted(e["ts"] for e in events if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch")
    print(f"== {path}: {len(launches)} graph launches")
    for i, (a, b) in enumerate(zip(launches, launches[1:])):
        inside = gpu[bisect.bisect_left(starts, a):bisect.bisect_left(starts, b)]
        busy = sum(e["dur"] for e in inside)
        # the graph's work ends where the GPU next waits on the host for more than 20 us
        end = a
        for e in inside:
            if e["ts"] > end + 20 and end > a:
                break
            end = max(end, e["ts"] + e["dur"])
        print(f"launch {i} -> {i + 1}: period {(b - a) / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, "
              f"host before the next launch {(b - end) / 1e3:.3f} ms")
    if gpu:  # the GPU's idle gaps over the whole trace (a prefill has no graph launches: its host stalls show here)
        span = end_of(gpu) - gpu[0]["ts"]
        gaps = idle_gaps(gpu, longer_than_us=20)
        host = [e["ts"] for e in events if e.get("cat") not in GPU_CATS]
        if host:
            print(f"first GPU work {(gpu[0]['ts'] - min(host)) / 1e3:.3f} ms after the first host event, last GPU work "
                  f"ends {(end_of(events) - end_of(gpu)) / 1e3:.3f} ms before the trace's end")
        print(f"GPU span {span / 1e3:.3f} ms, busy {sum(e['dur'] for e in gpu) / 1e3:.3f} ms (overlaps counted twice), "
              f"{len(gaps)} idle gaps over 20 us: {sum(g[0] for g in gaps) / 1e3:.3f} ms; the longest:")
        for gap, after, then in sorted(gaps, reverse=True)[:8]:
            print(f"  {gap / 1e3:8.3f} ms after {after[:60]} before {then[:60]}")
    for name in functions:
        hits = [e["dur"] for e in events if e.get("cat") == "python_function" and name in e["name"]]
        print(f"Python {name}: {sum(hits) / 1e3:.3f} ms in {len(hits)} events")
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        by_kernel[e["name"][:100]][0] += 1
        by_kernel[e["name"][:100]][1] += e["dur"]
    print("GPU time by kernel (whole trace):")
    for name, (count, dur) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {dur / 1e3:8.3f} ms {count:4d}x  {name}")
    if gpu:
        print("GPU time by class (whole trace; the idle time is the span less the union of the GPU's busy intervals):")
        for name, ms in by_class(gpu).items():
            print(f"  {ms:8.3f} ms  {name}")


def idle_gaps(gpu, longer_than_us: float = 0.0) -> list:
    """The stretches longer than ``longer_than_us`` in which the GPU ran nothing, between the first GPU event's start
    and the last one's end: ``(µs, name of the event whose end starts it, name of the event that ends it)``. ``gpu``: a
    non-empty list of Chrome-trace ``"X"`` events, in any order."""
    ordered = sorted(gpu, key=lambda e: e["ts"])
    gaps, end, before = [], ordered[0]["ts"], ordered[0]["name"]
    for e in ordered:
        if e["ts"] > end + longer_than_us:
            gaps.append((e["ts"] - end, before, e["name"]))
        if e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e["name"]
    return gaps


def by_class(gpu) -> dict:
    """ms of GPU work per ``KERNEL_CLASSES`` class, then ``"GPU idle"``: the span from the first GPU event's start to
    the last one's end, less the union of their intervals (every :func:`idle_gaps`). ``gpu``: a non-empty list of
    Chrome-trace ``"X"`` events (``name``, ``ts`` and ``dur`` in µs), in any order."""
    totals = dict.fromkeys([name for name, _ in KERNEL_CLASSES], 0.0)
    for e in gpu:
        totals[next(name for name, pattern in KERNEL_CLASSES if re.search(pattern, e["name"]))] += e["dur"] / 1e3
    totals["GPU idle"] = sum(gap for gap, _, _ in idle_gaps(gpu)) / 1e3
    return totals


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--functions") if "--functions" in args else len(args)
    for p in args[:cut]:
        summarize(p, args[cut + 1:])
