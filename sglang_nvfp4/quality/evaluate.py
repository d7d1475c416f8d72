"""Serve the trained retrieval model with SGLang and score it: dense backend vs ``nvfp4_sparse`` settings.

``python -m sglang_nvfp4.quality.evaluate --model DIR --out OUT [--lengths ...] [--settings ...]``

Every setting is one real ``sglang.launch_server`` (:class:`~sglang_nvfp4.local_server.LocalServer`) with
the same prompts (:func:`~sglang_nvfp4.quality.task.make_prompts`), greedy, one new token. Per prompt we
record whether the greedy token is the target value and the log-probability of that value; per setting,
accuracy by context length and by record depth, and the answer log-probability deltas against the dense
setting. Writes ``OUT/quality.json``, ``OUT/quality.md`` and ``OUT/quality.png``.

A setting is ``NAME=BACKEND[:VAR=VALUE,...]``; variables are the backend's ``NVFP4_SPARSE_*`` names without
the prefix, e.g. ``top8=nvfp4_sparse:TOPK=8``. ``dense`` names the baseline the deltas refer to.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from .. import format as fmt
from ..local_server import LocalServer, cuda_available
from . import task

DEFAULT_SETTINGS = (
    "nvfp4_all_dense=nvfp4_sparse:DENSE_LAYERS=all",
    "top16_quest=nvfp4_sparse:TOPK=16",
    "top8_quest=nvfp4_sparse:TOPK=8",
    "top4_quest=nvfp4_sparse:TOPK=4",
    "top16_mean=nvfp4_sparse:TOPK=16,INDEXER=mean",
    "top16_no_sink_local=nvfp4_sparse:TOPK=16,SINK_BLOCKS=0,LOCAL_BLOCKS=0",
    "top16_sink2_local4=nvfp4_sparse:TOPK=16,SINK_BLOCKS=2,LOCAL_BLOCKS=4",
)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Setting:
    name: str
    backend: str
    env: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "Setting":
        name, sep, rest = spec.partition("=")
        backend, _, assigns = rest.partition(":")
        if not sep or not name or not backend:
            raise ValueError(f"setting {spec!r}: expected NAME=BACKEND[:VAR=VALUE,...]")
        env = {}
        for item in filter(None, assigns.split(",")):
            var, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"setting {spec!r}: {item!r} is not VAR=VALUE")
            env["NVFP4_SPARSE_" + var.strip().upper()] = value.strip()
        return cls(name, backend, env)


def default_dense_backend() -> str:
    return "triton" if cuda_available() else "torch_native"


def run_setting(model_dir: str, setting: Setting, prompts, *, out_dir: str, batch: int = 16,
                extra_args=(), gpu: str | None = None, log=print) -> list[dict]:
    """Serve ``prompts`` under ``setting``; one row per prompt: ``token``, ``correct``, ``answer_logprob``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_SPARSE_")}
    env.update(setting.env)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    # A fixed pool (--max-total-tokens) instead of a memory fraction: several servers share a GPU, and
    # the pool only needs one batch of prompts. Decode CUDA graphs are off: every request is prefill only.
    longest = max(len(p.tokens) for p in prompts)
    args = ["--page-size", str(fmt.PAGE_SIZE), "--disable-cuda-graph", "--context-length", str(longest + 8),
            "--max-total-tokens", str(max(batch * (longest + 256), 65536)), *extra_args]
    rows = []
    t0 = time.perf_counter()
    with LocalServer(model_dir, setting.backend, extra_args=args, env=env, startup_timeout=600,
                     log_path=os.path.join(out_dir, f"server_{setting.name}.log")) as srv:
        log(f"[{setting.name}] server up after {time.perf_counter() - t0:.0f} s")
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            out = srv.post("/generate", {
                "text": [task.to_text(p.tokens) for p in chunk],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "token_ids_logprob": [[p.answer] for p in chunk],
            })
            for p, r in zip(chunk, out):
                meta = r["meta_info"]
                if meta["prompt_tokens"] != len(p.tokens):
                    raise RuntimeError(f"tokenizer mismatch: {meta['prompt_tokens']} != {len(p.tokens)} tokens")
                token = meta["output_token_logprobs"][0][1]
                rows.append({"length": p.length, "depth": p.depth, "target_depth": p.target_depth,
                             "token": token, "correct": token == p.answer,
                             "answer_logprob": meta["output_token_ids_logprobs"][0][0][0]})
        log(f"[{setting.name}] {len(rows)} prompts in {time.perf_counter() - t0:.0f} s, "
            f"accuracy {accuracy(rows):.3f}")
    return rows


def accuracy(rows) -> float:
    return sum(r["correct"] for r in rows) / max(1, len(rows))


