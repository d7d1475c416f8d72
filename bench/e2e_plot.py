"""The figure of bench_e2e, ``e2e.png``: ``one_batch`` prefill and decode throughput against input length
(log-log, one line per backend and batch size, per model where there are several) and, when the
``offline`` step ran, a bar per backend of ``offline_throughput``'s output throughput. Also draws the
results of earlier runs (``bench/results/e2e_h200.json`` keeps ``one_batch`` only).
"""

from __future__ import annotations

from e2e_models import MODELS


COLORS = {"nvfp4_sparse": "tab:red", "flashinfer": "tab:purple", "triton": "tab:blue", "torch_native": "tab:green"}
MARKERS = ["o", "s", "^", "D"]  # one per model
LINE_STYLES = ["-", "--", ":", "-."]  # one per batch size


def _one_batch_by_model(results: dict) -> dict:
    """model -> backend -> one_batch entry, also from runs that kept one model under ``one_batch``."""
    by_model = results.get("one_batch_by_model")
    if not by_model and results.get("one_batch"):
        ob = results["one_batch"]
        by_model = {"gqa64x4": ob.get("results", ob)}  # bench/results/e2e_h200.json nests them under "results"
    return by_model or {}


def _one_batch_panels(prefill_ax, decode_ax, by_model: dict) -> None:
    """Prefill and decode throughput against input length, a line per (model, backend, batch size)."""
    import matplotlib.ticker

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
                style = dict(color=COLORS.get(backend), marker=MARKERS[mi % 4],
                             linestyle=LINE_STYLES[batch_sizes.index(bs) % 4], label=label)
                x = [r["input_len"] for r in runs]
                prefill_ax.plot(x, [r["prefill_throughput"] for r in runs], **style)
                decode_ax.plot(x, [r.get("median_decode_throughput", 0) for r in runs], **style)
    prefill_ax.set(xscale="log", yscale="log", xlabel="input length", ylabel="prefill tokens/s",
                   title="one_batch prefill")
    decode_ax.set(xscale="log", yscale="log", xlabel="input length", ylabel="decode tokens/s", title="one_batch decode")
    lens = sorted({r["input_len"] for backends in by_model.values() for res in backends.values()
                   for r in res.get("runs", [])})
    for a in (prefill_ax, decode_ax):
        if a.get_lines():
            a.legend(fontsize=7)
        a.grid(alpha=0.3)
        if lens:
            a.set_xticks(lens, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lens])
            a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _offline_panel(ax, offline: dict) -> None:
    """Output throughput per backend, annotated with input throughput and total latency."""
    names = list(offline)
    bars = ax.bar(names, [offline[n]["output_throughput"] for n in names], color=[COLORS.get(n, "gray") for n in names])
    for bar, n in zip(bars, names):
        ax.annotate(f"in {offline[n]['input_throughput']:,.0f} tok/s\n{offline[n]['total_latency']:.1f} s",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="output tokens/s", title="offline_throughput, generated-shared-prefix")
    ax.margins(y=0.2)
    ax.grid(alpha=0.3, axis="y")


def plot(results: dict, path: str) -> None:
    """Draw ``results`` (an e2e.json) to ``path``; nothing is written when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_model = _one_batch_by_model(results)
    offline = {k: v["result"] for k, v in (results.get("offline") or {}).items()
               if isinstance(v, dict) and v.get("result")}
    if not any(res.get("runs") for backends in by_model.values() for res in backends.values()) and not offline:
        return
    fig, ax = plt.subplots(1, 3 if offline else 2, figsize=(16 if offline else 11, 4.5))
    _one_batch_panels(ax[0], ax[1], by_model)
    if offline:
        _offline_panel(ax[2], offline)
    models = ", ".join(f"{m} ({v.get('hidden_size', '?')} hidden, {v.get('layers', '?')} layers)"
                       for m, v in (results.get("one_batch_models") or {"gqa64x4": MODELS["gqa64x4"]}).items())
    fig.suptitle(f"SGLang 0.5.23, dummy weights: {models}; {results.get('gpu', 'GPU')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
