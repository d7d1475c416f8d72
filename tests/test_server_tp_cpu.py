"""``nvfp4_sparse`` served by SGLang 0.5.23's CPU engine at ``--tp-size 2``, against ``--tp-size 1``
on the same model with the same weights: the CPU twin of the two-GPU run of ``bench/bench_tp.py``.
Every rank registers the plugin, holds half of the KV heads in its own pool, and the answers match.

Reference points (2026-11-29, ``bench/results/tp_cpu.json``, hidden 512): first-token |delta logprob|
TP 2 vs TP 1 is 0.022 with ``nvfp4_sparse`` and 0.009 with dense ``torch_native``, against 0.145 between
the two backends. NVFP4 rounding turns bf16-sized all-reduce differences into larger ones
(``bench/nvfp4_perturbation.py``); a rank reading the wrong heads or pages moves them by whole units."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("sglang.srt")

from sglang_nvfp4.local_server import LocalServer, cpu_tp_env  # noqa: E402
from sglang_nvfp4.tiny_model import make_tiny_model, random_text  # noqa: E402

if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("--tp-size 2 on the CPU needs 2 cores (one per rank)", allow_module_level=True)

SERVER_ARGS = ["--page-size", "128", "--max-total-tokens", "20000", "--max-running-requests", "8",
               "--sampling-backend", "pytorch"]
SHORT_WORDS = (150, 600, 1100, 1900)  # <= 16 blocks with the new tokens: every block attended
LONG_WORDS = 2700  # 22 blocks: a sparse top-16
SPARSE_ENV = {**os.environ, "NVFP4_SPARSE_TOPK": "16"}  # not the default 32: 22 blocks stay sparse


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tp")), kv_heads=2, layers=2, hidden_size=256, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [random_text(rng, n) for n in SHORT_WORDS], random_text(rng, LONG_WORDS)


def serve(model_dir: str, tp: int, prompts) -> dict:
    short, long_text = prompts
    with LocalServer(model_dir, "nvfp4_sparse", extra_args=[*SERVER_ARGS, "--tp-size", str(tp)], env=SPARSE_ENV) as srv:
        answers = [srv.generate(p, max_new_tokens=4, return_logprob=True) for p in short]
        long_answer = srv.generate(long_text, max_new_tokens=4, return_logprob=True)
    return {"short": answers, "long": long_answer, "log": srv.log_tail(500_000)}


@pytest.fixture(scope="module")
def tp1(model_dir, prompts):
    return serve(model_dir, 1, prompts)


@pytest.fixture(scope="module")
def tp2(model_dir, prompts):
    return serve(model_dir, 2, prompts)


def first_token(answer: dict) -> tuple[float, int]:
    logprob, token = answer["meta_info"]["output_token_logprobs"][0][:2]
    return logprob, token


def test_each_rank_holds_half_of_the_kv_heads_in_its_own_pool(tp1, tp2):
    assert "Traceback" not in tp1["log"] and "Traceback" not in tp2["log"], tp2["log"][-4000:]
    assert "for 2 layers x 2 KV heads" in tp1["log"]
    for rank in (0, 1):
        lines = [line for line in tp2["log"].splitlines() if f"TP{rank}] nvfp4_sparse KV pool:" in line]
        assert len(lines) == 1 and "for 2 layers x 1 KV heads" in lines[0], lines


def test_short_prompts_match_tp1(tp1, tp2):
    """At most 16 blocks: every block is attended, so only the all-reduce order separates the two."""
    pairs = [(first_token(a), first_token(b)) for a, b in zip(tp1["short"], tp2["short"])]
    assert all((a[1] == b[1]) for a, b in pairs), pairs
    deltas = [abs(a[0] - b[0]) for a, b in pairs]
    print(f"TP 2 vs TP 1 first-token |delta logprob|: {[round(d, 4) for d in deltas]}")
    assert max(deltas) < 0.15 and sum(deltas) / len(deltas) < 0.06, deltas


def test_long_prompt_is_served_sparse_at_tp2(tp1, tp2):
    for run in (tp1, tp2):
        meta = run["long"]["meta_info"]
        assert meta["prompt_tokens"] > 16 * 128 and meta["completion_tokens"] == 4
    (lp1, tok1), (lp2, tok2) = first_token(tp1["long"]), first_token(tp2["long"])
    # the block selection may differ where rounding moved a block summary; the answer stays close
    assert abs(lp1 - lp2) < 0.5, (lp1, lp2, tok1, tok2)


def test_cpu_ranks_split_the_cores_and_their_openmp_threads(monkeypatch):
    """Each rank binds its share of the cores and starts that many OpenMP threads; set values are kept."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env = cpu_tp_env(2, {})
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0,1|2,3" and env["OMP_NUM_THREADS"] == "2"
    kept = cpu_tp_env(2, {"OMP_NUM_THREADS": "3", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    assert kept["OMP_NUM_THREADS"] == "3" and kept["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    with pytest.raises(ValueError, match="at least 8 cores"):
        cpu_tp_env(8, {})
