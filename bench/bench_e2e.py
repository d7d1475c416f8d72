"""End-to-end SGLang 0.5.23 runs on a GPU host: ``nvfp4_sparse`` against the dense backends ``flashinfer``
(FlashInfer 0.7.2; left out with a note where it is not installed), ``triton`` and, in ``one_batch``,
``torch_native``: same build, same model config, same flags. Writes ``e2e.json`` (after every finished
run, so a timeout still leaves numbers) with a ``summary`` of ``nvfp4_sparse`` over the strongest dense
backend per phase, named (``e2e_summary.py``), ``e2e.png``, and the raw logs, under ``--out``.

Steps (``--steps``, comma list, default ``server,one_batch``; they run in the order one_batch, offline, server,
chunked), one file each, whose docstring says what it measures (below, after the model configs of
``e2e_models.py``): ``e2e_one_batch.py``, ``e2e_offline.py``, ``e2e_server.py``, ``e2e_chunked.py``; the figure is
``e2e_plot.py``. ``server``, ``offline`` and ``chunked`` run the backends of ``--backends`` other than
``torch_native``. The whole script stops starting work at ``--budget-s`` seconds (children are stopped, the rest is
recorded as ``not_run``), so it ends inside one 10-minute device call.

``python bench/bench_e2e.py --out DIR`` (needs CUDA and SGLang; see bench/gpu_e2e.sh for the host set-up).
``python bench/bench_e2e.py --replot e2e.json`` redraws ``e2e.png`` beside that file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import e2e_chunked
import e2e_models
import e2e_offline
import e2e_one_batch
import e2e_server
import e2e_summary
from e2e_models import MODELS, context_len, dummy_model
from e2e_plot import plot
from harness import BenchRun, exit_on_sigterm, log

STEPS = {"one_batch": e2e_one_batch, "offline": e2e_offline, "server": e2e_server,  # in the order they run
         "chunked": e2e_chunked}
ONE_BATCH_BACKENDS = ("nvfp4_sparse", "flashinfer", "triton", "torch_native")


def parse_args() -> argparse.Namespace:
    """The command line; ``--models`` and ``--steps`` come back as lists."""
    docs = [__doc__, e2e_models.__doc__, *(step.__doc__ for step in STEPS.values())]
    ap = argparse.ArgumentParser(description="\n".join(docs), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder (required unless --replot)")
    ap.add_argument("--replot", metavar="E2E_JSON", help="only redraw the plot of an e2e.json (next to it)")
    ap.add_argument("--steps", default="server,one_batch", help="comma list of one_batch, offline, server, chunked")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="stop starting work after this many seconds; running children are stopped (default 520)")
    ap.add_argument("--backends", nargs="+", default=list(ONE_BATCH_BACKENDS),
                    help="one_batch runs all of them; server, offline and chunked skip torch_native")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8, help="one_batch, offline and chunked")
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
    g.add_argument("--offline-pretokenize", action="store_true",
                   help="tokenize the prompts before the timed pass and send input_ids (takes the engine's "
                        "tokenizer out of the measured time)")
    g = ap.add_argument_group("chunked (the first model of --models; servers of every backend but torch_native)")
    g.add_argument("--chunk-size", type=int, default=8192, help="--chunked-prefill-size")
    g.add_argument("--chunked-input-lens", type=int, nargs="+", default=[32768, 131072])
    g.add_argument("--chunked-repeats", type=int, default=2, help="timed prompts per length (after one untimed)")
    args = ap.parse_args()
    if args.replot:
        return args
    if not args.out:
        ap.error("--out is required")
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {list(MODELS)}")
    args.steps = [s for s in args.steps.split(",") if s]
    if set(args.steps) - set(STEPS):
        ap.error(f"--steps: unknown {sorted(set(args.steps) - set(STEPS))}")
    return args


def gpu_description() -> str | None:
    """``NAME, torch VERSION`` of the GPU the steps run on; None without one (or without torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    except Exception:  # noqa: BLE001
        pass
    return None


def runnable_backends(backends: list, results: dict) -> list:
    """``backends`` less ``flashinfer`` where FlashInfer is not installed (noted in ``results``)."""
    if "flashinfer" in backends and importlib.util.find_spec("flashinfer") is None:
        results["backends_left_out"] = {"flashinfer": "flashinfer is not installed"}
        log("note: the flashinfer backend is left out: flashinfer is not installed")
        return [b for b in backends if b != "flashinfer"]
    return list(backends)


def summarize(results: dict) -> dict:
    """``nvfp4_sparse`` over the strongest dense backend, per step and phase, with that backend's name."""
    summary = {}
    if results.get("one_batch_by_model"):
        summary["one_batch"] = e2e_summary.one_batch_summary(results["one_batch_by_model"])
    if results.get("offline"):
        summary["offline"] = results["offline"].get("vs_strongest_dense", {})
    if results.get("server", {}).get("agreement"):
        summary["server_agreement"] = results["server"]["agreement"]
    invariance = {b: v["batch_invariance"] for b, v in results.get("server", {}).items()
                  if isinstance(v, dict) and "batch_invariance" in v}
    if invariance:
        summary["server_batch_invariance"] = invariance
    return summary


def run_steps(bench: BenchRun, args) -> None:
    """The steps of ``--steps`` in their fixed order, saving after each; a failing server step is recorded
    (``server_error``) and the other steps' numbers are kept."""
    args.backends = runnable_backends(args.backends, bench.results)
    served_backends = [b for b in args.backends if b != "torch_native"]
    if "one_batch" in args.steps:
        e2e_one_batch.run_step(bench, args)
        bench.save()
    if "offline" in args.steps:
        e2e_offline.run_step(bench, args, served_backends)
        bench.save()
    if "server" in args.steps:
        try:
            e2e_server.run_step(bench, served_backends)
        except Exception as e:  # keep the other steps' numbers; the failure is recorded
            bench.results["server_error"] = repr(e)
            log(f"server step failed: {e!r}")
    if "chunked" in args.steps:
        model = dummy_model(bench.out_dir, args.models[0], context_len(max(args.chunked_input_lens), 1))
        flags = ["--load-format", "dummy", "--mem-fraction-static", str(args.mem_fraction_static)]
        e2e_chunked.run_step(bench, served_backends, model, args.chunked_input_lens, args.chunk_size,
                             args.chunked_repeats, extra_args=flags)


def main() -> None:
    args = parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.join(os.path.dirname(os.path.abspath(args.replot)), "e2e.png"))
        return
    exit_on_sigterm()
    bench = BenchRun(args.out, "e2e.json", args.budget_s)
    gpu = gpu_description()
    if gpu:
        bench.results["gpu"] = gpu
    try:
        run_steps(bench, args)
    finally:
        bench.stop_children()
        bench.results["wall_s"] = bench.spent()
        bench.results["summary"] = summarize(bench.results)
        bench.save()
    try:
        plot(bench.results, bench.path("e2e.png"))
    except Exception as e:  # noqa: BLE001 - the JSON is the record
        log(f"plot failed: {e!r}")
    log("done")


if __name__ == "__main__":
    main()
