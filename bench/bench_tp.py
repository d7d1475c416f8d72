"""Tensor parallelism end to end (issue 9): ``nvfp4_sparse`` served at ``--tp-size 1`` and ``--tp-size 2``
on the same model with real random weights, same prompts, same flags. Writes ``tp.json`` (after every
request group, so a timeout still leaves numbers) and the server logs under ``--out``.

* Model: GraniteForCausalLM, 64 query / 4 KV heads, head_dim 128 (``--hidden-size`` 1024, ``--layers``
  4), random weights written to disk (``sglang_nvfp4.tiny_model``): every rank loads its shard of the
  same tensors, unlike ``--load-format dummy`` which initialises each rank's shard independently.
* Per server: a warm-up (not recorded), then each prompt of ``--short-lens`` (<= 2048 tokens: every
  block attended, dense-equivalent) and ``--long-lens`` (sparse: more than TOPK blocks) alone, greedy,
  ``--max-new-tokens`` tokens with logprobs and latency; then two loads, each sent as one batched
  /generate call, once untimed and ``--repeats`` times timed, every repetition with its own prompts
  (medians reported): prefill-heavy (``--prefill-batch`` prompts of ``--prefill-len`` tokens, 1 new
  token) and decode-heavy (``--decode-batch`` prompts of ``--decode-len`` tokens, ``--decode-new``
  new tokens, ignore EOS; the prompts are prefilled by an untimed call first, so the timed call finds
  them in the radix cache and times decode).
* Agreement of each backend at tp2 against itself at tp1 (with ``--dense-ref``, ``triton`` at both
  sizes: what TP alone changes in bf16) and of ``triton`` against ``nvfp4_sparse`` at the same TP
  size (``--dense-backend torch_native`` on CPU): first token equal, all tokens equal, leading
  tokens equal, |delta logprob| of the first token and over the common leading tokens. Random
  weights make next-token distributions flat, so greedy paths may part after one flip: the numbers
  are what they are.

Prompts are random words of the tiny tokenizer's corpus (one token per word). ``--tp-size N > 1``
runs with ``--disable-custom-all-reduce`` (NCCL only; ``--custom-all-reduce`` to keep SGLang's
kernel). The script stops starting servers when less than ``--min-server-s`` of ``--budget-s`` is
left, so it ends inside one 10-minute device call.

``python bench/bench_tp.py --out DIR`` (2 GPUs, SGLang; see bench/gpu_tp.sh for the host set-up).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import statistics
import time

from harness import COMMON_SERVER_ARGS, BenchRun, add_int_options, exit_on_sigterm, log

from sglang_nvfp4.local_server import cuda_available
from sglang_nvfp4.tiny_model import make_tiny_model, random_text


def _stats(values: list) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "max": max(values)}


def agreement(a_rows: list, b_rows: list) -> dict:
    """``a`` against ``b`` over the requests both have, by name, per group (short / long)."""
    b_by = {r["name"]: r for r in b_rows if r.get("tokens")}
    out = {}
    for group in ("short", "long"):
        pairs = [(a, b_by[a["name"]]) for a in a_rows if a.get("tokens") and a["group"] == group and a["name"] in b_by]
        if not pairs:
            continue
        lead, first_d, lead_d = [], [], []
        for a, b in pairs:
            n = 0
            while n < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][n] == b["tokens"][n]:
                n += 1
            lead.append(n)
            first_d.append(abs(a["logprobs"][0] - b["logprobs"][0]))
            # up to and including the first differing token, both saw the same context
            k = min(n + 1, len(a["logprobs"]), len(b["logprobs"]))
            lead_d += [abs(x - y) for x, y in zip(a["logprobs"][:k], b["logprobs"][:k])]
        out[group] = {
            "prompts": len(pairs),
            "first_token_equal": sum(a["tokens"][0] == b["tokens"][0] for a, b in pairs),
            "all_tokens_equal": sum(a["tokens"] == b["tokens"] for a, b in pairs),
            "leading_tokens_equal": lead,
            "new_tokens": [len(a["tokens"]) for a, _ in pairs],
            "first_logprob_abs_delta": _stats(first_d),
            "first_logprob_abs_delta_each": first_d,
            "common_context_logprob_abs_delta": _stats(lead_d),
            "names": [a["name"] for a, _ in pairs],
        }
    return out


def _warm_up(post, args) -> None:
    """Triton JIT of the dense and sparse paths and of a small batch; not recorded."""
    rng = random.Random(99)
    post({"text": random_text(rng, 1500), "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    post({"text": random_text(rng, args.warmup_long_len), "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    post({"text": [random_text(rng, 600) for _ in range(4)],
          "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})


def _single_requests(bench: BenchRun, post, tag: str, prompts: list, args, rows: list) -> None:
    """Every prompt alone, greedy, with logprobs and latency; a row each, saved as it ends."""
    for p in prompts:
        t1 = time.perf_counter()
        r = post({"text": p["text"], "return_logprob": True,
                  "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}})
        meta = r["meta_info"]
        rows.append({
            "name": p["name"], "group": p["group"], "latency_s": time.perf_counter() - t1,
            "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta.get("cached_tokens"),
            "tokens": [t[1] for t in meta["output_token_logprobs"]],
            "logprobs": [t[0] for t in meta["output_token_logprobs"]]})
        log(f"  {tag} {p['name']}: {meta['prompt_tokens']} tokens, {rows[-1]['latency_s']:.3f} s")
        bench.save()


def _timed_loads(bench: BenchRun, post, tag: str, loads: dict, entry_loads: dict) -> None:
    """Each load's repetitions as batched calls (the first an untimed warm-up of the shapes), saved as they end."""
    for name, load in loads.items():
        reps = entry_loads[name] = []
        for i, texts in enumerate(load["repetitions"]):
            if load.get("prime"):  # prefill alone first: the timed call then finds the prompts in the radix cache
                post({"text": texts, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
            t1 = time.perf_counter()
            rs = post({"text": texts, "sampling_params": load["sampling_params"]})
            wall = time.perf_counter() - t1
            pt = sum(r["meta_info"]["prompt_tokens"] for r in rs)
            ct = sum(r["meta_info"]["completion_tokens"] for r in rs)
            cached = sum(r["meta_info"].get("cached_tokens") or 0 for r in rs)
            reps.append({"warmup": i == 0, "requests": len(rs), "wall_s": wall, "prompt_tokens": pt,
                         "cached_tokens": cached, "completion_tokens": ct, "prompt_tok_s": pt / wall,
                         "output_tok_s": ct / wall, "total_tok_s": (pt + ct) / wall})
            log(f"  {tag} {name}{' (warm-up)' if i == 0 else f' #{i}'}: {len(rs)} requests, {pt} prompt "
                f"({cached} cached) + {ct} new tokens in {wall:.2f} s ({pt / wall:,.0f} prompt tok/s, "
                f"{ct / wall:,.0f} new tok/s)")
            bench.save()


def run_server(bench: BenchRun, tag: str, model: str, backend: str, tp: int, prompts: list, loads: dict, args,
               entry: dict) -> None:
    """One server (``backend`` at ``--tp-size tp``): warm-up, single requests, loads; fills ``entry`` and
    keeps what it answered if it fails, with its exit code, KV capacity and the end of its log."""
    extra = [*shlex.split(args.server_args), "--tp-size", str(tp)]
    if tp > 1 and not args.custom_all_reduce:
        extra.append("--disable-custom-all-reduce")
    entry.update(backend=backend, tp=tp, server_args=extra, requests=[], loads={})
    log_path = bench.path(f"server_{tag}.log")
    srv = bench.server(model, backend, extra_args=extra, log_path=log_path,
                       startup_timeout=bench.capped(args.startup_timeout, reserve=60, floor=30.0))
    log(f"{tag}: starting ({' '.join(extra)})")
    t0 = time.perf_counter()

    def post(payload: dict):
        return srv.post("/generate", payload, timeout=bench.capped(args.request_timeout, floor=10.0))

    try:
        srv.start()
        entry["startup_s"] = time.perf_counter() - t0
        log(f"{tag}: up after {entry['startup_s']:.1f} s")
        bench.save()
        t1 = time.perf_counter()
        _warm_up(post, args)
        entry["warmup_s"] = time.perf_counter() - t1
        _single_requests(bench, post, tag, prompts, args, entry["requests"])
        _timed_loads(bench, post, tag, loads, entry["loads"])
    except Exception as e:  # keep what this server answered; the failure is recorded
        entry["error"] = repr(e)[:3000]
        log(f"{tag} failed: {e!r}"[:600])
    finally:
        entry["returncode"] = srv.stop()
        text = srv.log_tail(50_000_000) if os.path.exists(log_path) else ""
        caps = [int(v) for v in re.findall(r"max_total_num_tokens=(\d+)", text)]
        entry["max_total_num_tokens"] = caps[-1] if caps else None
        entry["traceback_in_log"] = "Traceback" in text
        entry["log_tail"] = text[-3000:]
        entry["wall_s"] = time.perf_counter() - t0
        bench.save()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2],
                    help="TP sizes for nvfp4_sparse (the first is the reference)")
    ap.add_argument("--dense-ref", action="store_true",
                    help="also --dense-backend at every TP size (if time is left): the bf16 baseline of TP agreement")
    ap.add_argument("--dense-backend", default="triton", help="dense bf16 backend of --dense-ref (CPU: torch_native)")
    add_int_options(ap, hidden_size=1024, layers=4, kv_heads=4, heads_per_kv=16, context_len=65536)
    ap.add_argument("--short-lens", type=int, nargs="+", default=[200, 500, 800, 1100, 1400, 1700, 2000],
                    help="words = tokens; <= 2032 stays within TOPK blocks with the new tokens")
    ap.add_argument("--long-lens", type=int, nargs="+", default=[8192, 12288, 16384, 24576, 32768])
    add_int_options(ap, warmup_long_len=4096, max_new_tokens=16, prefill_batch=16, prefill_len=16384, decode_batch=64,
                    decode_len=4096, decode_new=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions of each load (after one untimed)")
    ap.add_argument("--server-args", default=" ".join([*COMMON_SERVER_ARGS, "--cuda-graph-max-bs-decode", "64"]),
                    help="SGLang server arguments of every run, one string given with '=' (default: %(default)s)")
    ap.add_argument("--custom-all-reduce", action="store_true",
                    help="keep SGLang's custom all-reduce kernel at tp > 1 (default: --disable-custom-all-reduce)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--budget-s", type=float, default=500.0, help="total time this script may take (default 500)")
    ap.add_argument("--min-server-s", type=float, default=120.0,
                    help="start another server only with at least this much of the budget left")
    return ap.parse_args()


def record_gpus(results: dict, tp_sizes: list) -> None:
    """The GPUs and torch version into ``results``; a warning when fewer GPUs than the largest TP size."""
    if not cuda_available():
        return
    import torch

    results["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    results["torch"] = torch.__version__
    if max(tp_sizes) > torch.cuda.device_count():
        log(f"warning: --tp {max(tp_sizes)} but {torch.cuda.device_count()} GPU(s) visible")


def make_prompts(args) -> list:
    """The single requests: ``--short-lens`` and ``--long-lens`` words of random text."""
    rng = random.Random(0)
    prompts = [{"name": f"short_{n}", "group": "short", "text": random_text(rng, n)} for n in args.short_lens]
    prompts += [{"name": f"long_{n}", "group": "long", "text": random_text(rng, n)} for n in args.long_lens]
    return prompts


def make_loads(args) -> dict:
    """The prefill-heavy and decode-heavy loads: 1 + ``--repeats`` repetitions, each with prompts of its own
    so that none is served from the radix cache."""
    rng = random.Random(1)
    return {
        "prefill_heavy": {"repetitions": [[random_text(rng, args.prefill_len) for _ in range(args.prefill_batch)]
                                          for _ in range(1 + args.repeats)],
                          "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
        "decode_heavy": {"repetitions": [[random_text(rng, args.decode_len) for _ in range(args.decode_batch)]
                                         for _ in range(1 + args.repeats)],
                         "prime": True,
                         "sampling_params": {"max_new_tokens": args.decode_new, "temperature": 0.0,
                                             "ignore_eos": True}},
    }


def summarise(results: dict, args) -> tuple[dict, dict, str]:
    """Agreement between runs, load medians per run and throughput against the reference run, into
    ``results``; returns the agreement, the throughput ratios and the reference's tag."""
    runs = results["runs"]
    ref = f"nvfp4_sparse_tp{args.tp[0]}"
    # each backend at tp N against itself at the first TP size (for the dense one: what TP alone
    # changes in bf16), and the dense backend against nvfp4_sparse at the same TP size
    dense = args.dense_backend
    pairs = [(f"{b}_tp{tp}", f"{b}_tp{args.tp[0]}") for b in ("nvfp4_sparse", dense) for tp in args.tp[1:]]
    pairs += [(f"{dense}_tp{tp}", f"nvfp4_sparse_tp{tp}") for tp in args.tp]
    agree = results["agreement"] = {}
    for a, b in pairs:
        if runs.get(a, {}).get("requests") and runs.get(b, {}).get("requests"):
            agree[f"{a}_vs_{b}"] = agreement(runs[a]["requests"], runs[b]["requests"])
    for run in runs.values():
        for name, reps in run.get("loads", {}).items():
            timed = [r for r in reps if not r["warmup"]]
            if timed:
                run.setdefault("load_medians", {})[name] = {
                    k: statistics.median(r[k] for r in timed)
                    for k in ("wall_s", "prompt_tok_s", "output_tok_s", "total_tok_s")}
    speed = results["median_throughput_vs_" + ref] = {}
    for tag, run in runs.items():
        base = runs.get(ref, {}).get("load_medians", {})
        if tag != ref and run.get("load_medians") and base:
            speed[tag] = {name: {k: m[k] / base[name][k] for k in ("prompt_tok_s", "output_tok_s", "total_tok_s")
                                 if base[name].get(k)}
                          for name, m in run["load_medians"].items() if name in base}
    return agree, speed, ref


def log_summary(agree: dict, speed: dict, ref: str) -> None:
    for name, a in agree.items():
        for group, g in a.items():
            log(f"{name} {group}: first token equal {g['first_token_equal']}/{g['prompts']}, all equal "
                f"{g['all_tokens_equal']}/{g['prompts']}, leading equal {g['leading_tokens_equal']}, "
                f"first |dlogprob| mean {g['first_logprob_abs_delta'].get('mean', float('nan')):.4f}")
    for tag, s in speed.items():
        ratios = ", ".join(f"{n} {v.get('total_tok_s', float('nan')):.2f}x" for n, v in s.items())
        log(f"{tag} / {ref} throughput: {ratios}")


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    bench = BenchRun(args.out, "tp.json", args.budget_s)
    results = bench.results
    record_gpus(results, args.tp)
    t0 = time.perf_counter()
    model = make_tiny_model(bench.path("model"), kv_heads=args.kv_heads, layers=args.layers,
                            heads_per_kv=args.heads_per_kv, hidden_size=args.hidden_size, context_len=args.context_len,
                            seed=0)
    results["model"] = {"architecture": "GraniteForCausalLM", "query_heads": args.kv_heads * args.heads_per_kv,
                        "kv_heads": args.kv_heads, "head_dim": 128, "hidden_size": args.hidden_size,
                        "layers": args.layers, "vocab_size": 512, "context_len": args.context_len,
                        "weights": "random, written to disk (seed 0)", "make_s": time.perf_counter() - t0}
    log(f"model written in {results['model']['make_s']:.1f} s: {model}")
    prompts, loads = make_prompts(args), make_loads(args)
    results["prompts"] = [{"name": p["name"], "group": p["group"], "words": len(p["text"].split())} for p in prompts]
    results["loads"] = {k: {"requests": len(v["repetitions"][0]), "words_each": len(v["repetitions"][0][0].split()),
                            "timed_repetitions": args.repeats, "prefilled_untimed_first": bool(v.get("prime")),
                            "sampling_params": v["sampling_params"]} for k, v in loads.items()}
    runs = results["runs"] = {}
    plan = [("nvfp4_sparse", tp) for tp in args.tp]
    if args.dense_ref:
        plan += [(args.dense_backend, tp) for tp in args.tp]
    try:
        for backend, tp in plan:
            tag = f"{backend}_tp{tp}"
            while tag in runs:  # the same configuration twice (a determinism check): a second tag
                tag += "_again"
            reason = bench.skip_reason(tag, args.min_server_s)
            if reason:
                runs[tag] = {"backend": backend, "tp": tp, "skipped": reason}
                bench.save()
                continue
            runs[tag] = {}
            run_server(bench, tag, model, backend, tp, prompts, loads, args, runs[tag])
    finally:
        agree, speed, ref = summarise(results, args)
        results["wall_s"] = time.perf_counter() - t0
        bench.save()
        log_summary(agree, speed, ref)
        log("done")


if __name__ == "__main__":
    main()
