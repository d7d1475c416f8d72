#!/bin/bash
# The SM clock, board power and clock event reasons (nvidia-smi, every 100 ms) while a tree's Gluon prefill runs
# back to back for 4 s per selection (64/4 random, then shared8; T = 32K, top-16), for each TAG:TREE in turn:
# whether the kernel runs into the board's power limit, and at what clock.
#   bash bench/prefill_clocks.sh OUTDIR TAG:TREE [TAG:TREE ...]
# Writes OUTDIR/clocks_TAG.csv (nvidia-smi's samples) and prints each selection's milliseconds per launch and the
# samples taken while it ran (clock, power and reasons: 0x4 is the software power cap, 0x1 idle).
set -u
out=$1; shift
mkdir -p "$out"
for named in "$@"; do
  tag=${named%%:*} tree=${named#*:}
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 100 \
    > "$out/clocks_$tag.csv" &
  smi=$!
  PYTHONPATH=$tree python3 - "$tag" <<'PY'
import sys
import time

import torch

sys.path.insert(0, "bench")
from bench_prefill_variants import problems  # noqa: E402
from bench_regression import HEAD_DIM  # noqa: E402

from sglang_nvfp4.kernels import gluon_prefill  # noqa: E402

for name, q, cache, ids, table, req, pos in problems(32768, "cuda", ("random", "shared8")):
    if "16x1" in name:
        continue
    out = torch.empty_like(q)
    plan = gluon_prefill.plan(ids, table, req, pos, q.shape[1] // (cache.shape[1] // 2))
    gluon_prefill.run(q, cache, pos, plan, 1.0, 1.0, HEAD_DIM**-0.5, out)  # compile, untimed
    torch.cuda.synchronize()
    start, launches = time.time(), 0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.time() - start < 4:
        for _ in range(20):
            gluon_prefill.run(q, cache, pos, plan, 1.0, 1.0, HEAD_DIM**-0.5, out)
        torch.cuda.synchronize()
        launches += 20
    end.record()
    end.synchronize()
    print(f"{sys.argv[1]} {name}: {launches} launches, {begin.elapsed_time(end) / launches:.3f} ms each, "
          f"{time.strftime('%H:%M:%S', time.localtime(start))}-{time.strftime('%H:%M:%S')}", flush=True)
PY
  kill $smi
  echo "$tag: samples by SM clock (MHz), then by power (W, 25 W bins), then by reason"
  awk -F', ' '{print $2}' "$out/clocks_$tag.csv" | sort | uniq -c | sort -rn | head -6
  awk -F', ' '{print int($3 / 25) * 25}' "$out/clocks_$tag.csv" | sort -n | uniq -c | tail -4
  awk -F', ' '{print $4}' "$out/clocks_$tag.csv" | sort | uniq -c
done
