"""``offline`` step of bench_e2e: ``sglang.benchmark.offline_throughput`` (through
``sglang_nvfp4.bench_offline_throughput``) on a dummy config of ``e2e_models`` (``--offline-model``,
default gqa64x4), dataset ``generated-shared-prefix``: ``--offline-groups`` groups of
``--offline-prompts-per-group`` prompts sharing a ``--offline-system-prompt-len``-token system prompt,
``--offline-question-len``-token questions, ``--offline-output-len`` output tokens (ignore EOS). SGLang
draws that many random token ids and re-tokenizes their text, which with the tiny BPE tokenizer comes out
~1.46x longer (16384 -> ~24K tokens). Records SGLang's result line (output / input / total token
throughput; input tokens count the radix-cached prefix tokens too) and the prefill tokens computed vs
served from the radix cache (sums of the scheduler's log lines), under ``offline`` in ``e2e.json``.
SGLang's own warm-up (16 short requests, from a ShareGPT-format file written here from random words: no
network) is replaced by one untimed pass over the benchmark's own requests followed by ``flush_cache``,
so the timed pass compiles nothing and starts with an empty radix cache. ``--offline-pretokenize``: the
prompts are tokenized before the timed pass and sent as ``input_ids``; without it the engine tokenizes the
~24K-token prompts inside the timed window, one after another, and requests may reach the scheduler at the
tokenizer's pace. Each backend's greedy output texts (timed pass) go to ``offline_BACKEND_outputs.json``
(``outputs_file`` in the record; absent when the timed pass did not finish).

One child process per backend: this file run as a script (``python bench/e2e_offline.py ARGS``, see
:func:`child_main`), stopped at ``--offline-timeout`` or the budget.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import sys
import time

from e2e_models import dummy_model, model_record
from e2e_summary import offline_summary
from harness import BenchRun, file_tail, log

from sglang_nvfp4.tiny_model import random_text

CONTEXT_LEN = 131072
MIN_SECONDS_LEFT = 90  # a backend's child is started only with this much of the budget left
RESULT_GRACE_S = 20  # the result file is written after the engine's shutdown: the child has nothing left to do


# ---- child process ----------------------------------------------------------------------------------------
def _stand_in_for_missing_datasets() -> None:
    """SGLang's benchmark datasets package imports Hugging Face ``datasets`` at import time (for MMMU only);
    the GPU host has none, so a stand-in that raises on use is installed when it is missing."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is not None:
        return
    stub = types.ModuleType("datasets")

    def load_dataset(*a, **k):
        raise ImportError("Hugging Face 'datasets' is not installed (bench/e2e_offline.py stand-in)")

    stub.load_dataset = load_dataset
    sys.modules["datasets"] = stub


PRETOKENIZE_FLAG = "--bench-pretokenize"
OUTPUTS_FLAG = "--bench-outputs"


def _pop_flag(argv: list, name: str) -> bool:
    """Removes ``name`` from ``argv`` (in place); whether it was there."""
    found = name in argv
    while name in argv:
        argv.remove(name)
    return found


def _pop_value(argv: list, name: str) -> str | None:
    """Removes ``name VALUE`` from ``argv`` (in place); the value, or ``None``."""
    if name not in argv:
        return None
    i = argv.index(name)
    if i + 1 >= len(argv):
        raise SystemExit(f"{name} needs a value")
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def _wrap_generate(engine, dataset: list, pretokenize: bool) -> list:
    """Wraps ``engine.generate`` for the benchmark's calls; returns the list that holds the last call's output
    texts, in request order (read after the timed pass, outside its timed window). ``pretokenize``: every
    prompt is tokenized here, before either pass, and sent as ``input_ids`` (without it the engine tokenizes
    the ~24K-token prompts inside the timed window)."""
    generate, last_texts, ids = engine.generate, [], {}
    if pretokenize:
        tokenizer = getattr(getattr(engine, "tokenizer_manager", None), "tokenizer", None)
        if tokenizer is None:
            raise SystemExit(f"{PRETOKENIZE_FLAG}: this engine has no tokenizer to tokenize with")
        ids = {row.prompt: tokenizer.encode(row.prompt) for row in dataset}

    def wrapped(prompt=None, **kwargs):
        if pretokenize:
            if not isinstance(prompt, list) or not all(isinstance(p, str) and p in ids for p in prompt):
                raise SystemExit(f"{PRETOKENIZE_FLAG}: a prompt of this call is not one of the dataset's texts")
            out = generate(input_ids=[ids[p] for p in prompt], **kwargs)
        else:
            out = generate(prompt=prompt, **kwargs)
        last_texts[:] = [o.get("text") for o in out]
        return out

    engine.generate = wrapped
    return last_texts