def summarize(results: dict[str, list[dict]], baseline: str) -> dict:
    """Accuracy by length and by (length, target depth); answer-logprob deltas and greedy agreement vs
    ``baseline``."""
    summary = {}
    base = results.get(baseline)
    for name, rows in results.items():
        lengths = sorted({r["length"] for r in rows})
        s = {"accuracy": accuracy(rows), "prompts": len(rows),
             "by_length": {str(n): accuracy([r for r in rows if r["length"] == n]) for n in lengths},
             "by_length_depth": {f"{n}@{d}": accuracy([r for r in rows if r["length"] == n and r["target_depth"] == d])
                                 for n in lengths for d in sorted({r["target_depth"] for r in rows})}}
        if base is not None and name != baseline:
            deltas = [abs(a["answer_logprob"] - b["answer_logprob"]) for a, b in zip(rows, base)]
            s["vs_" + baseline] = {
                "accuracy_delta_points": round(100 * (s["accuracy"] - accuracy(base)), 2),
                "greedy_agreement": sum(a["token"] == b["token"] for a, b in zip(rows, base)) / len(rows),
                "answer_logprob_abs_delta_mean": statistics.fmean(deltas),
                "answer_logprob_abs_delta_max": max(deltas),
                "by_length_points": {n: round(100 * (v - summary[baseline]["by_length"][n]), 2)
                                     for n, v in s["by_length"].items()} if baseline in summary else None,
            }
        summary[name] = s
    return summary


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(summary: dict, baseline: str) -> str:
    names = list(summary)
    lengths = list(summary[names[0]]["by_length"])
    head = "| setting | " + " | ".join(f"acc @{_tokens(int(n))}" for n in lengths) + \
        " | all | vs dense (points) | greedy agree | mean abs dlogp(answer) |"
    lines = [head, "|" + " --- |" * (len(lengths) + 5)]
    for name in names:
        s = summary[name]
        vs = s.get("vs_" + baseline)
        lines.append(f"| {name} | " + " | ".join(f"{s['by_length'][n]:.3f}" for n in lengths) +
                     f" | {s['accuracy']:.3f} | " +
                     (f"{vs['accuracy_delta_points']:+.1f} | {vs['greedy_agreement']:.3f} | "
                      f"{vs['answer_logprob_abs_delta_mean']:.4f} |" if vs else "(baseline) | | |"))
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    longest = max(int(n) for n in next(iter(summary.values()))["by_length"])
    for name, s in summary.items():
        lengths = [int(n) for n in s["by_length"]]
        ax[0].plot(lengths, list(s["by_length"].values()), "o-", label=name)
        cells = {float(k.split("@")[1]): v for k, v in s["by_length_depth"].items() if int(k.split("@")[0]) == longest}
        ax[1].plot(list(cells), list(cells.values()), "o-", label=name)
    ax[0].set(xscale="log", xlabel="context length (tokens)", ylabel="retrieval accuracy", title="accuracy vs length")
    ax[1].set(xlabel="target record depth", ylabel="retrieval accuracy", title=f"accuracy vs depth at {longest} tokens")
    for a in ax:
        a.grid(alpha=0.3)
        a.set_ylim(-0.02, 1.02)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--replot", metavar="QUALITY_JSON", help="only redraw OUT/quality.png and OUT/quality.md from a saved run")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    ap.add_argument("--per-cell", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dense-backend", default=default_dense_backend())
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    ap.add_argument("--gpus", default="", help="comma-separated GPU ids; settings run in parallel on them")
    ap.add_argument("--servers-per-gpu", type=int, default=1, help="settings served at once on each GPU")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        with open(args.replot) as f:
            summary = json.load(f)["summary"]
        with open(os.path.join(args.out, "quality.md"), "w") as f:
            f.write(markdown(summary, "dense"))
        plot(summary, os.path.join(args.out, "quality.png"))
        return
    if not args.model:
        ap.error("--model is required")
    settings = [Setting("dense", args.dense_backend), *map(Setting.parse, args.settings)]
    prompts = task.make_prompts(args.seed, args.lengths, args.depths, args.per_cell)
    print(f"{len(prompts)} prompts, {len(settings)} settings", flush=True)
    results: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}
    queue = list(settings)
    lock = threading.Lock()

    def write_outputs() -> dict:
        ordered = {s.name: results[s.name] for s in settings if s.name in results}
        summary = summarize(ordered, "dense")
        with open(os.path.join(args.out, "quality.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "model": args.model,
                       "settings": {s.name: {"backend": s.backend, "env": s.env} for s in settings},
                       "summary": summary, "errors": errors, "rows": ordered}, f, indent=1)
        if ordered:
            with open(os.path.join(args.out, "quality.md"), "w") as f:
                f.write(markdown(summary, "dense"))
        return summary

    def worker(gpu):
        while True:
            with lock:
                if not queue:
                    return
                setting = queue.pop(0)
            try:
                rows = run_setting(args.model, setting, prompts, out_dir=args.out, batch=args.batch, gpu=gpu,
                                   log=lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
                with lock:
                    results[setting.name] = rows
            except Exception as e:  # recorded; the other settings still run
                with lock:
                    errors[setting.name] = repr(e)[-2000:]
                print(f"[{setting.name}] failed: {e!r}", flush=True)
            with lock:  # partial results survive a time-out of the whole run
                write_outputs()

    gpus = args.gpus.split(",") if args.gpus else [None]
    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus for _ in range(args.servers_per_gpu)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = write_outputs()
    if summary:
        print(markdown(summary, "dense"), flush=True)
    try:
        import matplotlib  # noqa: F401  (optional: the plot is skipped where it is not installed)
    except ImportError:
        print("matplotlib not installed: no quality.png", flush=True)
    else:
        if summary:
            plot(summary, os.path.join(args.out, "quality.png"))
    if errors:
        sys.exit(f"settings failed: {sorted(errors)}")


if __name__ == "__main__":
    main()
