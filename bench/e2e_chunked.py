"""``chunked`` step of bench_e2e and bench_m3: long prompts through a real server under SGLang's chunked prefill.

``one_batch`` runs a prompt as one forward. A server cuts a long prompt into chunks (``--chunk-size`` tokens,
passed as SGLang's ``--chunked-prefill-size``), and each chunk is a forward over everything before it. Those forwards
have few query tokens per block-table slot, which is what ``triton_predecode.pays`` decides on. So this step
measures predecoding where it is least likely to pay, and its memory, where it is allocated per forward.

Per variant, one server: ``nvfp4_sparse`` twice, with ``NVFP4_SPARSE_PREDECODE=auto`` (the default) and ``off``,
then each other backend of ``--backends``. Per prompt length (``--chunked-input-lens``), one untimed prompt, then
``--chunked-repeats`` timed ones. Each is a fresh list of random token ids (below 10000 and the model's
vocabulary), the same lists for every variant, so the radix cache never hits and the variants answer the same
prompts. Each request asks for 1 new token (greedy, with its logprob), so its latency is the prefill's.

Around each request a thread polls GPU 0's used memory through NVML (every 10 ms; no CUDA context in this process,
which would take memory from the servers) and records the most above the level just before the request, with a last
sample at its end; on a host without NVML or a GPU, none. The servers' allocator keeps memory once it has grown, so
the first (untimed) request of each length shows what such forwards need beyond the pool; later ones mostly show 0.

Results go under ``chunked`` in the run's JSON, per variant: ``requests`` (length, seconds, first token, its logprob,
memory); ``summary`` per variant and length (:func:`summarize`). ``agreement`` lists, per variant pair, how many
prompts got the same first token. Predecoding keeps the attention's bits, so ``auto`` and ``off`` must agree on every
prompt; with a dense backend only NVFP4 storage and the sparse selection separate the answers.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

from harness import COMMON_SERVER_ARGS, BenchRun, log

MIN_SECONDS_LEFT = 240  # a variant's server is started only with this much of the budget left (its start-up: 180 s)
# The servers take one request at a time: decode graphs past batch 4 would only lengthen their start-up (all 36 of
# SGLang's batch sizes took 82 s to capture on an H100, 2026-12-07, and the start-up overran its 161 s), and so would
# prefill graphs, which dense backends capture by default (58 shapes took 200 s for FlashInfer on an H100) and ours
# leave off: no prefill graphs for any variant, so that all run their prefill alike.
SERVER_FLAGS = ["--cuda-graph-max-bs-decode", "4", "--cuda-graph-backend-prefill", "disabled"]
TOKEN_ID_LIMIT = 10000  # random prompt ids below this and below the model's vocabulary
OURS = "nvfp4_sparse"


def variants(backends: list[str]) -> list[tuple[str, str, dict]]:
    """``(label, backend, environment)`` per server: ours with predecoding ``auto`` and ``off``, then the others."""
    rows = []
    for backend in backends:
        if backend == OURS:
            rows += [(f"{OURS}_predecode_{mode}", OURS, {"NVFP4_SPARSE_PREDECODE": mode}) for mode in ("auto", "off")]
        else:
            rows.append((backend, backend, {}))
    return rows


def prompt_ids(input_len: int, index: int, vocab_size: int) -> list[int]:
    """Prompt ``index`` of length ``input_len``, ids from 1 to below ``TOKEN_ID_LIMIT`` and ``vocab_size``: the same
    ids in every variant and run."""
    rng = random.Random(input_len * 1000 + index)
    return [rng.randrange(1, min(TOKEN_ID_LIMIT, vocab_size)) for _ in range(input_len)]


def gpu_memory_reader():
    """A function that returns GPU 0's used memory in bytes, read through NVML, or None where NVML or a GPU is
    missing (the CPU engine)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 (no NVML library, no driver, no GPU)
        return None
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used


class MemoryPeak:
    """Context manager: the most memory in use above the level at entry, in bytes (``peak``), sampled with
    ``read_used`` (:func:`gpu_memory_reader`) every ``period`` s from a thread and once more at exit; ``peak`` stays
    None when ``read_used`` is None."""

    def __init__(self, read_used, period: float = 0.01):
        self.read_used, self.period, self.peak = read_used, period, None

    def _sample(self) -> None:
        self.peak = max(self.peak, self.read_used() - self._base)

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "MemoryPeak":
        if self.read_used is not None:
            self._base, self.peak, self._stop = self.read_used(), 0, threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.read_used is not None:
            self._stop.set()
            self._thread.join()
            self._sample()


