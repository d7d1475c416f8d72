"""End-to-end SGLang 0.5.23 runs on a GPU host: ``nvfp4_sparse`` against dense ``triton`` (and
``torch_native`` in ``one_batch``), same build, same model config, same flags. Writes ``e2e.json``
(after every finished run, so a timeout still leaves numbers) and ``e2e.png``, and the raw logs,
under ``--out``.

Steps (``--steps``, comma list, default ``server,one_batch``; they run in the order one_batch,
offline, server):

* ``one_batch``: ``sglang.benchmark.one_batch`` (through this script's wrapper, which registers
  the plugin first) on the configs of ``--models`` (``gqa64x4``: 64 query / 4 KV heads, head_dim 128,
  hidden 4096, 4 layers; ``tiny``: 16 query / 1 KV head, head_dim 128, hidden 256, 2 layers; both
  ``--load-format dummy``, vocab 32000): prefill latency/throughput and decode throughput for every
  ``--batch-sizes`` x ``--input-lens`` pair (the config's context length is raised to cover the
  longest input + ``--output-len``), and ``max_total_num_tokens`` (KV capacity) at the same
  ``--mem-fraction-static``. one_batch warms up on its first pair only, so the first pair of every
  other batch size runs once untimed before its timed run (events ``batch_size_warmup``). One child
  process per (model, backend) runs all its pairs; each pair's
  result is recorded as soon as it ends. A pair that runs out of GPU memory is recorded as ``oom``
  and the child goes on; any other error, or a pair running past ``--run-timeout``, ends the child
  (recorded with the tail of its log) and a fresh child runs the remaining pairs. ``torch_native``
  runs only pairs with batch x input <= ``--torch-native-max-tokens`` (the others are recorded as
  ``skipped`` with the reason). Every pair gets a ``status`` in ``attempts``: ok, oom, error,
  timeout, crashed, skipped, not_run.
* ``offline``: ``sglang.benchmark.offline_throughput`` (through ``sglang_nvfp4.bench_offline_throughput``)
  on the gqa64x4 dummy config (``--offline-model``), dataset ``generated-shared-prefix``: ``--offline-groups`` groups of
  ``--offline-prompts-per-group`` prompts sharing a ``--offline-system-prompt-len``-token system
  prompt, ``--offline-question-len``-token questions, ``--offline-output-len`` output tokens (ignore
  EOS). SGLang draws that many random token ids and re-tokenizes their text, which with the tiny
  BPE tokenizer comes out ~1.46x longer (16384 -> ~24K tokens). Records SGLang's result line (output /
  input / total token throughput; input tokens count the radix-cached prefix tokens too) and the
  prefill tokens computed vs served from the radix cache (sums of the scheduler's log lines).
  SGLang's own warm-up (16 short requests, from a ShareGPT-format file written here from random words:
  no network) is replaced by one untimed pass over the benchmark's own requests followed by
  ``flush_cache``, so the timed pass compiles nothing and starts with an empty radix cache.
* ``server``: a real server per backend on a tiny random-weight model (16 query / 1 KV head,
  head_dim 128; decode CUDA graphs on): 8 short prompts (<= 16 blocks, dense-equivalent: first greedy
  token and logprob agreement), one long prompt (more blocks than TOPK), two prompts sharing a
  prefix (radix hit), per-request latency.

``server`` and ``offline`` run the backends of ``--backends`` other than ``torch_native``. The whole
script stops starting work at ``--budget-s`` seconds (children are stopped, the rest is recorded as
``not_run``), so it ends inside one 10-minute device call.

``python bench/bench_e2e.py --out DIR`` (needs CUDA and SGLang; see bench/gpu_e2e.sh for the host set-up).
``python bench/bench_e2e.py --replot e2e.json`` redraws ``e2e.png`` beside that file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from sglang_nvfp4 import cpu_compat
from sglang_nvfp4.local_server import LocalServer, cuda_available
from sglang_nvfp4.tiny_model import make_tiny_model, random_text

BACKENDS = ("nvfp4_sparse", "triton")
ONE_BATCH_BACKENDS = ("nvfp4_sparse", "triton", "torch_native")
# one_batch draws token ids < 10000, hence vocab 32000 (dummy weights; the tokenizer is not used for them).
MODELS = {
    "gqa64x4": {"kv_heads": 4, "layers": 4, "hidden_size": 4096, "heads_per_kv": 16},
    "tiny": {"kv_heads": 1, "layers": 2, "hidden_size": 256, "heads_per_kv": 16},
}
COMMON_SERVER_ARGS = ["--page-size", "128", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.6"]
CHILD_FLAG = "--one-batch-child"
OFFLINE_CHILD_FLAG = "--offline-child"
_CHILDREN: list[subprocess.Popen] = []  # live child process groups, stopped on exit / SIGTERM


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tail(path: str, chars: int = 2500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _child_env_args() -> tuple[dict, list]:
    """Environment and extra SGLang args for an SGLang child process (CPU engine where there is no GPU)."""
    env = dict(os.environ)
    if cuda_available():
        return env, []
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if cpu_compat.needs_stand_in():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cpu_compat.stand_in_path(), env.get("PYTHONPATH")]))
    return env, ["--device", "cpu"]


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` s; then SIGKILL whatever of the
    group outlived its leader (SGLang's scheduler / detokenizer processes)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc in _CHILDREN:
        _CHILDREN.remove(proc)
    return proc.returncode


def _record_pgid(out_dir: str, pid: int) -> None:
    """Children run in their own process groups (sessions): their ids go to ``child_pgids.txt`` so that
    the device scripts can end what is left if this script is killed outright."""
    with open(os.path.join(out_dir, "child_pgids.txt"), "a") as f:
        f.write(f"{pid}\n")


def watch_server_pgid(srv: LocalServer, out_dir: str) -> None:
    """Record a LocalServer's process group as soon as it is started (in a daemon thread)."""
    def watch():
        while srv.process is None:
            time.sleep(0.1)
        _record_pgid(out_dir, srv.process.pid)

    threading.Thread(target=watch, daemon=True).start()


