"""Serve the trained retrieval model with SGLang and score it: dense backend vs ``nvfp4_sparse`` settings.

``python -m sglang_nvfp4.quality.evaluate --model DIR --out OUT [--lengths ...] [--settings ...]``

Every setting is one real ``sglang.launch_server`` (:class:`~sglang_nvfp4.local_server.LocalServer`) with
the same prompts (:func:`~sglang_nvfp4.quality.task.make_prompts`, families ``--families``), greedy, one new
token. Per prompt we record whether it is answered (``single``: the greedy token is the value; ``pair``: the
top-2 next tokens are the key's two values) and the answers' mean log-probability; per setting and family,
accuracy by context length (95% Wilson intervals) and by record depth, and against the dense setting the
accuracy difference over the same prompts (95% paired interval), greedy agreement and answer log-probability
deltas. Writes ``OUT/quality.json``, ``OUT/quality.md`` and ``OUT/quality.png``.

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
from .stats import paired_difference_interval, wilson_interval

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
                extra_args=(), gpu: str | None = None, prefixes=(), log=print) -> list[dict]:
    """Serve ``prompts`` under ``setting``; one row per prompt: the prompt's ``family``, ``length``, ``depth``,
    ``second_depth``, ``target_depth`` and ``answers``, the greedy ``token``, ``correct``
    (:func:`~.task.is_correct`; ``pair`` rows also carry the ``top_tokens``, the two most likely ids) and
    ``answer_logprob`` (the mean log-probability of the answers).

    ``prefixes`` (token arrays, e.g. :func:`~.task.make_shared_prompts` documents) are served first, one at
    a time, their outputs unused: each enters the radix cache, so prompts that extend it attend its cached
    pages instead of prefilling the same document once per prompt of a batch."""
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
        for prefix in prefixes:
            srv.post("/generate", {"text": task.to_text(prefix), "sampling_params": {"max_new_tokens": 1}})
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            out = srv.post("/generate", {
                "text": [task.to_text(p.tokens) for p in chunk],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "token_ids_logprob": [list(p.answers) for p in chunk],
                "top_logprobs_num": [2 if p.family == "pair" else 0 for p in chunk],
            })
            for p, r in zip(chunk, out):
                meta = r["meta_info"]
                if meta["prompt_tokens"] != len(p.tokens):
                    raise RuntimeError(f"tokenizer mismatch: {meta['prompt_tokens']} != {len(p.tokens)} tokens")
                token = meta["output_token_logprobs"][0][1]
                answer_logprobs = {tid: lp for lp, tid, _ in meta["output_token_ids_logprobs"][0]}
                row = {"family": p.family, "length": p.length, "depth": p.depth, "second_depth": p.second_depth,
                       "target_depth": p.target_depth, "answers": list(p.answers), "token": token,
                       "answer_logprob": statistics.fmean(answer_logprobs[a] for a in p.answers)}
                if p.family == "pair":
                    row["top_tokens"] = [tid for _, tid, _ in meta["output_top_logprobs"][0]]
                row["correct"] = task.is_correct(p.answers, row.get("top_tokens", [token]))
                rows.append(row)
        log(f"[{setting.name}] {len(rows)} prompts in {time.perf_counter() - t0:.0f} s, "
            f"accuracy {accuracy(rows):.3f}")
    return rows


def accuracy(rows) -> float:
    return sum(r["correct"] for r in rows) / max(1, len(rows))


def family_of(row: dict) -> str:
    """The row's prompt family (rows written before the ``pair`` family existed are ``single``)."""
    return row.get("family", "single")


def _families(rows) -> list[str]:
    present = {family_of(r) for r in rows}
    return [f for f in task.FAMILIES if f in present] + sorted(present - set(task.FAMILIES))


def _accuracy_ci(rows) -> dict:
    """``{"accuracy", "ci95": [lo, hi] (Wilson), "prompts"}``."""
    hits = sum(r["correct"] for r in rows)
    return {"accuracy": accuracy(rows), "ci95": list(wilson_interval(hits, len(rows))), "prompts": len(rows)}


def _delta_points(pairs) -> dict:
    """``{"delta_points", "ci95_points": [lo, hi]}``: accuracy difference over ``pairs`` of rows
    ``(setting's, baseline's)`` for the same prompt, in points, with the paired 95% interval."""
    d, lo, hi = paired_difference_interval([a["correct"] for a, _ in pairs], [b["correct"] for _, b in pairs])
    return {"delta_points": round(100 * d, 2), "ci95_points": [round(100 * lo, 2), round(100 * hi, 2)]}


