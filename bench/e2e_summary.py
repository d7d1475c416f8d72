"""Headline ratios of bench_e2e, each against the **strongest** dense backend measured in the same run, per
phase: prefill and decode (``one_batch``, per model and (batch, input) pair), throughput (``offline``). The
dense backend that wins each phase is named next to its figure; a ratio against a weaker peer would
flatter the plugin.
"""

from __future__ import annotations

from sglang_nvfp4.quality.stats import wilson_interval

OURS = "nvfp4_sparse"
ONE_BATCH_PHASES = (("prefill", "prefill_throughput"), ("decode", "median_decode_throughput"))
OFFLINE_KEYS = ("total_throughput", "output_throughput", "input_throughput")


def _ok_result(entry: dict, batch_size: int, input_len: int) -> dict | None:
    for attempt in entry.get("attempts", []):
        if (attempt["batch_size"], attempt["input_len"]) == (batch_size, input_len) and attempt.get("status") == "ok":
            return attempt["result"]
    return None


def strongest(values: dict) -> tuple[str, float] | None:
    """``(name, value)`` of the largest positive value of ``{name: value}``; None when there is none."""
    present = {k: v for k, v in values.items() if v}
    if not present:
        return None
    best = max(present, key=present.get)
    return best, present[best]


def one_batch_summary(by_model: dict, ours: str = OURS) -> dict:
    """``{model: [row per (batch, input) pair]}``; a row names, per phase, the strongest dense backend with its
    tokens/s, ours, and ours over it (``prefill_ratio``, ``decode_ratio``), where both ran."""
    summary = {}
    for model, backends in by_model.items():
        pairs = sorted({(a["batch_size"], a["input_len"]) for e in backends.values() for a in e.get("attempts", [])})
        rows = []
        for batch_size, input_len in pairs:
            results = {b: _ok_result(e, batch_size, input_len) for b, e in backends.items()}
            row = {"batch_size": batch_size, "input_len": input_len}
            for phase, key in ONE_BATCH_PHASES:
                best = strongest({b: r.get(key) for b, r in results.items() if b != ours and r})
                mine = (results.get(ours) or {}).get(key)
                if best:
                    row[f"{phase}_strongest_dense"], row[f"{phase}_strongest_dense_tok_s"] = best
                if mine:
                    row[f"{phase}_{ours}_tok_s"] = mine
                if best and mine:
                    row[f"{phase}_ratio"] = mine / best[1]
            rows.append(row)
        summary[model] = rows
    return summary


def offline_summary(offline: dict, ours: str = OURS) -> dict:
    """Ours over the strongest dense backend of ``offline_throughput`` (by total throughput), with its name."""
    results = {b: v.get("result") for b, v in offline.items() if isinstance(v, dict) and v.get("result")}
    mine = results.pop(ours, None)
    best = strongest({b: r.get(OFFLINE_KEYS[0]) for b, r in results.items()})
    if not (mine and best):
        return {}
    dense = results[best[0]]
    return {"strongest_dense": best[0],
            **{f"ratio_{k}": mine[k] / dense[k] for k in OFFLINE_KEYS if dense.get(k) and mine.get(k)}}


def short_prompt_agreement(a: list, b: list) -> dict:
    """Two backends' answers to the same short prompts (every block selected): first greedy token (with a 95%
    Wilson interval), its logprob, all tokens. Where ``b``'s answers carry ``first_top2_margin`` (its top-1
    minus top-2 logprob), the margins too: a first token can flip only where the margin is about as small as
    the logprob deltas (random weights make near-ties), so each disagreement is listed with its margin."""
    pairs = [(x, y) for x, y in zip(a, b) if x["name"] == "short" and y["name"] == "short"]
    equal = sum(x["tokens"][0] == y["tokens"][0] for x, y in pairs)
    agreement = {
        "short_prompts": len(pairs),
        "short_first_token_equal": equal,
        "short_first_token_equal_ci95": wilson_interval(equal, len(pairs)),
        "short_first_logprob_abs_delta": [abs(x["logprobs"][0] - y["logprobs"][0]) for x, y in pairs],
        "short_all_tokens_equal": sum(x["tokens"] == y["tokens"] for x, y in pairs),
    }
    margins = [y["first_top2_margin"] for _, y in pairs if "first_top2_margin" in y]
    if pairs and len(margins) == len(pairs):
        deltas = agreement["short_first_logprob_abs_delta"]
        largest_delta = max(deltas)
        agreement.update(
            short_first_top2_margin_min=min(margins),
            short_first_top2_margin_median=sorted(margins)[len(margins) // 2],
            short_margins_below_max_delta=sum(m < largest_delta for m in margins),
            short_first_token_disagreements=[
                {"prompt": i, "margin": m, "logprob_abs_delta": d}
                for i, ((x, y), m, d) in enumerate(zip(pairs, margins, deltas)) if x["tokens"][0] != y["tokens"][0]])
    return agreement


def server_agreement(server: dict, ours: str = OURS) -> dict:
    """Ours against every dense backend served, and every two dense backends against each other (the noise
    that separates dense implementations): ``{"nvfp4_sparse~triton": {...}, "flashinfer~triton": {...}}``."""
    answered = {b: v["requests"] for b, v in server.items() if isinstance(v, dict) and v.get("requests")}
    dense = sorted(b for b in answered if b != ours)
    pairs = [(ours, d) for d in dense if ours in answered]
    pairs += [(x, y) for i, x in enumerate(dense) for y in dense[i + 1:]]
    return {f"{x}~{y}": short_prompt_agreement(answered[x], answered[y]) for x, y in pairs}
