"""MiniMax-M3 served natively by a real SGLang 0.5.23 CPU server with ``--attention-backend nvfp4_sparse``:
a tiny M3 config (3 layers: one dense, two with the learned indexer; 32 query / 2 KV heads, head_dim 128,
one index head per KV head, top-16 blocks) with SGLang's seeded dummy weights. The plugin replaces M3's
pool and hybrid backend: the NVFP4 pool holds every layer and the learned indexer the index keys. Prompts
of at most 16 blocks must give bit-identical answers to the same server attending every block
(``NVFP4_SPARSE_DENSE_LAYERS=all``); longer ones must not (the selection is sparse there). A server with fp8
index keys (``NVFP4_SPARSE_INDEX_KEYS=fp8``) answers the short prompts as the every-block one too, and serves a long
prompt from its radix cache with the same answer. At ``--tp-size 2`` (one KV head and one index head per rank) the
same holds for short and long prompts. Unsupported M3 variants stop the launcher before any weight loads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt")

from sglang_nvfp4.local_server import LocalServer, free_port, sglang_process  # noqa: E402
from sglang_nvfp4.tiny_model import make_tiny_m3_model, random_text  # noqa: E402

SERVER_ARGS = ["--max-total-tokens", "32768", "--mem-fraction-static", "0.5", "--max-running-requests", "8",
               "--load-format", "dummy"]
LONG_WORDS = 2600  # ~2600 tokens: 21 blocks, so tokens past block 16 attend a learned top-16


def test_unsupported_m3_variants_stop_the_launcher_before_the_weights_load(tmp_path):
    """Index value heads (the other refusals are unit-tested in test_minimax_m3.py): exit code 1, the
    reason, no weight loaded. First in the module: no server of the fixtures below is running yet."""
    model = make_tiny_m3_model(str(tmp_path), kv_heads=2, layers=3, sparse_layers=[1, 2])
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["sparse_attention_config"]["sparse_disable_index_value"] = [1, 0, 1]
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    args, env = sglang_process(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--attention-backend", "nvfp4_sparse",
         "--host", "127.0.0.1", "--port", str(free_port()), "--load-format", "dummy"], dict(os.environ))
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 1, log[-3000:]
    assert "index value heads (sparse_disable_index_value 0) on layers [1]" in log, log[-3000:]
    assert "Load weight" not in log


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return make_tiny_m3_model(str(tmp_path_factory.mktemp("m3")), kv_heads=2, layers=3, sparse_layers=[1, 2])


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return {"short": [random_text(rng, rng.randint(30, 1500)) for _ in range(4)],
            "long": [random_text(rng, LONG_WORDS) for _ in range(2)]}


def answers(server, texts):
    return [server.generate(t, max_new_tokens=6, return_logprob=True, logprob_start_len=0) for t in texts]


@pytest.fixture(scope="module")
def every_block_answers(m3_dir, prompts):
    env = {**os.environ, "NVFP4_SPARSE_DENSE_LAYERS": "all"}
    with LocalServer(m3_dir, "nvfp4_sparse", extra_args=SERVER_ARGS, env=env) as srv:
        return {kind: answers(srv, texts) for kind, texts in prompts.items()}


@pytest.fixture(scope="module")
def m3_server(m3_dir, every_block_answers):  # the every-block server has stopped before this one starts
    srv = LocalServer(m3_dir, "nvfp4_sparse", extra_args=SERVER_ARGS)
    srv.start()
    yield srv
    assert srv.stop() == 0
    log = srv.log_tail(200_000)
    assert "Traceback" not in log, log[-4000:]


def test_m3_runs_on_the_nvfp4_pool_with_its_learned_indexer(m3_server):
    log = m3_server.log_tail(200_000)
    assert "type=MiniMaxM3SparseForCausalLM" in log
    assert "nvfp4_sparse KV pool: 32768 tokens" in log and "for 3 layers x 2 KV heads" in log
    assert "nvfp4_sparse indexer LearnedIndexer" in log  # index keys of the 2 sparse layers beside the cache
    assert m3_server.get("/server_info")["attention_backend"] == "nvfp4_sparse"


def test_prompts_of_at_most_16_blocks_equal_every_block_attended(m3_server, prompts, every_block_answers):
    for text, want in zip(prompts["short"], every_block_answers["short"]):
        got = m3_server.generate(text, max_new_tokens=6, return_logprob=True, logprob_start_len=0)
        assert got["meta_info"]["prompt_tokens"] <= 16 * 128
        assert got["output_ids"] == want["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert got["meta_info"][key] == want["meta_info"][key]


def test_longer_prompts_attend_a_learned_top_16_and_hit_the_radix_cache(m3_server, prompts, every_block_answers):
    differs = 0
    for text, full in zip(prompts["long"], every_block_answers["long"]):
        got = m3_server.generate(text, max_new_tokens=6, return_logprob=True, logprob_start_len=0)
        assert got["meta_info"]["prompt_tokens"] > 16 * 128
        ours = [x[0] for x in got["meta_info"]["input_token_logprobs"][16 * 128 + 1 :]]
        dense = [x[0] for x in full["meta_info"]["input_token_logprobs"][16 * 128 + 1 :]]
        differs += ours != dense
        extended = m3_server.generate(text + " key value", max_new_tokens=6)
        assert extended["meta_info"]["cached_tokens"] >= 16 * 128  # prefix pages and their index keys reused
        again = m3_server.generate(text, max_new_tokens=6, return_logprob=True)  # no input logprobs: cache usable
        assert again["meta_info"]["cached_tokens"] >= 16 * 128
        # served from cached pages, selected with cached index keys: the same answer, the same logprobs
        assert again["output_ids"] == got["output_ids"]
        cached_delta = max(abs(a[0] - b[0]) for a, b in zip(again["meta_info"]["output_token_logprobs"],
                                                             got["meta_info"]["output_token_logprobs"]))
        sparse_delta = max(abs(a - b) for a, b in zip(ours, dense))
        print(f"long prompt: |logprob| cached vs first {cached_delta:.2e}, sparse vs every block {sparse_delta:.2e}")
        assert cached_delta == 0.0
    assert differs == len(prompts["long"])  # past 16 blocks the selection drops blocks: outputs move




def test_fp8_index_keys_serve_short_prompts_unchanged_and_reuse_cached_keys(m3_dir, prompts, every_block_answers,
                                                                            m3_server):
    # m3_server: its module fixture is set up (and later stopped) before this server, so two never run at once
    m3_server.stop()
    env = {**os.environ, "NVFP4_SPARSE_INDEX_KEYS": "fp8"}
    with LocalServer(m3_dir, "nvfp4_sparse", extra_args=SERVER_ARGS, env=env) as srv:
        # 2 sparse layers x 129 bytes of fp8 index keys a token (instead of 256) beside the cache
        assert "nvfp4_sparse indexer LearnedIndexer: 0.008 GiB" in srv.log_tail(200_000)
        for text, want in zip(prompts["short"][:2], every_block_answers["short"]):
            got = srv.generate(text, max_new_tokens=6, return_logprob=True, logprob_start_len=0)
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
        text = prompts["long"][0]
        first = srv.generate(text, max_new_tokens=6, return_logprob=True)
        again = srv.generate(text, max_new_tokens=6, return_logprob=True)
        assert again["meta_info"]["cached_tokens"] >= 16 * 128  # prefix pages and their fp8 index keys reused
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]
        log = srv.log_tail(200_000)
    assert "Traceback" not in log, log[-4000:]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--tp-size 2 on the CPU needs 2 cores (one per rank)")
def test_m3_at_tp_size_2_equals_every_block_attended_up_to_16_blocks(m3_dir, prompts, m3_server):
    """Each rank holds one KV head, its index head and the index keys. SGLang's dummy weights differ between TP sizes
    (each rank draws its own shard), so the reference is a --tp-size 2 server attending every block."""
    m3_server.stop()  # one server at a time (its fixture stops it again at the end of the module: a no-op)
    args = [*SERVER_ARGS, "--tp-size", "2"]
    texts = [*prompts["short"][:2], prompts["long"][0]]
    served = {}
    for name, env in (("every_block", {"NVFP4_SPARSE_DENSE_LAYERS": "all"}), ("sparse", {})):
        with LocalServer(m3_dir, "nvfp4_sparse", extra_args=args, env={**os.environ, **env}) as srv:
            served[name] = [srv.generate(t, max_new_tokens=4, return_logprob=True, logprob_start_len=0) for t in texts]
            log = srv.log_tail(500_000)
        assert "Traceback" not in log, log[-4000:]
        assert log.count("for 3 layers x 1 KV heads") == 2  # the pool of each rank
    for got, want in zip(served["sparse"][:2], served["every_block"][:2]):
        assert got["meta_info"]["prompt_tokens"] <= 16 * 128
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["input_token_logprobs"] == want["meta_info"]["input_token_logprobs"]
    long_sparse, long_every = served["sparse"][2]["meta_info"], served["every_block"][2]["meta_info"]
    assert long_sparse["prompt_tokens"] > 16 * 128
    assert long_sparse["input_token_logprobs"][16 * 128 + 1 :] != long_every["input_token_logprobs"][16 * 128 + 1 :]