def summarize(results: dict[str, list[dict]], baseline: str) -> dict:
    """Per setting: ``accuracy``, ``prompts`` and ``by_length`` (``{length: accuracy}``) over all prompts;
    ``families``: per family ``{"accuracy", "ci95", "prompts", "by_length": {length: {"accuracy", "ci95",
    "prompts"}}, "by_length_depth": {"LENGTH@DEPTH": accuracy}}``. Every setting but ``baseline`` also gets
    ``vs_<baseline>``: ``accuracy_delta_points``, ``greedy_agreement``, ``answer_logprob_abs_delta_mean`` /
    ``_max`` over all prompts, and ``families``: per family ``{"delta_points", "ci95_points", "by_length":
    {length: {"delta_points", "ci95_points"}}}`` (paired intervals; rows of a setting and of the baseline
    are the same prompts in the same order)."""
    summary = {}
    base = results.get(baseline)
    for name, rows in results.items():
        families = {}
        for family in _families(rows):
            fam = [r for r in rows if family_of(r) == family]
            lengths = sorted({r["length"] for r in fam})
            depths = sorted({r["target_depth"] for r in fam})
            families[family] = {
                **_accuracy_ci(fam),
                "by_length": {str(n): _accuracy_ci([r for r in fam if r["length"] == n]) for n in lengths},
                "by_length_depth": {f"{n}@{d}": accuracy([r for r in fam if r["length"] == n and r["target_depth"] == d])
                                    for n in lengths for d in depths}}
        s = {"accuracy": accuracy(rows), "prompts": len(rows),
             "by_length": {str(n): accuracy([r for r in rows if r["length"] == n])
                           for n in sorted({r["length"] for r in rows})},
             "families": families}
        if base is not None and name != baseline:
            prompt_of = [(family_of(r), r["length"], r["target_depth"]) for r in rows]
            if prompt_of != [(family_of(r), r["length"], r["target_depth"]) for r in base]:
                raise ValueError(f"{name} and {baseline} rows are not the same prompts")
            deltas = [abs(a["answer_logprob"] - b["answer_logprob"]) for a, b in zip(rows, base)]
            vs = {}
            for family in families:
                pairs = [(a, b) for a, b in zip(rows, base) if family_of(a) == family]
                vs[family] = {**_delta_points(pairs), "by_length": {
                    n: _delta_points([(a, b) for a, b in pairs if str(a["length"]) == n])
                    for n in families[family]["by_length"]}}
            s["vs_" + baseline] = {
                "accuracy_delta_points": round(100 * (s["accuracy"] - accuracy(base)), 2),
                "greedy_agreement": sum(a["token"] == b["token"] for a, b in zip(rows, base)) / len(rows),
                "answer_logprob_abs_delta_mean": statistics.fmean(deltas),
                "answer_logprob_abs_delta_max": max(deltas),
                "families": vs,
            }
        summary[name] = s
    return summary


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


CRITERION = {"single": "greedy token == the value", "pair": "top-2 next tokens == the key's two values"}


