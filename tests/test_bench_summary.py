"""bench_e2e's headline ratios are taken against the strongest dense backend of each phase, and name it
(``bench/e2e_summary.py``): hand-made results where a different dense backend wins each phase."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import e2e_summary  # noqa: E402


def _entry(*runs):
    """A one_batch entry: ``runs`` of (batch, input, status, prefill tok/s, decode tok/s)."""
    return {"attempts": [{"batch_size": b, "input_len": i, "status": st,
                          **({"result": {"prefill_throughput": p, "median_decode_throughput": d}} if st == "ok" else {})}
                         for b, i, st, p, d in runs]}


def test_one_batch_ratios_use_the_fastest_dense_backend_per_phase():
    by_model = {"m": {
        "nvfp4_sparse": _entry((1, 32768, "ok", 270_000.0, 500.0), (8, 32768, "ok", 250_000.0, 4000.0)),
        "flashinfer": _entry((1, 32768, "ok", 180_000.0, 300.0), (8, 32768, "oom", 0, 0)),
        "triton": _entry((1, 32768, "ok", 77_000.0, 340.0), (8, 32768, "ok", 75_000.0, 2500.0)),
        "torch_native": _entry((1, 32768, "ok", 115_000.0, 17.0), (8, 32768, "skipped", 0, 0)),
    }}
    rows = e2e_summary.one_batch_summary(by_model)["m"]
    assert [(r["batch_size"], r["input_len"]) for r in rows] == [(1, 32768), (8, 32768)]
    first, second = rows
    assert first["prefill_strongest_dense"] == "flashinfer"
    assert first["prefill_ratio"] == pytest.approx(270_000 / 180_000)
    assert first["decode_strongest_dense"] == "triton"  # another backend wins decode
    assert first["decode_ratio"] == pytest.approx(500 / 340)
    # flashinfer ran out of memory at batch 8: triton is the strongest dense backend that ran
    assert second["prefill_strongest_dense"] == "triton"
    assert second["prefill_ratio"] == pytest.approx(250_000 / 75_000)


def test_one_batch_row_without_our_run_has_no_ratio():
    by_model = {"m": {"nvfp4_sparse": _entry((1, 8192, "timeout", 0, 0)), "triton": _entry((1, 8192, "ok", 2.0, 1.0))}}
    (row,) = e2e_summary.one_batch_summary(by_model)["m"]
    assert row["prefill_strongest_dense"] == "triton" and "prefill_ratio" not in row


def test_offline_ratio_against_the_strongest_dense_backend():
    def res(total, out):
        return {"result": {"total_throughput": total, "output_throughput": out, "input_throughput": total - out}}

    offline = {"nvfp4_sparse": res(100.0, 10.0), "triton": res(120.0, 12.0), "flashinfer": res(150.0, 20.0),
               "model": {"name": "x"}}
    s = e2e_summary.offline_summary(offline)
    assert s["strongest_dense"] == "flashinfer"
    assert s["ratio_total_throughput"] == pytest.approx(100 / 150)
    assert s["ratio_output_throughput"] == pytest.approx(10 / 20)
    assert e2e_summary.offline_summary({"triton": res(1.0, 1.0)}) == {}


def test_server_agreement_pairs_ours_with_every_dense_backend_and_dense_with_dense():
    def answers(first_tokens, lp):
        return {"requests": [{"name": "short", "tokens": [t, 7], "logprobs": [lp, -1.0]} for t in first_tokens]
                + [{"name": "long", "tokens": [0], "logprobs": [0.0]}]}

    server = {"nvfp4_sparse": answers([1, 2, 3], -0.5), "triton": answers([1, 2, 4], -0.25),
              "flashinfer": answers([1, 2, 3], -0.5), "broken": {"error": "x"}}
    agreement = e2e_summary.server_agreement(server)
    assert set(agreement) == {"nvfp4_sparse~flashinfer", "nvfp4_sparse~triton", "flashinfer~triton"}
    assert agreement["nvfp4_sparse~triton"]["short_first_token_equal"] == 2
    assert agreement["nvfp4_sparse~triton"]["short_first_logprob_abs_delta"] == [0.25] * 3
    assert agreement["nvfp4_sparse~flashinfer"]["short_all_tokens_equal"] == 3
    assert agreement["flashinfer~triton"]["short_prompts"] == 3


def test_short_prompt_agreement_lists_each_disagreement_with_the_reference_margin():
    def answers(first_tokens, logprobs, margins=None):
        rows = [{"name": "short", "tokens": [t], "logprobs": [lp]} for t, lp in zip(first_tokens, logprobs)]
        for row, m in zip(rows, margins or []):
            row["first_top2_margin"] = m
        return rows

    ours = answers([5, 6, 9, 8], [-1.0, -2.0, -3.5, -4.0])
    dense = answers([5, 6, 7, 8], [-1.5, -2.0, -3.0, -4.0], margins=[2.0, 0.75, 0.25, 0.5])
    a = e2e_summary.short_prompt_agreement(ours, dense)
    assert a["short_first_token_equal"] == 3
    lo, hi = a["short_first_token_equal_ci95"]
    assert 0.29 < lo < 0.31 and 0.95 < hi < 0.96  # Wilson, 3 of 4
    assert a["short_first_top2_margin_min"] == 0.25 and a["short_first_top2_margin_median"] == 0.75
    assert a["short_margins_below_max_delta"] == 1  # the largest delta is 0.5: only the margin 0.25 is below it
    assert a["short_first_token_disagreements"] == [{"prompt": 2, "margin": 0.25, "logprob_abs_delta": 0.5}]
    assert "short_first_top2_margin_min" not in e2e_summary.short_prompt_agreement(ours, answers([5], [-1.0]))


def test_more_short_prompts_keep_every_earlier_request():
    import e2e_server

    default, more = e2e_server._prompts(), e2e_server._prompts(64)
    assert [n for n, _ in more].count("short") == 64 and len({t for _, t in more}) == len(more)
    assert more[:8] == default[:8] and more[64:] == default[8:]