def _spawn(cmd: list, log_path: str, env: dict) -> subprocess.Popen:
    with open(log_path, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _record_pgid(os.path.dirname(log_path), proc.pid)
    _CHILDREN.append(proc)
    return proc


def _context_len(max_input: int, output_len: int) -> int:
    """131072 (the configs' usual context) unless the longest input + output needs more: SGLang's
    request-to-token table is context_len + 4 wide."""
    return max(131072, -(-(max_input + output_len + 8) // 1024) * 1024)


def _model(out_dir: str, name: str, context_len: int) -> str:
    return make_tiny_model(os.path.join(out_dir, f"{name}_ctx{context_len}"), context_len=context_len, weights=False,
                           vocab_size=32000, **MODELS[name])


# ---- server -------------------------------------------------------------------------------------------------
def server_step(out_dir: str, backends, deadline: float, save, results: dict) -> dict:
    model = make_tiny_model(os.path.join(out_dir, "tiny"), kv_heads=1, layers=2)
    rng = random.Random(0)
    short = [random_text(rng, rng.randint(50, 1800)) for _ in range(8)]
    long_text = random_text(rng, 6000)
    prefix = random_text(rng, 2500)
    for backend in backends:
        remaining = deadline - time.monotonic()
        if remaining < 150:
            results[backend] = {"skipped": f"time budget: {remaining:.0f} s left (< 150 s)"}
            log(f"server {backend}: skipped, {remaining:.0f} s of the budget left")
            continue
        log(f"server {backend}: starting")
        t0 = time.perf_counter()
        rows, entry = [], {}
        results[backend] = entry
        srv = LocalServer(model, backend, extra_args=COMMON_SERVER_ARGS, startup_timeout=min(240, remaining - 60),
                          log_path=os.path.join(out_dir, f"server_{backend}.log"))
        watch_server_pgid(srv, out_dir)
        try:
            with srv:
                entry.update(startup_s=time.perf_counter() - t0, requests=rows)
                for name, text in [*(("short", s) for s in short), ("long", long_text),
                                   ("prefix_a", prefix + " key value"), ("prefix_b", prefix + " page block")]:
                    t1 = time.perf_counter()
                    timeout = max(10.0, min(120.0, deadline - time.monotonic()))
                    r = srv.post("/generate", {"text": text, "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}},
                                 timeout=timeout)
                    meta = r["meta_info"]
                    rows.append({"name": name, "latency_s": time.perf_counter() - t1,
                                 "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"],
                                 "tokens": [t[1] for t in meta["output_token_logprobs"]],
                                 "logprobs": [t[0] for t in meta["output_token_logprobs"]]})
                    log(f"  {backend} {name}: {meta['prompt_tokens']} tokens, cached {meta['cached_tokens']}, "
                        f"{rows[-1]['latency_s']:.3f} s")
                server_log = srv.log_tail(10_000_000)
            entry["decode_cuda_graph"] = "Capture cuda graph" in server_log or "capture" in server_log.lower()
        except Exception as e:  # keep what this backend answered; the failure is recorded
            entry.update(error=repr(e)[:3000], requests=rows)
            log(f"server {backend} failed: {e!r}"[:500])
        save()
    ours, dense = results.get("nvfp4_sparse", {}).get("requests"), results.get("triton", {}).get("requests")
    if ours and dense:
        pairs = [(o, d) for o, d in zip(ours, dense) if o["name"] == "short" and d["name"] == "short"]
        results["agreement"] = {
            "short_first_token_equal": sum(o["tokens"][0] == d["tokens"][0] for o, d in pairs),
            "short_prompts": len(pairs),
            "short_first_logprob_abs_delta": [abs(o["logprobs"][0] - d["logprobs"][0]) for o, d in pairs],
            "short_all_tokens_equal": sum(o["tokens"] == d["tokens"] for o, d in pairs),
        }
    return results


# ---- one_batch ------------------------------------------------------------------------------------------------
def one_batch_child(argv: list) -> None:
    """Child process: ``EVENTS BxI,BxI,... ONE_BATCH_ARGS...``. SGLang's one_batch with the plugin
    registered and its per-pair function wrapped: each pair's start and end go to EVENTS (JSON lines)
    at once, pairs not listed are passed over, an out-of-memory pair is recorded and the sweep goes
    on, any other error is recorded and ends the process (its CUDA context may be broken)."""
    events_path, todo_spec, *rest = argv
    todo = {tuple(int(v) for v in p.split("x")) for p in todo_spec.split(",")}

    from sglang_nvfp4.sglang.plugin import register_and_apply

    register_and_apply()
    import gc
    import traceback

    import sglang.benchmark.one_batch as ob
    import torch

    original = ob.latency_test_run_once
    calls = [0]
    warmed_batch_sizes = set()

    def emit(**event) -> None:
        with open(events_path, "a") as f:
            f.write(json.dumps(event, default=float) + "\n")

    def wrapped(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len, *a, **k):
        warmup = calls[0] == 0  # one_batch's warm-up is its first call (first batch size and input length)
        calls[0] += 1
        if not warmup and (batch_size, input_len) not in todo:
            return None
        key = {"batch_size": batch_size, "input_len": input_len, "warmup": warmup}
        emit(event="start", **key)
        t0 = time.perf_counter()
        failure = None
        try:
            if not warmup and batch_size not in warmed_batch_sizes:
                # one_batch warms up its first pair only; the first pair of another batch size would time
                # one-time costs (Triton compiling new shapes, allocator growth): an untimed run first.
                fresh = ob.prepare_synthetic_inputs_for_latency_test(batch_size, input_len)
                original(run_name, model_runner, rank_print, fresh, batch_size, input_len, min(32, output_len), *a, **k)
                emit(event="batch_size_warmup", wall_s=time.perf_counter() - t0, **key)
                t0 = time.perf_counter()
            warmed_batch_sizes.add(batch_size)
            res = original(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len, *a, **k)
        except Exception as e:  # noqa: BLE001 - recorded, and the process ends unless it was out of memory
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
            failure = dict(event="oom" if oom else "error", error=f"{type(e).__name__}: {e}"[:2000],
                           traceback=traceback.format_exc()[-3000:])
        if failure is not None:  # outside the except block: the failed run's frames (and tensors) are gone
            emit(**failure, wall_s=time.perf_counter() - t0, **key)
            if failure["event"] != "oom":
                sys.stdout.flush()
                os._exit(3)
            gc.collect()
            torch.cuda.empty_cache()
            return None
        if res is None:
            emit(event="skipped", reason="one_batch: batch_size > max_total_num_tokens // (input_len + output_len)",
                 wall_s=time.perf_counter() - t0, **key)
        else:
            emit(event="result", result=res, wall_s=time.perf_counter() - t0, **key)
        return res

    ob.latency_test_run_once = wrapped
    sys.argv = ["sglang.benchmark.one_batch", *rest]
    ob.cli_main()


def _read_events(path: str) -> list:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
    return out


def one_batch_backend(out_dir, model_name, model_dir, backend, pairs, args, deadline, entry, save) -> None:
    """All ``pairs`` of one (model, backend), filling ``entry`` (``runs``, ``attempts``, ...) as they end."""
    records: dict = {}
    entry.update(runs=[], attempts=[], children=[], max_total_num_tokens=None, returncode=None, log_tail="")
    for bs, il in pairs:
        if backend == "torch_native" and bs * il > args.torch_native_max_tokens:
            records[(bs, il)] = {"status": "skipped", "reason": f"torch_native: batch x input = {bs * il} > "
                                 f"--torch-native-max-tokens {args.torch_native_max_tokens}"}

    def publish():
        entry["attempts"] = [{"batch_size": bs, "input_len": il, **records[(bs, il)]} for bs, il in pairs
                             if (bs, il) in records]
        entry["runs"] = [r["result"] for r in entry["attempts"] if r.get("status") == "ok"]
        save()

    env, extra = _child_env_args()
    t_start = time.perf_counter()
    for attempt in range(1, len(pairs) + 2):
        todo = [p for p in pairs if p not in records]
        if not todo:
            break
        remaining = deadline - time.monotonic()
        if remaining < 60:
            break
        tag = f"one_batch_{model_name}_{backend}" + (f"_{attempt}" if attempt > 1 else "")
        events_path, log_path = os.path.join(out_dir, tag + ".events.jsonl"), os.path.join(out_dir, tag + ".log")
        for p in (events_path, log_path):
            if os.path.exists(p):
                os.remove(p)
        bss = sorted({bs for bs, _ in todo})
        ils = sorted({il for _, il in todo})
        cmd = [sys.executable, os.path.abspath(__file__), CHILD_FLAG, events_path,
               ",".join(f"{bs}x{il}" for bs, il in todo),
               "--model-path", model_dir, "--load-format", "dummy", "--attention-backend", backend,
               "--page-size", "128", "--mem-fraction-static", str(args.mem_fraction_static),
               "--sampling-backend", "pytorch", "--batch-size", *map(str, bss), "--input-len", *map(str, ils),
               "--output-len", str(args.output_len), "--result-filename", os.path.join(out_dir, tag + ".jsonl"),
               *extra, *shlex.split(args.sglang_args)]
        log(f"one_batch {model_name} {backend}: child {attempt}, pairs {' '.join(f'{b}x{i}' for b, i in todo)}")
        t0 = time.monotonic()
        proc = _spawn(cmd, log_path, env)
        current, since, ended, n_seen = None, t0, None, 0
        while True:
            finished = proc.poll() is not None
            events = _read_events(events_path)
            for ev in events[n_seen:]:
                key = (ev["batch_size"], ev["input_len"])
                if ev["event"] == "start":
                    current, since = ev, time.monotonic()
                    continue
                if ev["event"] == "batch_size_warmup":  # the pair's untimed first run ended; the timed one follows
                    entry.setdefault("batch_size_warmups", []).append(ev)
                    continue
                current = None
                if ev.get("warmup"):
                    entry.setdefault("warmups", []).append(ev)
                    if ev["event"] != "result":
                        log(f"  warm-up {key[0]}x{key[1]}: {ev['event']} {ev.get('error', '')[:200]}")
                    continue
                if ev["event"] == "result":
                    rec = {"status": "ok", "result": ev["result"], "wall_s": ev["wall_s"]}
                    r = ev["result"]
                    log(f"  {backend} {key[0]}x{key[1]}: prefill {r['prefill_throughput']:,.0f} tok/s, "
                        f"decode {r.get('median_decode_throughput', 0):,.0f} tok/s")
                elif ev["event"] == "skipped":
                    rec = {"status": "skipped", "reason": ev["reason"]}
                else:
                    rec = {"status": ev["event"], "reason": ev["error"], "traceback": ev.get("traceback", "")}
                    log(f"  {backend} {key[0]}x{key[1]}: {ev['event']}: {ev['error'][:200]}")
                records[key] = rec
                publish()
            n_seen = len(events)
            if finished:
                break
            now = time.monotonic()
            if current is not None and now - since > args.run_timeout:
                ended = (f"timeout: {current['batch_size']}x{current['input_len']} ran past --run-timeout "
                         f"{args.run_timeout} s")
            elif current is None and n_seen == 0 and now - t0 > args.startup_timeout:
                ended = f"timeout: no run started within --startup-timeout {args.startup_timeout} s"
            elif now > deadline:
                ended = "time budget (--budget-s) exhausted"
            if ended:
                log(f"  {backend}: {ended}; stopping the child")
                _stop(proc)
                break
            time.sleep(1.0)
        rc = proc.returncode if ended is None else _stop(proc)
        if proc in _CHILDREN:
            _CHILDREN.remove(proc)
        tail = _tail(log_path)
        cap = re.findall(r"max_total_num_tokens=(\d+)", _tail(log_path, 10_000_000))
        if cap and entry["max_total_num_tokens"] is None:
            entry["max_total_num_tokens"] = int(cap[-1])
        entry["children"].append({"log": os.path.basename(log_path), "returncode": rc,
                                  "wall_s": time.monotonic() - t0, "ended": ended or f"exit {rc}"})
        entry.update(returncode=rc, log_tail=tail[-3000:])
        status = "timeout" if ended and ended.startswith("timeout") else ("not_run" if ended else "crashed")
        warm_fail = next((ev for ev in events if ev.get("warmup") and ev["event"] == "error"), None)
        if warm_fail is None and current is not None and current.get("warmup"):
            warm_fail = {**current, "event": status, "error": ended or f"child exited with {rc}"}
        if warm_fail is not None:
            # one_batch warms up on the smallest remaining batch size and input length: a failure there
            # (other than out of memory) would repeat in every restart, so the remaining pairs end here.
            for p in todo:
                records.setdefault(p, {"status": warm_fail["event"], "log_tail": tail, "reason":
                                       f"warm-up {warm_fail['batch_size']}x{warm_fail['input_len']} failed: "
                                       f"{warm_fail['error']}"})
        elif current is not None:
            key = (current["batch_size"], current["input_len"])
            records[key] = {"status": status, "reason": ended or f"child exited with {rc} during this run",
                            "log_tail": tail}
        elif not events:  # the child never got to a run: a restart would fail the same way
            for p in todo:
                records.setdefault(p, {"status": "error" if not ended else status, "log_tail": tail,
                                       "reason": ended or f"child exited with {rc} before any run"})
        for p in todo:  # errors recorded by the child itself: add the end of its log
            if p in records and records[p]["status"] == "error" and "log_tail" not in records[p]:
                records[p]["log_tail"] = tail
        if not ended and all(p not in records for p in todo):  # exited without finishing any pair: no retry
            for p in todo:
                records[p] = {"status": "crashed", "reason": f"child exited with {rc} without finishing a pair",
                              "log_tail": tail}
        publish()
        if ended == "time budget (--budget-s) exhausted":
            break
    for p in pairs:
        records.setdefault(p, {"status": "not_run", "reason": "time budget (--budget-s) exhausted or retries spent"})
    entry["wall_s"] = time.perf_counter() - t_start
    publish()


def one_batch_step(out_dir, args, deadline, results, save) -> None:
    pairs = [(bs, il) for bs in sorted(args.batch_sizes) for il in sorted(args.input_lens)]
    by_model = results.setdefault("one_batch_by_model", {})
    for model_name in args.models:
        ctx = _context_len(max(args.input_lens), args.output_len)
        model_dir = _model(out_dir, model_name, ctx)
        by_model[model_name] = {}
        results.setdefault("one_batch_models", {})[model_name] = {**MODELS[model_name], "context_len": ctx,
                                                                  "vocab_size": 32000, "load_format": "dummy"}
        if model_name == "gqa64x4":
            results["one_batch"] = by_model[model_name]  # the key of earlier runs, same shape
        for backend in args.one_batch_backends:
            by_model[model_name][backend] = entry = {}
            one_batch_backend(out_dir, model_name, model_dir, backend, pairs, args, deadline, entry, save)
            ok = sum(a["status"] == "ok" for a in entry["attempts"])
            log(f"one_batch {model_name} {backend}: {ok}/{len(pairs)} ok, capacity {entry['max_total_num_tokens']}")


# ---- offline --------------------------------------------------------------------------------------------------
def offline_child(argv: list) -> None:
    """Child process: ``sglang_nvfp4.bench_offline_throughput ARGS``. SGLang's benchmark datasets
    package imports Hugging Face ``datasets`` at import time (for MMMU only); the GPU host has none,
    so a stand-in that raises on use is installed when it is missing."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")

        def load_dataset(*a, **k):
            raise ImportError("Hugging Face 'datasets' is not installed (bench_e2e.py stand-in)")

        stub.load_dataset = load_dataset
        sys.modules["datasets"] = stub
    import sglang.benchmark.offline_throughput as ot

    from sglang_nvfp4.bench_offline_throughput import main as offline_main

    # SGLang's warm-up is 16 random 256-token requests, which leaves the long-context shapes (chunked
    # prefill over a cached prefix, decode at 20K+ tokens) to compile inside the timed run. Warm up on
    # the benchmark's own requests instead, then empty the radix cache so the timed run starts cold.
    dataset, calls = [], [0]
    original_get_dataset, original_once = ot.get_dataset, ot.throughput_test_once

    def get_dataset(*a, **k):
        dataset[:] = original_get_dataset(*a, **k)
        return list(dataset)

    def throughput_test_once(backend_name, backend, reqs, *a, **k):
        calls[0] += 1
        if calls[0] > 1:
            return original_once(backend_name, backend, reqs, *a, **k)
        t0 = time.perf_counter()
        original_once(backend_name, backend, dataset, *a, **k)
        backend.flush_cache()
        print(f"bench_e2e warm-up: the benchmark's {len(dataset)} requests once, then flush_cache "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        return None

    ot.get_dataset, ot.throughput_test_once = get_dataset, throughput_test_once
    sys.argv = ["sglang_nvfp4.bench_offline_throughput", *argv]
    offline_main()


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


def _prefill_stats(text: str) -> dict:
    """Sums of the scheduler's 'Prefill batch' lines after the benchmark's start (warm-up excluded)."""
    start = text.rfind("Benchmark...")
    body = text[start:] if start >= 0 else text
    new = [int(v) for v in re.findall(r"Prefill batch.*?#new-token: (\d+)", body)]
    hit = [int(v) for v in re.findall(r"Prefill batch.*?#cached-token: (\d+)", body)]
    return {"prefill_batches": len(new), "prefill_new_tokens": sum(new), "prefill_cached_tokens": sum(hit),
            "after_benchmark_marker": start >= 0}


def offline_step(out_dir, args, backends, deadline, save, results: dict) -> dict:
    ctx = 131072
    model = _model(out_dir, args.offline_model, ctx)
    stub = _write_sharegpt_stub(os.path.join(out_dir, "sharegpt_stub.json"))
    gsp = ["--dataset-name", "generated-shared-prefix", "--dataset-path", stub,
           "--gsp-num-groups", str(args.offline_groups), "--gsp-prompts-per-group", str(args.offline_prompts_per_group),
           "--gsp-system-prompt-len", str(args.offline_system_prompt_len),
           "--gsp-question-len", str(args.offline_question_len), "--gsp-output-len", str(args.offline_output_len),
           "--seed", "42"]
    results.update(model={"name": args.offline_model, **MODELS[args.offline_model], "context_len": ctx,
                          "vocab_size": 32000, "load_format": "dummy"}, dataset_args=gsp[:2] + gsp[4:])
    env, extra = _child_env_args()
    for backend in backends:
        remaining = deadline - time.monotonic()
        if remaining < 90:
            results[backend] = {"skipped": f"time budget: {remaining:.0f} s left (< 90 s)"}
            log(f"offline {backend}: skipped, {remaining:.0f} s of the budget left")
            continue
        jsonl = os.path.join(out_dir, f"offline_{backend}.jsonl")
        log_path = os.path.join(out_dir, f"offline_{backend}.log")
        for p in (jsonl, log_path):
            if os.path.exists(p):
                os.remove(p)
        cmd = [sys.executable, os.path.abspath(__file__), OFFLINE_CHILD_FLAG, "--model-path", model,
               "--load-format", "dummy", "--attention-backend", backend, "--page-size", "128",
               "--sampling-backend", "pytorch", "--mem-fraction-static", str(args.mem_fraction_static),
               *gsp, "--result-filename", jsonl, *extra, *shlex.split(args.sglang_args)]
        limit = min(args.offline_timeout, remaining - 20)
        log(f"offline {backend}: {' '.join(cmd[3:])} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        proc = _spawn(cmd, log_path, env)
        timed_out, result_at = False, None
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > limit:
                timed_out = True
                log(f"  offline {backend}: past {limit:.0f} s, stopping it")
                break
            if result_at is None and os.path.exists(jsonl):
                result_at = now  # written after the engine's shutdown: the process has nothing left to do
            if result_at is not None and now - result_at > 20:
                log(f"  offline {backend}: result written, process still up after 20 s; stopping it")
                break
            time.sleep(1.0)
        rc = _stop(proc)
        text = _tail(log_path, 50_000_000)
        res = [json.loads(line) for line in open(jsonl)] if os.path.exists(jsonl) else []
        sys_len = re.findall(r"Average system prompt length: ([\d.]+) tokens", text)
        results[backend] = {"returncode": rc, "timed_out": timed_out, "wall_s": time.monotonic() - t0,
                            "result": res[-1] if res else None, "result_file": os.path.basename(jsonl),
                            "avg_system_prompt_tokens": float(sys_len[0]) if sys_len else None,
                            **_prefill_stats(text), "log_tail": text[-3000:]}
        if res:
            r = res[-1]
            log(f"  offline {backend}: output {r['output_throughput']:,.0f} tok/s, input {r['input_throughput']:,.0f} "
                f"tok/s, {r['total_latency']:.2f} s; prefill computed {results[backend]['prefill_new_tokens']:,}, "
                f"cached {results[backend]['prefill_cached_tokens']:,} tokens")
        else:
            log(f"  offline {backend}: no result (rc {rc}, timed out {timed_out})")
        save()
    a, b = (results.get(k, {}).get("result") for k in BACKENDS)
    if a and b:
        results["ratio_nvfp4_over_triton"] = {k: a[k] / b[k] for k in ("output_throughput", "input_throughput",
                                                                         "total_throughput") if b.get(k)}
    return results


# ---- plot -------------------------------------------------------------------------------------------------------
def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    by_model = results.get("one_batch_by_model")
    if not by_model and results.get("one_batch"):
        ob = results["one_batch"]
        by_model = {"gqa64x4": ob.get("results", ob)}  # bench/results/e2e_h200.json nests them under "results"
    by_model = by_model or {}
    offline = {k: v["result"] for k, v in (results.get("offline") or {}).items()
               if isinstance(v, dict) and v.get("result")}
    if not any(res.get("runs") for backends in by_model.values() for res in backends.values()) and not offline:
        return
    fig, ax = plt.subplots(1, 3 if offline else 2, figsize=(16 if offline else 11, 4.5))
    colors = {"nvfp4_sparse": "tab:red", "triton": "tab:blue", "torch_native": "tab:green"}
    markers = ["o", "s", "^", "D"]
    styles = ["-", "--", ":", "-."]
    batch_sizes = sorted({r["batch_size"] for backends in by_model.values() for res in backends.values()
                          for r in res.get("runs", [])})
    for mi, (model, backends) in enumerate(by_model.items()):
        for backend, res in backends.items():
            for bs in batch_sizes:
                runs = sorted((r for r in res.get("runs", []) if r.get("batch_size") == bs),
                              key=lambda r: r["input_len"])
                if not runs:
                    continue
                label = f"{backend} bs{bs}" + (f" {model}" if len(by_model) > 1 else "")
                style = dict(color=colors.get(backend), marker=markers[mi % 4],
                             linestyle=styles[batch_sizes.index(bs) % 4], label=label)
                x = [r["input_len"] for r in runs]
                ax[0].plot(x, [r["prefill_throughput"] for r in runs], **style)
                ax[1].plot(x, [r.get("median_decode_throughput", 0) for r in runs], **style)
    ax[0].set(xscale="log", yscale="log", xlabel="input length", ylabel="prefill tokens/s", title="one_batch prefill")
    ax[1].set(xscale="log", yscale="log", xlabel="input length", ylabel="decode tokens/s", title="one_batch decode")
    lens = sorted({r["input_len"] for backends in by_model.values() for res in backends.values()
                   for r in res.get("runs", [])})
    for a in ax[:2]:
        if a.get_lines():
            a.legend(fontsize=7)
        a.grid(alpha=0.3)
        if lens:
            a.set_xticks(lens, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lens])
            a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if offline:
        names = list(offline)
        bars = ax[2].bar(names, [offline[n]["output_throughput"] for n in names],
                         color=[colors.get(n, "gray") for n in names])
        for bar, n in zip(bars, names):
            ax[2].annotate(f"in {offline[n]['input_throughput']:,.0f} tok/s\n{offline[n]['total_latency']:.1f} s",
                           (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
        ax[2].set(ylabel="output tokens/s", title="offline_throughput, generated-shared-prefix")
        ax[2].margins(y=0.2)
        ax[2].grid(alpha=0.3, axis="y")
    models = ", ".join(f"{m} ({v.get('hidden_size', '?')} hidden, {v.get('layers', '?')} layers)"
                       for m, v in (results.get("one_batch_models") or {"gqa64x4": MODELS["gqa64x4"]}).items())
    fig.suptitle(f"SGLang 0.5.23, dummy weights: {models}; {results.get('gpu', 'GPU')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main -------------------------------------------------------------------------------------------------------
def _save(results: dict, out_dir: str) -> None:
    tmp = os.path.join(out_dir, "e2e.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=float)
    os.replace(tmp, os.path.join(out_dir, "e2e.json"))


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD_FLAG:
        one_batch_child(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == OFFLINE_CHILD_FLAG:
        offline_child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder (required unless --replot)")
    ap.add_argument("--replot", metavar="E2E_JSON", help="only redraw the plot of an e2e.json (next to it)")
    ap.add_argument("--steps", default="server,one_batch", help="comma list of one_batch, offline, server")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="stop starting work after this many seconds; running children are stopped (default 520)")
    ap.add_argument("--backends", nargs="+", default=list(ONE_BATCH_BACKENDS),
                    help="one_batch runs all of them; server and offline skip torch_native")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8, help="one_batch and offline")
    ap.add_argument("--sglang-args", default="", help="extra SGLang server arguments for one_batch and offline "
                    "(one string, given with '=': --sglang-args='--max-total-tokens 65536')")
    g = ap.add_argument_group("one_batch")
    g.add_argument("--models", default="gqa64x4", help=f"comma list of {', '.join(MODELS)}")
    g.add_argument("--input-lens", type=int, nargs="+", default=[8192, 32768])
    g.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    g.add_argument("--output-len", type=int, default=16)
    g.add_argument("--torch-native-max-tokens", type=int, default=32768,
                   help="torch_native runs only batch x input <= this (others: recorded as skipped)")
    g.add_argument("--run-timeout", type=float, default=180.0, help="seconds one (batch, input) pair may run")
    g.add_argument("--startup-timeout", type=float, default=240.0, help="seconds a child may take to its first run")
    g = ap.add_argument_group("offline (generated-shared-prefix)")
    g.add_argument("--offline-model", default="gqa64x4", choices=list(MODELS))
    g.add_argument("--offline-groups", type=int, default=4)
    g.add_argument("--offline-prompts-per-group", type=int, default=32)
    g.add_argument("--offline-system-prompt-len", type=int, default=16384,
                   help="tokens drawn; re-tokenized text is ~1.46x longer with the tiny tokenizer (~24K)")
    g.add_argument("--offline-question-len", type=int, default=128)
    g.add_argument("--offline-output-len", type=int, default=128)
    g.add_argument("--offline-timeout", type=float, default=300.0, help="seconds per backend")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.join(os.path.dirname(os.path.abspath(args.replot)), "e2e.png"))
        return
    if not args.out:
        ap.error("--out is required")
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {list(MODELS)}")
    steps = [s for s in args.steps.split(",") if s]
    if set(steps) - {"one_batch", "offline", "server"}:
        ap.error(f"--steps: unknown {sorted(set(steps) - {'one_batch', 'offline', 'server'})}")
    args.one_batch_backends = list(args.backends)
    dense_pair = [b for b in args.backends if b != "torch_native"]
    deadline = time.monotonic() + args.budget_s
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.makedirs(args.out, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "budget_s": args.budget_s}
    try:
        import torch

        if torch.cuda.is_available():
            results["gpu"] = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    except Exception:  # noqa: BLE001
        pass

    def save() -> None:
        _save(results, args.out)

    try:
        if "one_batch" in steps:
            one_batch_step(args.out, args, deadline, results, save)
            save()
        if "offline" in steps:
            offline_step(args.out, args, dense_pair, deadline, save, results.setdefault("offline", {}))
            save()
        if "server" in steps:
            try:
                server_step(args.out, dense_pair, deadline, save, results.setdefault("server", {}))
            except Exception as e:  # keep the other steps' numbers; the failure is recorded
                results["server_error"] = repr(e)
                log(f"server step failed: {e!r}")
    finally:
        for proc in list(_CHILDREN):
            _stop(proc, grace=5.0)
        results["wall_s"] = args.budget_s - (deadline - time.monotonic())
        save()
    try:
        plot(results, os.path.join(args.out, "e2e.png"))
    except Exception as e:  # noqa: BLE001 - the JSON is the record
        log(f"plot failed: {e!r}")
    log("done")


if __name__ == "__main__":
    main()
