"""``server`` step of bench_e2e: a real SGLang server per backend on a tiny random-weight model (16 query /
1 KV head, head_dim 128; decode CUDA graphs on): ``short_prompts`` short prompts (default 8; <= 16 blocks,
dense-equivalent: first greedy token and logprob agreement with every dense backend served, and of the dense
backends with each other, the noise between dense implementations; each first token's top-2 logprobs give the
margin a disagreement had to cross), one long prompt (more blocks than TOPK), two prompts
sharing a prefix (radix hit), per-request latency, and batch invariance: ``INVARIANCE_PROMPTS`` greedy requests
one at a time, then all at once, each round from an empty radix cache (``batch_invariance``: how many
continuations came out identical). Results go to ``e2e.json`` under ``server``.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from e2e_summary import server_agreement
from harness import COMMON_SERVER_ARGS, BenchRun, log

from sglang_nvfp4.tiny_model import make_tiny_model, random_text

MIN_SECONDS_LEFT = 150  # a backend's server is started only with this much of the budget left
SHORT_PROMPTS = 8  # the short prompts of every run before --short-prompts, which come first in any run
INVARIANCE_PROMPTS, INVARIANCE_TOKENS = 12, 128


def _prompts(short_prompts: int = SHORT_PROMPTS) -> list[tuple[str, str]]:
    """(name, text) of every request, the same for every backend. The first ``SHORT_PROMPTS`` short prompts, the
    long one and the prefix pair are those of every earlier run, whatever ``short_prompts`` is; more follow."""
    rng = random.Random(0)
    short = [random_text(rng, rng.randint(50, 1800)) for _ in range(min(short_prompts, SHORT_PROMPTS))]
    long_text = random_text(rng, 6000)
    prefix = random_text(rng, 2500)
    short += [random_text(rng, rng.randint(50, 1800)) for _ in range(short_prompts - len(short))]
    return [*(("short", s) for s in short), ("long", long_text),
            ("prefix_a", prefix + " key value"), ("prefix_b", prefix + " page block")]


def _serve(bench: BenchRun, model: str, backend: str, prompts: list, entry: dict, extra_args=()) -> None:
    """One server of ``backend``: every prompt alone, greedy, 16 tokens with logprobs (short prompts: the top 2
    at each position too, ``first_top2_margin`` is the first token's); fills ``entry``.
    A failure is recorded in ``entry`` with the requests answered before it."""
    log(f"server {backend}: starting")
    t0 = time.perf_counter()
    rows = []
    try:
        with bench.server(model, backend, extra_args=COMMON_SERVER_ARGS + list(extra_args), startup_timeout=bench.capped(240, reserve=60),
                          log_path=bench.path(f"server_{backend}.log")) as srv:
            entry.update(startup_s=time.perf_counter() - t0, requests=rows)
            for name, text in prompts:
                t1 = time.perf_counter()
                request = {"text": text, "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
                if name == "short":
                    request["top_logprobs_num"] = 2
                r = srv.post("/generate", request, timeout=bench.capped(120.0, floor=10.0))
                meta = r["meta_info"]
                rows.append({"name": name, "latency_s": time.perf_counter() - t1,
                             "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"],
                             "tokens": [t[1] for t in meta["output_token_logprobs"]],
                             "logprobs": [t[0] for t in meta["output_token_logprobs"]]})
                if name == "short":
                    (top1, *_), (top2, *_) = meta["output_top_logprobs"][0][:2]
                    rows[-1]["first_top2_margin"] = top1 - top2
                log(f"  {backend} {name}: {meta['prompt_tokens']} tokens, cached {meta['cached_tokens']}, "
                    f"{rows[-1]['latency_s']:.3f} s")
            entry["batch_invariance"] = _alone_vs_together(srv, bench)
            server_log = srv.log_tail(10_000_000)
        entry["decode_cuda_graph"] = "Capture cuda graph" in server_log or "capture" in server_log.lower()
    except Exception as e:  # keep what this backend answered; the failure is recorded
        entry.update(error=repr(e)[:3000], requests=rows)
        log(f"server {backend} failed: {e!r}"[:500])


def _alone_vs_together(srv, bench: BenchRun) -> dict:
    """The same greedy requests one at a time and then all at once, each round from an empty radix cache."""
    rng = random.Random(1)
    prompts = [random_text(rng, rng.randint(600, 3000)) for _ in range(INVARIANCE_PROMPTS)]

    def answer(text):
        r = srv.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": INVARIANCE_TOKENS,
                                                                      "temperature": 0.0}},
                     timeout=bench.capped(120.0, floor=10.0))
        return r["text"]

    srv.flush_cache()
    alone = [answer(p) for p in prompts]
    srv.flush_cache()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(answer, prompts))
    same = sum(a == b for a, b in zip(alone, together))
    log(f"  batch invariance: {same}/{len(prompts)} continuations identical alone and together")
    return {"identical": same, "requests": len(prompts), "new_tokens": INVARIANCE_TOKENS}


def run_step(bench: BenchRun, backends: list, model: str | None = None, extra_args=(),
             short_prompts: int = SHORT_PROMPTS) -> None:
    """Serve every backend of ``backends`` in turn (while the budget allows), saving after each; ``model``
    (default: the tiny model above) and ``extra_args`` (e.g. ``--load-format dummy``) for other models."""
    results = bench.results.setdefault("server", {})
    model = model or make_tiny_model(bench.path("tiny"), kv_heads=1, layers=2)
    prompts = _prompts(short_prompts)
    for backend in backends:
        reason = bench.skip_reason(f"server {backend}", MIN_SECONDS_LEFT)
        if reason:
            results[backend] = {"skipped": reason}
            continue
        results[backend] = entry = {}
        _serve(bench, model, backend, prompts, entry, extra_args)
        bench.save()
    results["agreement"] = server_agreement({b: results[b] for b in backends})
