#!/usr/bin/env bash
# One device call on the H200 host (repository root, `carry: [".gpu"]`): SGLang end to end,
# nvfp4_sparse vs flashinfer, triton (and torch_native in one_batch) through bench/bench_e2e.py. e2e.json,
# e2e.png, log.txt and logs.tgz (every server / one_batch / offline log and raw result file) land in
# $OUT: 4 files, under the device tool's 8-file limit.
#   bash bench/gpu_e2e.sh [bench_e2e.py args...]      (bench_e2e.py stops itself at --budget-s, default 520 s)
# Two runs side by side on a 2-GPU host, one per GPU, each in its own folder ($OUT/TAG, /tmp/nvfp4-e2e-TAG):
#   CUDA_VISIBLE_DEVICES=0 E2E_TAG=a bash bench/gpu_e2e.sh ... & CUDA_VISIBLE_DEVICES=1 E2E_TAG=b bash bench/gpu_e2e.sh ... & wait
# (unpack the bundle first, `source bench/gpu_setup.sh`, so that the two do not unpack at once).
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-e2e-out}${E2E_TAG:+/$E2E_TAG}
WORK=/tmp/nvfp4-e2e${E2E_TAG:+-$E2E_TAG}
rm -rf "$WORK"
mkdir -p "$WORK"
source bench/gpu_setup.sh || exit 1
# Hard stop in case the script's own budget fails: SIGTERM (children are stopped), SIGKILL 10 s later.
timeout -k 10 560 python3 bench/bench_e2e.py --out "$WORK" "$@" 2>&1 | tee -a "$OUT/log.txt"
rc=$?
kill_leftovers "$WORK"
for f in e2e.json e2e.png; do
  [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
(cd "$WORK" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.jsonl' -o -name '*.json' \) -print0 \
  | tar czf "$OUT/logs.tgz" --null -T -)
echo "[$(ts)] bench_e2e.py exit $rc; in \$OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/log.txt"
exit $rc
