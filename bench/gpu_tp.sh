#!/usr/bin/env bash
# One device call on a 2-GPU H200 host (kind nvidia-h200-x2; repository root, `carry: [".gpu"]`):
# nvfp4_sparse at --tp-size 1 and 2 (bench/bench_tp.py). tp.json, log.txt and logs.tgz (server logs)
# land in $OUT.
#   bash bench/gpu_tp.sh [bench_tp.py args...]     (bench_tp.py stops itself at --budget-s, default 500 s)
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-tp-out}
WORK=/tmp/nvfp4-tp
rm -rf "$WORK"
mkdir -p "$WORK"
source bench/gpu_setup.sh || exit 1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 2 ] || echo "[$(ts)] warning: $ngpu GPU(s) visible; --tp-size 2 will fail" | tee -a "$OUT/log.txt"
# Hard stop in case the script's own budget fails: SIGTERM (servers are stopped), SIGKILL 10 s later.
timeout -k 10 550 python3 bench/bench_tp.py --out "$WORK" "$@" 2>&1 | tee -a "$OUT/log.txt"
rc=$?
kill_leftovers "$WORK"
[ -f "$WORK/tp.json" ] && cp "$WORK/tp.json" "$OUT/"
(cd "$WORK" && tar czf "$OUT/logs.tgz" --ignore-failed-read ./*.log tp.json 2>/dev/null)
nvidia-smi --query-gpu=index,memory.used --format=csv | tee -a "$OUT/log.txt"
echo "[$(ts)] bench_tp.py exit $rc; in \$OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/log.txt"
exit $rc