def child_main(argv: list) -> None:
    """Child process: ``sglang_nvfp4.bench_offline_throughput ARGV``, warmed up on its own requests.

    SGLang's warm-up is 16 random 256-token requests, which leaves the long-context shapes (chunked
    prefill over a cached prefix, decode at 20K+ tokens) to compile inside the timed run. Warm up on the
    benchmark's own requests instead, then empty the radix cache so the timed run starts cold."""
    _stand_in_for_missing_datasets()
    import sglang.benchmark.offline_throughput as ot

    from sglang_nvfp4.bench_offline_throughput import main as offline_main

    argv = list(argv)
    pretokenize = _pop_flag(argv, PRETOKENIZE_FLAG)
    outputs_path = _pop_value(argv, OUTPUTS_FLAG)
    dataset, calls, output_texts = [], [0], {}
    original_get_dataset, original_once = ot.get_dataset, ot.throughput_test_once

    def get_dataset(*a, **k):
        dataset[:] = original_get_dataset(*a, **k)
        return list(dataset)

    def throughput_test_once(backend_name, backend, reqs, *a, **k):
        calls[0] += 1
        if calls[0] == 1:
            output_texts["last_call"] = _wrap_generate(backend, dataset, pretokenize)
        if calls[0] > 1:
            result = original_once(backend_name, backend, reqs, *a, **k)
            if outputs_path:  # the timed pass's texts, written after its timed window
                with open(outputs_path, "w") as f:
                    json.dump(output_texts["last_call"], f)
            return result
        t0 = time.perf_counter()
        original_once(backend_name, backend, dataset, *a, **k)
        backend.flush_cache()
        print(f"bench_e2e warm-up: the benchmark's {len(dataset)} requests once, then flush_cache "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        return None

    ot.get_dataset, ot.throughput_test_once = get_dataset, throughput_test_once
    sys.argv = ["sglang_nvfp4.bench_offline_throughput", *argv]
    offline_main()


# ---- parent -----------------------------------------------------------------------------------------------
def _write_sharegpt_stub(path: str, n: int = 32) -> str:
    """offline_throughput always samples its warm-up requests from a ShareGPT file (downloading it if
    ``--dataset-path`` is not valid JSON): a stand-in of random words in that format."""
    rng = random.Random(1)
    data = [{"id": str(i), "conversations": [
        {"from": "human", "value": random_text(rng, rng.randint(40, 300))},
        {"from": "gpt", "value": random_text(rng, rng.randint(20, 200))}]} for i in range(n)]
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def _dataset_args(args, sharegpt_path: str) -> list:
    """offline_throughput's generated-shared-prefix flags (and the ShareGPT stand-in for its warm-up)."""
    return ["--dataset-name", "generated-shared-prefix", "--dataset-path", sharegpt_path,
            "--gsp-num-groups", str(args.offline_groups),
            "--gsp-prompts-per-group", str(args.offline_prompts_per_group),
            "--gsp-system-prompt-len", str(args.offline_system_prompt_len),
            "--gsp-question-len", str(args.offline_question_len), "--gsp-output-len", str(args.offline_output_len),
            "--seed", "42"]


def _prefill_stats(text: str) -> dict:
    """Sums of the scheduler's 'Prefill batch' lines after the benchmark's start (warm-up excluded)."""
    start = text.rfind("Benchmark...")
    body = text[start:] if start >= 0 else text
    new = [int(v) for v in re.findall(r"Prefill batch.*?#new-token: (\d+)", body)]
    hit = [int(v) for v in re.findall(r"Prefill batch.*?#cached-token: (\d+)", body)]
    return {"prefill_batches": len(new), "prefill_new_tokens": sum(new), "prefill_cached_tokens": sum(hit),
            "after_benchmark_marker": start >= 0}


def _wait_for_child(process, result_path: str, limit: float, backend: str) -> bool:
    """Wait until the child exits, runs past ``limit`` s, or lingers ``RESULT_GRACE_S`` s after writing its
    result; returns whether it ran out of time (the caller stops it)."""
    t0, result_at = time.monotonic(), None
    while process.poll() is None:
        now = time.monotonic()
        if now - t0 > limit:
            log(f"  offline {backend}: past {limit:.0f} s, stopping it")
            return True
        if result_at is None and os.path.exists(result_path):
            result_at = now
        if result_at is not None and now - result_at > RESULT_GRACE_S:
            log(f"  offline {backend}: result written, process still up after {RESULT_GRACE_S} s; stopping it")
            return False
        time.sleep(1.0)
    return False


def _run_backend(bench: BenchRun, args, model: str, backend: str, dataset_args: list) -> dict:
    """One child for ``backend``; returns its record (result line, prefill sums, log tail)."""
    result_path, log_path = bench.path(f"offline_{backend}.jsonl"), bench.path(f"offline_{backend}.log")
    outputs_path = bench.path(f"offline_{backend}_outputs.json")
    for p in (result_path, log_path, outputs_path):
        if os.path.exists(p):
            os.remove(p)
    cmd = [sys.executable, os.path.abspath(__file__), "--model-path", model,
           "--load-format", "dummy", "--attention-backend", backend, "--page-size", "128",
           "--sampling-backend", "pytorch", "--mem-fraction-static", str(args.mem_fraction_static),
           *dataset_args, "--result-filename", result_path, *shlex.split(args.sglang_args),
           OUTPUTS_FLAG, outputs_path, *([PRETOKENIZE_FLAG] if args.offline_pretokenize else [])]
    limit = bench.capped(args.offline_timeout, reserve=20)
    log(f"offline {backend}: {' '.join(cmd[2:])} (limit {limit:.0f} s)")
    t0 = time.monotonic()
    process = bench.start_child(cmd, log_path)
    timed_out = _wait_for_child(process, result_path, limit, backend)
    rc = bench.stop_child(process)
    text = file_tail(log_path, 50_000_000)
    res = [json.loads(line) for line in open(result_path)] if os.path.exists(result_path) else []
    sys_len = re.findall(r"Average system prompt length: ([\d.]+) tokens", text)
    record = {"returncode": rc, "timed_out": timed_out, "wall_s": time.monotonic() - t0,
              "result": res[-1] if res else None, "result_file": os.path.basename(result_path),
              "avg_system_prompt_tokens": float(sys_len[0]) if sys_len else None,
              "pretokenized": bool(args.offline_pretokenize),
              "outputs_file": os.path.basename(outputs_path) if os.path.exists(outputs_path) else None,
              **_prefill_stats(text), "log_tail": text[-3000:]}
    if res:
        r = res[-1]
        log(f"  offline {backend}: output {r['output_throughput']:,.0f} tok/s, input {r['input_throughput']:,.0f} "
            f"tok/s, {r['total_latency']:.2f} s; prefill computed {record['prefill_new_tokens']:,}, "
            f"cached {record['prefill_cached_tokens']:,} tokens")
    else:
        log(f"  offline {backend}: no result (rc {rc}, timed out {timed_out})")
    return record


def run_step(bench: BenchRun, args, backends: list) -> None:
    """Every backend of ``backends`` in turn (while the budget allows), saving after each; then nvfp4_sparse
    over the strongest dense backend (and over triton, the ratio of earlier runs)."""
    results = bench.results.setdefault("offline", {})
    model = dummy_model(bench.out_dir, args.offline_model, CONTEXT_LEN)
    dataset_args = _dataset_args(args, _write_sharegpt_stub(bench.path("sharegpt_stub.json")))
    results.update(model={"name": args.offline_model, **model_record(args.offline_model, CONTEXT_LEN)},
                   dataset_args=dataset_args[:2] + dataset_args[4:])
    for backend in backends:
        reason = bench.skip_reason(f"offline {backend}", MIN_SECONDS_LEFT)
        if reason:
            results[backend] = {"skipped": reason}
            continue
        results[backend] = _run_backend(bench, args, model, backend, dataset_args)
        bench.save()
    ours, dense = (results.get(k, {}).get("result") for k in ("nvfp4_sparse", "triton"))
    if ours and dense:
        throughputs = ("output_throughput", "input_throughput", "total_throughput")
        results["ratio_nvfp4_over_triton"] = {k: ours[k] / dense[k] for k in throughputs if dense.get(k)}
    results["vs_strongest_dense"] = offline_summary({b: results[b] for b in backends})


if __name__ == "__main__":
    child_main(sys.argv[1:])