def _serve(bench: BenchRun, model: str, backend: str, env: dict, server_args: list, input_lens: list[int],
           repeats: int, vocab_size: int, read_used, entry: dict) -> None:
    """One server; fills ``entry`` (a failure is recorded with the requests answered before it)."""
    t0 = time.perf_counter()
    rows = entry.setdefault("requests", [])
    try:
        with bench.server(model, backend, extra_args=server_args, env={**os.environ, **env},
                          startup_timeout=bench.capped(300, reserve=60),
                          log_path=bench.path(f"chunked_{entry['label']}.log")) as srv:
            entry["startup_s"] = time.perf_counter() - t0
            for input_len in input_lens:
                for index in range(repeats + 1):
                    request = {"input_ids": prompt_ids(input_len, index, vocab_size), "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
                    t1 = time.perf_counter()
                    with MemoryPeak(read_used) as memory:
                        meta = srv.post("/generate", request, timeout=bench.capped(200.0, floor=10.0))["meta_info"]
                    logprob, token, _ = meta["output_token_logprobs"][0]
                    rows.append({"input_len": input_len, "index": index, "timed": index > 0,
                                 "seconds": time.perf_counter() - t1, "prompt_tokens": meta["prompt_tokens"],
                                 "cached_tokens": meta["cached_tokens"], "first_token": token,
                                 "first_logprob": logprob, "memory_peak_bytes": memory.peak})
                    log(f"  chunked {entry['label']} {input_len} #{index}: {rows[-1]['seconds']:.3f} s, cached "
                        f"{meta['cached_tokens']}, peak {memory.peak}")
    except Exception as e:  # keep what this variant answered; the failure is recorded
        entry["error"] = repr(e)[:3000]
        log(f"chunked {entry['label']} failed: {e!r}"[:500])


def agreement(by_label: dict) -> dict:
    """Per pair of variants that answered: ``{"same": n, "prompts": m}`` over the prompts both answered."""
    first = {label: {(r["input_len"], r["index"]): r["first_token"] for r in entry.get("requests", [])}
             for label, entry in by_label.items()}
    labels = [label for label in first if first[label]]
    pairs = {}
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            both = first[a].keys() & first[b].keys()
            pairs[f"{a} vs {b}"] = {"same": sum(first[a][k] == first[b][k] for k in both), "prompts": len(both)}
    return pairs


def summarize(by_label: dict) -> dict:
    """Per variant and prompt length: the timed requests' mean seconds and the first request's memory peak (bytes,
    or None)."""
    out = {}
    for label, entry in by_label.items():
        rows = entry.get("requests", [])
        for input_len in sorted({r["input_len"] for r in rows}):
            timed = [r["seconds"] for r in rows if r["input_len"] == input_len and r["timed"]]
            first = [r["memory_peak_bytes"] for r in rows if r["input_len"] == input_len and not r["timed"]]
            out.setdefault(label, {})[str(input_len)] = {
                "mean_seconds": sum(timed) / len(timed) if timed else None,
                "first_request_memory_peak_bytes": first[0] if first else None}
    return out


def run_step(bench: BenchRun, backends: list[str], model: str, input_lens: list[int], chunk: int,
             repeats: int = 2, extra_args=(), chosen=None) -> None:
    """Serve each variant of ``backends`` (:func:`variants`; ``chosen``: those labels only) with chunks of ``chunk``
    tokens, saving after each; ``model`` a model folder whose context holds the longest prompt, ``extra_args`` more
    server flags (e.g. ``--load-format dummy``), after ``COMMON_SERVER_ARGS``, so that they override them (SGLang
    takes a flag's last value: ``--mem-fraction-static``)."""
    server_args = [*COMMON_SERVER_ARGS, *SERVER_FLAGS, "--chunked-prefill-size", str(chunk), *extra_args]
    results = bench.results.setdefault("chunked", {})
    results.update(chunked_prefill_size=chunk, input_lens=list(input_lens), repeats=repeats, server_args=server_args)
    by_label = results.setdefault("variants", {})
    with open(os.path.join(model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    read_used = gpu_memory_reader()
    for label, backend, env in variants(backends):
        if chosen is not None and label not in chosen:
            continue
        reason = bench.skip_reason(f"chunked {label}", MIN_SECONDS_LEFT)
        by_label[label] = entry = {"label": label, "backend": backend, "env": env}
        if reason:
            entry["skipped"] = reason
            continue
        log(f"chunked {label}: starting")
        _serve(bench, model, backend, env, server_args, input_lens, repeats, vocab_size, read_used, entry)
        bench.save()
    results["agreement"] = agreement(by_label)
    results["summary"] = summarize(by_label)
    bench.save()
