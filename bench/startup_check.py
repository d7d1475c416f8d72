"""Does a server start at SGLang's default memory settings, and with what KV capacity? One server of
``--backend`` on a small model (``--model``: the bench's tiny 16/1 config, 2 layers, 1 KV head, hidden 256,
random weights), default ``--mem-fraction-static``, decode CUDA graphs on; one request; stop. Prints one JSON
line (``ok``, ``max_total_num_tokens`` from the KV-cache log line, start-up seconds, the seconds SGLang logged
for capturing the decode CUDA graphs, which include compiling the attention kernels on a cold Triton cache,
the log's tail on failure).

    python bench/startup_check.py --backend nvfp4_sparse --out DIR

Uses only ``LocalServer`` and ``make_tiny_model``, so the same script runs a base checkout's package
(``PYTHONPATH`` = that checkout) for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from sglang_nvfp4.local_server import LocalServer
from sglang_nvfp4.tiny_model import make_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--hidden-size", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = make_tiny_model(os.path.join(args.out, "model"), kv_heads=args.kv_heads, layers=args.layers,
                            hidden_size=args.hidden_size)
    log_path = os.path.join(args.out, f"server_{args.backend}.log")
    result = {"backend": args.backend, "layers": args.layers, "kv_heads": args.kv_heads}
    t0 = time.perf_counter()
    try:
        with LocalServer(model, args.backend, extra_args=["--page-size", "128", "--sampling-backend", "pytorch"],
                         log_path=log_path, startup_timeout=400) as srv:
            result["startup_s"] = round(time.perf_counter() - t0, 1)
            result["completion_tokens"] = srv.generate("key value page block", max_new_tokens=4)["meta_info"]["completion_tokens"]
            result["ok"] = True
    except Exception as exc:  # start-up failure: record it
        result.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-1500:]}")
    with open(log_path, errors="replace") as f:
        log = f.read()
    tokens = re.findall(r"#tokens: (\d+)|KV pool: (\d+) tokens", log)
    result["max_total_num_tokens"] = int(next(filter(None, tokens[-1]))) if tokens else None
    capture = re.findall(r"Capture (?:target )?decode CUDA graph end.*?elapsed=([0-9.]+) s", log)
    result["decode_graph_capture_s"] = float(capture[-1]) if capture else None
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