def markdown(summary: dict, baseline: str) -> str:
    """One table per family (accuracy per length with its 95% Wilson interval, then the difference to
    ``baseline`` per length in points with its 95% paired interval) and one table over all prompts."""
    names = list(summary)
    families = list(dict.fromkeys(f for s in summary.values() for f in s["families"]))
    lines = []
    for family in families:
        present = [name for name in names if family in summary[name]["families"]]
        by_length = summary[present[0]]["families"][family]["by_length"]
        lengths = list(by_length)
        counts = "/".join(sorted({str(c["prompts"]) for c in by_length.values()}, key=int))
        lines += [f"**{family}** ({CRITERION.get(family, family)}; {counts} prompts per length; accuracy and "
                  f"difference to {baseline} in points, with 95% intervals)", "",
                  "| setting | " + " | ".join(f"acc @{_tokens(int(n))}" for n in lengths) + " | " +
                  " | ".join(f"vs {baseline} @{_tokens(int(n))}" for n in lengths) + " |",
                  "|" + " --- |" * (2 * len(lengths) + 1)]
        for name in present:
            fam = summary[name]["families"][family]
            vs = summary[name].get("vs_" + baseline, {}).get("families", {}).get(family)
            cells = [f"{fam['by_length'][n]['accuracy']:.3f} [{fam['by_length'][n]['ci95'][0]:.2f}, "
                     f"{fam['by_length'][n]['ci95'][1]:.2f}]" for n in lengths]
            if vs:
                cells += [f"{vs['by_length'][n]['delta_points']:+.1f} [{vs['by_length'][n]['ci95_points'][0]:+.1f}, "
                          f"{vs['by_length'][n]['ci95_points'][1]:+.1f}]" for n in lengths]
            else:
                cells += ["(baseline)" if name == baseline else "", *[""] * (len(lengths) - 1)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**all prompts**", "",
              f"| setting | accuracy | vs {baseline} (points) | greedy agree | mean abs dlogp(answers) |",
              "| --- | --- | --- | --- | --- |"]
    for name in names:
        s = summary[name]
        vs = s.get("vs_" + baseline)
        lines.append(f"| {name} | {s['accuracy']:.3f} | " +
                     (f"{vs['accuracy_delta_points']:+.1f} | {vs['greedy_agreement']:.3f} | "
                      f"{vs['answer_logprob_abs_delta_mean']:.4f} |" if vs else "(baseline) | | |"))
    return "\n".join(lines) + "\n"


def plot_if_possible(summary: dict, path: str) -> None:
    """:func:`plot` to ``path``, or a note where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401  (optional: the plot is skipped where it is not installed)
    except ImportError:
        print(f"matplotlib not installed: no {os.path.basename(path)}", flush=True)
    else:
        plot(summary, path)


def plot(summary: dict, path: str) -> None:
    """Per family (one row of panels): accuracy vs context length (band: 95% Wilson interval) and vs
    target record depth at the longest length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(f for s in summary.values() for f in s["families"]))
    fig, axes = plt.subplots(len(families), 2, figsize=(12, 4.2 * len(families)), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(summary)}
    for ax, family in zip(axes, families):
        present = {name: s["families"][family] for name, s in summary.items() if family in s["families"]}
        longest = max(int(n) for fam in present.values() for n in fam["by_length"])
        for name, fam in present.items():
            lengths = [int(n) for n in fam["by_length"]]
            cells = list(fam["by_length"].values())
            ax[0].plot(lengths, [c["accuracy"] for c in cells], "o-", color=colors[name], label=name)
            ax[0].fill_between(lengths, [c["ci95"][0] for c in cells], [c["ci95"][1] for c in cells],
                               color=colors[name], alpha=0.12)
            depth = {float(k.split("@")[1]): v for k, v in fam["by_length_depth"].items() if int(k.split("@")[0]) == longest}
            ax[1].plot(list(depth), list(depth.values()), "o-", color=colors[name], label=name)
        ax[0].set(xscale="log", xlabel="context length (tokens)", ylabel="retrieval accuracy",
                  title=f"{family}: accuracy vs length")
        ax[1].set(xlabel="target record depth", ylabel="retrieval accuracy",
                  title=f"{family}: accuracy vs depth at {longest} tokens")
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
    ap.add_argument("--replot", metavar="QUALITY_JSON",
                    help="only redraw OUT/quality.png and OUT/quality.md from a saved run's rows")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS),
                    help="target record depths (pair prompts: the depth of the target record; the other record "
                         f"lies anywhere at least {task.PAIR_MIN_DISTANCE} tokens away)")
    ap.add_argument("--families", nargs="+", choices=task.FAMILIES, default=list(task.FAMILIES),
                    help=f"prompt families (pair needs lengths >= {task.PAIR_MIN_LENGTH})")
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
            summary = summarize(json.load(f)["rows"], "dense")
        with open(os.path.join(args.out, "quality.md"), "w") as f:
            f.write(markdown(summary, "dense"))
        plot_if_possible(summary, os.path.join(args.out, "quality.png"))
        return
    if not args.model:
        ap.error("--model is required")
    settings = [Setting("dense", args.dense_backend), *map(Setting.parse, args.settings)]
    prompts = [p for family in args.families
               for p in task.make_prompts(args.seed, args.lengths, args.depths, args.per_cell, family)]
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
    if summary:
        plot_if_possible(summary, os.path.join(args.out, "quality.png"))
    if errors:
        sys.exit(f"settings failed: {sorted(errors)}")


if __name__ == "__main__":
    main()
