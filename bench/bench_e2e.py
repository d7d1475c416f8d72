"""End-to-end SGLang 0.5.23 runs on a GPU host: ``nvfp4_sparse`` against dense ``triton``, same build,
same model config, same flags. Writes ``e2e.json`` (+ ``e2e.png``) and the raw logs under ``--out``.

Steps (``--steps``, default all):

* ``server``: a real server per backend on a tiny random-weight model (16 query / 1 KV head,
  head_dim 128; decode CUDA graphs on): 8 short prompts (<= 16 blocks, dense-equivalent: first greedy
  token and logprob agreement), one long prompt (more blocks than TOPK), two prompts sharing a
  prefix (radix hit), per-request latency.
* ``one_batch``: ``sglang.benchmark.one_batch`` through the plugin wrapper on a 64 query / 4 KV head,
  head_dim 128 config with ``--load-format dummy``: prefill latency/throughput and decode throughput
  for input lengths ``--input-lens`` at batch sizes ``--batch-sizes``, and ``max_total_num_tokens``
  (KV capacity) at the same ``--mem-fraction-static``.

``python bench/bench_e2e.py --out DIR`` (needs CUDA and SGLang; see bench/gpu_e2e.sh for the host set-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

from sglang_nvfp4.local_server import LocalServer
from sglang_nvfp4.tiny_model import make_tiny_model

BACKENDS = ("nvfp4_sparse", "triton")
WORDS = "the of and to in is was for on that with as by at from page block key value cache sparse".split()
COMMON_SERVER_ARGS = ["--page-size", "128", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.6"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def server_step(out_dir: str, backends=BACKENDS) -> dict:
    model = make_tiny_model(os.path.join(out_dir, "tiny"), kv_heads=1, layers=2)
    rng = random.Random(0)
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 1800))) for _ in range(8)]
    long_text = " ".join(rng.choice(WORDS) for _ in range(6000))
    prefix = " ".join(rng.choice(WORDS) for _ in range(2500))
    results = {}
    for backend in backends:
        log(f"server {backend}: starting")
        t0 = time.perf_counter()
        with LocalServer(model, backend, extra_args=COMMON_SERVER_ARGS, startup_timeout=240,
                         log_path=os.path.join(out_dir, f"server_{backend}.log")) as srv:
            startup = time.perf_counter() - t0
            rows = []
            for name, text in [*(("short", s) for s in short), ("long", long_text),
                               ("prefix_a", prefix + " key value"), ("prefix_b", prefix + " page block")]:
                t1 = time.perf_counter()
                r = srv.generate(text, max_new_tokens=16, return_logprob=True)
                meta = r["meta_info"]
                rows.append({"name": name, "latency_s": time.perf_counter() - t1, "prompt_tokens": meta["prompt_tokens"],
                             "cached_tokens": meta["cached_tokens"],
                             "tokens": [t[1] for t in meta["output_token_logprobs"]],
                             "logprobs": [t[0] for t in meta["output_token_logprobs"]]})
                log(f"  {backend} {name}: {meta['prompt_tokens']} tokens, cached {meta['cached_tokens']}, "
                    f"{rows[-1]['latency_s']:.3f} s")
            server_log = srv.log_tail(10_000_000)
        results[backend] = {"startup_s": startup, "requests": rows,
                            "decode_cuda_graph": "Capture cuda graph" in server_log or "capture" in server_log.lower()}
    if set(backends) != set(BACKENDS):
        return results
    ours, dense = results["nvfp4_sparse"]["requests"], results["triton"]["requests"]
    pairs = [(o, d) for o, d in zip(ours, dense) if o["name"] == "short"]
    results["agreement"] = {
        "short_first_token_equal": sum(o["tokens"][0] == d["tokens"][0] for o, d in pairs),
        "short_prompts": len(pairs),
        "short_first_logprob_abs_delta": [abs(o["logprobs"][0] - d["logprobs"][0]) for o, d in pairs],
        "short_all_tokens_equal": sum(o["tokens"] == d["tokens"] for o, d in pairs),
    }
    return results


def one_batch_step(out_dir: str, input_lens, batch_sizes, mem_fraction: float, backends=BACKENDS) -> dict:
    model = make_tiny_model(os.path.join(out_dir, "gqa64x4"), kv_heads=4, layers=4, hidden_size=4096,
                            context_len=131072, weights=False, vocab_size=32000)
    results = {}
    for backend in backends:
        jsonl = os.path.join(out_dir, f"one_batch_{backend}.jsonl")
        logfile = os.path.join(out_dir, f"one_batch_{backend}.log")
        cmd = [sys.executable, "-m", "sglang_nvfp4.bench_one_batch", "--model-path", model, "--load-format", "dummy",
               "--attention-backend", backend, "--page-size", "128", "--mem-fraction-static", str(mem_fraction),
               "--batch-size", *map(str, batch_sizes), "--input-len", *map(str, input_lens), "--output-len", "16",
               "--result-filename", jsonl, "--sampling-backend", "pytorch"]
        log(f"one_batch {backend}: {' '.join(cmd[2:])}")
        t0 = time.perf_counter()
        with open(logfile, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=240).returncode
        text = open(logfile).read()
        cap = re.findall(r"max_total_num_tokens=(\d+)", text)
        runs = [json.loads(line) for line in open(jsonl)] if os.path.exists(jsonl) else []
        results[backend] = {"returncode": rc, "wall_s": time.perf_counter() - t0, "runs": runs,
                            "max_total_num_tokens": int(cap[-1]) if cap else None, "log_tail": text[-3000:]}
        log(f"  rc {rc}, capacity {results[backend]['max_total_num_tokens']}, {len(runs)} runs")
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ob = results.get("one_batch")
    if not ob:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for backend, res in ob.items():
        runs = [r for r in res["runs"] if r.get("batch_size") == 1]
        if not runs:
            continue
        x = [r["input_len"] for r in runs]
        ax[0].plot(x, [r["prefill_throughput"] for r in runs], "o-", label=backend)
        ax[1].plot(x, [r.get("median_decode_throughput", 0) for r in runs], "o-", label=backend)
    ax[0].set(xscale="log", xlabel="input length (batch 1)", ylabel="prefill tokens/s", title="prefill")
    ax[1].set(xscale="log", xlabel="input length (batch 1)", ylabel="decode tokens/s", title="decode")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle("SGLang 0.5.23 one_batch, 64/4/128 dummy model, H200")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="server,one_batch")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    steps = args.steps.split(",")
    if "one_batch" in steps:
        results["one_batch"] = one_batch_step(args.out, args.input_lens, args.batch_sizes, args.mem_fraction_static,
                                              args.backends)
        _save(results, args.out)
    if "server" in steps:
        try:
            results["server"] = server_step(args.out, args.backends)
        except Exception as e:  # keep the other step's numbers; the failure is recorded
            results["server_error"] = repr(e)
            log(f"server step failed: {e!r}")
    _save(results, args.out)
    plot(results, os.path.join(args.out, "e2e.png"))
    log("done")


def _save(results: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
