"""``one_batch`` step of bench_e2e: ``sglang.benchmark.one_batch`` (through this file's child, which registers
the plugin first) on the dummy configs of ``--models`` (``e2e_models``): prefill latency/throughput and
decode throughput for every ``--batch-sizes`` x ``--input-lens`` pair (the config's context length is
raised to cover the longest input + ``--output-len``), and ``max_total_num_tokens`` (KV capacity) at the
same ``--mem-fraction-static``. Results go to ``e2e.json`` under ``one_batch_by_model`` (and, for
gqa64x4, ``one_batch``, the key of earlier runs).

one_batch warms up on its first pair only, so every other (batch size, input length) pair runs once untimed
before its timed run (events ``pair_warmup``): Triton kernels compile and autotune per shape, and SGLang's
in-tree kernels did so visibly (MiniMax-M3's 128K prefill: 1.20 s untimed, 0.35 s timed). One child process per (model, backend) runs all its
pairs: this file run as a script (``python bench/e2e_one_batch.py EVENTS PAIRS ARGS``, see
:func:`child_main`); each pair's result is recorded as soon as it ends. A pair that runs out of GPU memory
is recorded as ``oom`` and the child goes on; any other error, or a pair running past ``--run-timeout``,
ends the child (recorded with the tail of its log) and a fresh child runs the remaining pairs.
``torch_native`` runs only pairs with batch x input <= ``--torch-native-max-tokens`` (the others are
recorded as ``skipped`` with the reason). Every pair gets a ``status`` in ``attempts``: ok, oom, error,
timeout, crashed, skipped, not_run. Profiling: one_batch's own ``--profile`` options through ``--sglang-args``;
with ``SGLANG_TORCH_PROFILER_DIR`` set, each backend's traces go to a folder of that name under it, and with
``NVFP4_PROFILE_STACKS=0`` the traces hold no Python stacks (one_batch's profiler records them, at a large host cost).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time

from e2e_models import context_len, dummy_model, model_record
from harness import BenchRun, file_tail, log

MIN_SECONDS_LEFT = 60  # a child is started only with this much of the budget left
BUDGET_EXHAUSTED = "time budget (--budget-s) exhausted"


# ---- child process ----------------------------------------------------------------------------------------
def child_main(argv: list) -> None:
    """Child process: ``EVENTS BxI,BxI,... ONE_BATCH_ARGS...``. SGLang's one_batch with the plugin
    registered and its per-pair function wrapped: each pair's start and end go to EVENTS (JSON lines)
    at once, pairs not listed are passed over, an out-of-memory pair is recorded and the sweep goes
    on, any other error is recorded and ends the process (its CUDA context may be broken)."""
    events_path, todo_spec, *rest = argv
    todo = {tuple(int(v) for v in p.split("x")) for p in todo_spec.split(",")}
    if os.environ.get("SGLANG_TORCH_PROFILER_DIR"):  # one_batch's --profile traces: one folder per backend
        backend = rest[rest.index("--attention-backend") + 1]
        os.environ["SGLANG_TORCH_PROFILER_DIR"] = os.path.join(os.environ["SGLANG_TORCH_PROFILER_DIR"], backend)

    from sglang_nvfp4.sglang.plugin import register_and_apply

    register_and_apply()
    import gc
    import traceback

    import sglang.benchmark.one_batch as ob
    import torch

    if os.environ.get("NVFP4_PROFILE_STACKS") == "0":
        # one_batch's profiler records Python stacks, which slow the host several-fold; this one records none.
        def start_profile_without_stacks(profile_activities, profile_record_shapes=False, rank_print=print,
                                         trace_filename=None):
            kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
            profiler = torch.profiler.profile(activities=[kinds[a] for a in profile_activities if a in kinds],
                                              with_stack=False, record_shapes=profile_record_shapes)
            profiler.start()
            return profiler

        ob.start_profile = start_profile_without_stacks
    original = ob.latency_test_run_once
    calls = [0]
    warmed_pairs = set()

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
            if not warmup and (batch_size, input_len) not in warmed_pairs:
                # one_batch warms up its first pair only; a pair's first run would time one-time costs
                # (kernels compiling and autotuning for new shapes, allocator growth): an untimed run first.
                fresh = ob.prepare_synthetic_inputs_for_latency_test(batch_size, input_len)
                original(run_name, model_runner, rank_print, fresh, batch_size, input_len, min(32, output_len), *a, **k)
                emit(event="pair_warmup", wall_s=time.perf_counter() - t0, **key)
                t0 = time.perf_counter()
            warmed_pairs.add((batch_size, input_len))
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


# ---- parent -----------------------------------------------------------------------------------------------
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


class BackendSweep:
    """All ``pairs`` (batch size, input length) of one (model, backend), run by as many children as it takes
    (a fresh one after a child ends early), filling ``entry`` (``runs``, ``attempts``, ``children``, ...) and
    saving as pairs end. ``records`` holds the final word on each pair."""

    def __init__(self, bench: BenchRun, args, model_name: str, model_dir: str, backend: str, pairs: list,
                 entry: dict):
        self.bench, self.args, self.pairs, self.entry = bench, args, pairs, entry
        self.model_name, self.model_dir, self.backend = model_name, model_dir, backend
        self.records: dict = {}
        entry.update(runs=[], attempts=[], children=[], max_total_num_tokens=None, returncode=None, log_tail="")
        if backend == "torch_native":
            for bs, il in pairs:
                if bs * il > args.torch_native_max_tokens:
                    self.records[(bs, il)] = {"status": "skipped", "reason": f"torch_native: batch x input = "
                                              f"{bs * il} > --torch-native-max-tokens {args.torch_native_max_tokens}"}

    def publish(self) -> None:
        """``records`` into ``entry`` (in pair order), then save."""
        self.entry["attempts"] = [{"batch_size": bs, "input_len": il, **self.records[(bs, il)]}
                                  for bs, il in self.pairs if (bs, il) in self.records]
        self.entry["runs"] = [r["result"] for r in self.entry["attempts"] if r.get("status") == "ok"]
        self.bench.save()

    def run(self) -> None:
        t_start = time.perf_counter()
        for attempt in range(1, len(self.pairs) + 2):
            todo = [p for p in self.pairs if p not in self.records]
            if not todo or self.bench.left() < MIN_SECONDS_LEFT:
                break
            if self._run_child(attempt, todo) == BUDGET_EXHAUSTED:
                break
        for p in self.pairs:
            self.records.setdefault(p, {"status": "not_run",
                                        "reason": "time budget (--budget-s) exhausted or retries spent"})
        self.entry["wall_s"] = time.perf_counter() - t_start
        self.publish()

    def _child_command(self, events_path: str, result_path: str, todo: list) -> list:
        return [sys.executable, os.path.abspath(__file__), events_path, ",".join(f"{bs}x{il}" for bs, il in todo),
                "--model-path", self.model_dir, "--load-format", "dummy", "--attention-backend", self.backend,
                "--page-size", "128", "--mem-fraction-static", str(self.args.mem_fraction_static),
                "--sampling-backend", "pytorch", "--batch-size", *map(str, sorted({bs for bs, _ in todo})),
                "--input-len", *map(str, sorted({il for _, il in todo})), "--output-len", str(self.args.output_len),
                "--result-filename", result_path, *shlex.split(self.args.sglang_args)]

    def _run_child(self, attempt: int, todo: list) -> str | None:
        """One child for the pairs of ``todo``; returns why it was stopped (None: it exited by itself)."""
        tag = f"one_batch_{self.model_name}_{self.backend}" + (f"_{attempt}" if attempt > 1 else "")
        events_path, log_path = self.bench.path(tag + ".events.jsonl"), self.bench.path(tag + ".log")
        for p in (events_path, log_path):
            if os.path.exists(p):
                os.remove(p)
        cmd = self._child_command(events_path, self.bench.path(tag + ".jsonl"), todo)
        log(f"one_batch {self.model_name} {self.backend}: child {attempt}, pairs "
            f"{' '.join(f'{b}x{i}' for b, i in todo)}")
        t0 = time.monotonic()
        process = self.bench.start_child(cmd, log_path)
        events, current, ended = self._follow(process, events_path, t0)
        rc = self.bench.stop_child(process)
        tail = file_tail(log_path)
        cap = re.findall(r"max_total_num_tokens=(\d+)", file_tail(log_path, 10_000_000))
        if cap and self.entry["max_total_num_tokens"] is None:
            self.entry["max_total_num_tokens"] = int(cap[-1])
        self.entry["children"].append({"log": os.path.basename(log_path), "returncode": rc,
                                       "wall_s": time.monotonic() - t0, "ended": ended or f"exit {rc}"})
        self.entry.update(returncode=rc, log_tail=tail[-3000:])
        self._record_child_end(todo, events, current, ended, rc, tail)
        self.publish()
        return ended

    def _follow(self, process, events_path: str, t0: float) -> tuple[list, dict | None, str | None]:
        """Record the child's events as they come until it exits or must be stopped: past
        ``--run-timeout`` on one pair, no run started within ``--startup-timeout``, or the budget spent.
        Returns all its events, the run it was in (its start event) and why it must be stopped."""
        current, since, n_seen = None, t0, 0
        while True:
            finished = process.poll() is not None
            events = _read_events(events_path)
            for ev in events[n_seen:]:
                if ev["event"] == "start":
                    current, since = ev, time.monotonic()
                elif ev["event"] == "pair_warmup":  # the pair's untimed first run ended; the timed one follows
                    self.entry.setdefault("pair_warmups", []).append(ev)
                else:
                    current = None
                    self._record_event(ev)
            n_seen = len(events)
            if finished:
                return events, current, None
            ended = self._reason_to_stop(current, since, n_seen, t0)
            if ended:
                log(f"  {self.backend}: {ended}; stopping the child")
                return events, current, ended
            time.sleep(1.0)

    def _reason_to_stop(self, current: dict | None, since: float, n_seen: int, t0: float) -> str | None:
        now = time.monotonic()
        if current is not None and now - since > self.args.run_timeout:
            return (f"timeout: {current['batch_size']}x{current['input_len']} ran past --run-timeout "
                    f"{self.args.run_timeout} s")
        if current is None and n_seen == 0 and now - t0 > self.args.startup_timeout:
            return f"timeout: no run started within --startup-timeout {self.args.startup_timeout} s"
        if now > self.bench.deadline:
            return BUDGET_EXHAUSTED
        return None

    def _record_event(self, ev: dict) -> None:
        """The end of a run (result, skipped, oom, error): of the warm-up, kept aside; of a pair, its record."""
        key = (ev["batch_size"], ev["input_len"])
        if ev.get("warmup"):
            self.entry.setdefault("warmups", []).append(ev)
            if ev["event"] != "result":
                log(f"  warm-up {key[0]}x{key[1]}: {ev['event']} {ev.get('error', '')[:200]}")
            return
        if ev["event"] == "result":
            rec = {"status": "ok", "result": ev["result"], "wall_s": ev["wall_s"]}
            r = ev["result"]
            log(f"  {self.backend} {key[0]}x{key[1]}: prefill {r['prefill_throughput']:,.0f} tok/s, "
                f"decode {r.get('median_decode_throughput', 0):,.0f} tok/s")
        elif ev["event"] == "skipped":
            rec = {"status": "skipped", "reason": ev["reason"]}
        else:
            rec = {"status": ev["event"], "reason": ev["error"], "traceback": ev.get("traceback", "")}
            log(f"  {self.backend} {key[0]}x{key[1]}: {ev['event']}: {ev['error'][:200]}")
        self.records[key] = rec
        self.publish()

    def _record_child_end(self, todo: list, events: list, current: dict | None, ended: str | None, rc: int,
                          tail: str) -> None:
        """Records for the pairs of ``todo`` that the child's end decides: the run it died or was stopped in,
        or all of them where a restart would fail the same way."""
        records = self.records
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


def run_step(bench: BenchRun, args) -> None:
    """Every model of ``args.models`` with every backend of ``args.backends``."""
    pairs = [(bs, il) for bs in sorted(args.batch_sizes) for il in sorted(args.input_lens)]
    results = bench.results
    by_model = results.setdefault("one_batch_by_model", {})
    for model_name in args.models:
        ctx = context_len(max(args.input_lens), args.output_len)
        model_dir = dummy_model(bench.out_dir, model_name, ctx)
        by_model[model_name] = {}
        results.setdefault("one_batch_models", {})[model_name] = model_record(model_name, ctx)
        if model_name == "gqa64x4":
            results["one_batch"] = by_model[model_name]  # the key of earlier runs, same shape
        for backend in args.backends:
            by_model[model_name][backend] = entry = {}
            BackendSweep(bench, args, model_name, model_dir, backend, pairs, entry).run()
            ok = sum(a["status"] == "ok" for a in entry["attempts"])
            log(f"one_batch {model_name} {backend}: {ok}/{len(pairs)} ok, capacity {entry['max_total_num_tokens']}")


if __name__ == "__main__":
    child_main(sys.argv[1:])
