"""The README's main job: serve a tiny model with ``--attention-backend nvfp4_sparse`` and query it.

Generates a tiny random-weight model locally, starts ``sglang.launch_server`` on 127.0.0.1 (the
torch reference kernels on CPU, Triton on a GPU), sends one long prompt (more 128-token blocks than
the 16 each token attends) and two prompts sharing a prefix, prints the outputs, the radix-cache hits
and the KV capacity against a bf16 cache of the same size, then stops the server.

``python -m sglang_nvfp4.demo [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import os
import random
import re
import tempfile
import time

from .local_server import LocalServer
from .tiny_model import make_tiny_model, random_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "sglang-nvfp4-demo"))
    args = ap.parse_args()
    rng = random.Random(0)
    model = make_tiny_model(os.path.join(args.workdir, "tiny-model"), kv_heads=1, layers=2)
    print(f"tiny model (GraniteForCausalLM, 16 query heads / 1 KV head, head_dim 128, random weights: its text is noise): {model}")
    long_prompt = random_text(rng, 3000)
    shared = random_text(rng, 1500)
    requests = [("long prompt", long_prompt), ("shared prefix A", shared + " key value"),
                ("shared prefix B", shared + " sparse attention")]
    server_args = ["--max-total-tokens", "65536", "--max-running-requests", "8"]
    print("starting SGLang with --attention-backend nvfp4_sparse ...", flush=True)
    with LocalServer(model, "nvfp4_sparse", extra_args=server_args) as srv:
        for name, text in requests:
            t0 = time.perf_counter()
            out = srv.generate(text, max_new_tokens=12)
            meta = out["meta_info"]
            print(f"{name:16s} prompt {meta['prompt_tokens']:5d} tokens ({-(-meta['prompt_tokens'] // 128)} blocks), "
                  f"cached {meta['cached_tokens']:5d}, {time.perf_counter() - t0:6.1f} s -> {out['text']!r}")
        log = srv.log_tail(1_000_000)
    code = srv.process.returncode
    capacity = re.search(r"nvfp4_sparse KV pool: .*", log)
    print(capacity.group(0) if capacity else "KV pool line missing from the server log")
    print(f"server stopped (exit code {code})")


if __name__ == "__main__":
    main()
