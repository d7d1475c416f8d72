"""The README's main job: serve a trained long-context retrieval model with ``--attention-backend
nvfp4_sparse`` and ask it questions whose answers lie deep in long prompts.

The model (``tests/fixtures/retrieval_model``, 2 layers, 16 query heads / 1 KV head, head_dim 128) was trained
on the project's synthetic task (:mod:`sglang_nvfp4.quality.task`): documents of filler words with key-value
records ``<k> KEY VALUE`` hidden at random places; a prompt ends with the question ``<q> KEY`` and the right
next token is that record's value. The demo starts ``sglang.launch_server`` on 127.0.0.1 (torch reference
kernels on CPU, Triton on a GPU), sends prompts of 3-6K tokens (24-48 blocks of 128, while each token attends
the default 16 of them) with the record at several depths, prints expected vs answered, asks a second question
about a document already in the radix cache, prints the KV capacity against a bf16 cache of the same size, and stops
the server with SIGTERM.

``python -m sglang_nvfp4.demo [--model DIR] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .local_server import LocalServer
from .quality import task
from .sglang.config import DEFAULT_TOPK

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "retrieval_model"
PROMPTS = ((3072, 0.1), (3584, 0.3), (4096, 0.5), (4608, 0.7), (5120, 0.9), (6144, 0.5))  # (tokens, record depth)


def ask(srv: LocalServer, tokens) -> tuple[int, dict]:
    """Greedy next token of the prompt ``tokens`` (ids) and the response's ``meta_info``."""
    out = srv.post("/generate", {"text": task.to_text(tokens), "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    meta = out["meta_info"]
    if meta["prompt_tokens"] != len(tokens):
        raise RuntimeError(f"tokenizer mismatch: {meta['prompt_tokens']} != {len(tokens)} tokens")
    return meta["output_token_logprobs"][0][1], meta


DEFAULT = f"top-{DEFAULT_TOPK}"  # the default selection
SETTINGS = (("all blocks", {"NVFP4_SPARSE_DENSE_LAYERS": "all"}), (DEFAULT, {}))  # NVFP4 cache in both


def serve_and_ask(model: str, workdir: str, name: str, settings: dict, prompts, follow_up) -> dict:
    """One ``nvfp4_sparse`` server with ``settings`` (``NVFP4_SPARSE_*``): the greedy answer to every prompt and
    to ``follow_up``, the follow-up's cached tokens, the KV-capacity log line, the exit code of its SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_SPARSE_")} | settings
    server_args = ["--page-size", "128", "--context-length", "8192", "--max-total-tokens", "65536",
                   "--disable-cuda-graph"]
    t0 = time.perf_counter()
    srv = LocalServer(model, "nvfp4_sparse", extra_args=server_args, env=env,
                      log_path=os.path.join(workdir, f"server_{name.replace(' ', '_')}.log"))
    srv.start()
    try:
        print(f"  {name}: server up in {time.perf_counter() - t0:.0f} s", flush=True)
        answers = [ask(srv, p.tokens)[0] for p in prompts]
        token, meta = ask(srv, follow_up)
        capacity = re.search(r"nvfp4_sparse KV pool: (\d+) tokens .*a bf16 pool would hold (\d+) tokens .*\((.*)x\)",
                             srv.log_tail(10_000_000))
    finally:
        code = srv.stop()
    return {"answers": answers + [token], "cached": meta["cached_tokens"], "capacity": capacity, "exit_code": code}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(FIXTURE), help="the trained retrieval model (default: the repository's)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "sglang-nvfp4-demo"))
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model: no model at {args.model} (the default is the repository's tests/fixtures/retrieval_model)")
    os.makedirs(args.workdir, exist_ok=True)
    vocab = task.vocabulary()
    prompts = [task.make_prompt(np.random.default_rng([2026, n, int(d * 100)]), n, d) for n, d in PROMPTS]
    # A follow-up on prompt 1's document, about its first record: the document's pages come from the radix cache.
    doc = prompts[0].tokens[:-2]
    pos = next(i for i in range(1, len(doc) - 2) if doc[i] == task.RECORD)
    follow_up = np.concatenate([doc, [task.QUERY, doc[pos + 1]]])
    rows = [(str(i), len(p.tokens), p.depth, p.answer) for i, p in enumerate(prompts, 1)]
    rows.append(("1b", len(follow_up), pos / len(doc), int(doc[pos + 2])))

    print(f"model: {args.model}\n  trained retrieval model (2 layers, 16 query heads / 1 KV head, head_dim 128): "
          "a prompt hides key-value records in filler words and ends with a question '<q> KEY'")
    print("serving it with --attention-backend nvfp4_sparse (4-bit NVFP4 KV cache), twice: every block attended, "
          f"then the default {DEFAULT} blocks of 128 per token ...", flush=True)
    runs = {name: serve_and_ask(args.model, args.workdir, name, settings, prompts, follow_up)
            for name, settings in SETTINGS}

    print(f"\n{'prompt':>6} {'tokens':>6} {'blocks':>6} {'record at':>9} {'expected':>9} "
          + " ".join(f"{name:>11}" for name in runs))
    for i, (label, length, depth, answer) in enumerate(rows):
        cells = " ".join(f"{vocab[r['answers'][i]] + ('' if r['answers'][i] == answer else ' (x)'):>11}"
                         for r in runs.values())
        print(f"{label:>6} {length:>6} {-(-length // 128):>6} {depth:>8.0%} {vocab[answer]:>9} {cells}")
    for name, r in runs.items():
        right = sum(a == row[3] for a, row in zip(r["answers"], rows))
        print(f"{name}: {right} of {len(rows)} right")
    default = runs[DEFAULT]
    print(f"prompt 1b asks about prompt 1's document again: {default['cached']} of {len(follow_up)} tokens came from "
          "the radix cache")
    if default["capacity"]:
        c = default["capacity"]
        print(f"KV capacity: {int(c[1]):,} tokens in NVFP4 where a bf16 cache of the same memory holds {int(c[2]):,} "
              f"({c[3]}x)")
    print(f"{DEFAULT} misses are the selection's (the training-free indexer), not the 4-bit cache's: README, "
          "'Checking answer quality'")
    codes = {name: r["exit_code"] for name, r in runs.items()}
    print(f"servers stopped with SIGTERM: exit codes {codes}")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
