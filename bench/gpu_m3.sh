#!/usr/bin/env bash
# One device call on the H200 host (repository root, `carry: [".gpu"]`): MiniMax-M3 under nvfp4_sparse vs
# SGLang's in-tree M3 path (bench/bench_m3.py), after the GPU tests of the learned indexer, the Gluon prefill and the
# kernels.
#   [M3_TESTS="tests/..."] bash bench/gpu_m3.sh [tests] [bench_m3.py args...]
# m3.json, log.txt, pytest.txt and logs.tgz (every server / one_batch log) land in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-m3-out}
WORK=/tmp/nvfp4-m3
rm -rf "$WORK"
mkdir -p "$WORK"
source bench/gpu_setup.sh || exit 1
if [ "$1" = tests ]; then
  shift
  # The interpreter re-runs are CPU tests (they fail on this host's Python 3.12: bench/results/m3_h200.md).
  # M3_TESTS: the test files to run (default: the learned indexer's, the Gluon prefill's and the kernels').
  python3 -m pytest -q -p no:cacheprovider -rs -k "not interpreter" ${M3_TESTS:-tests/test_gluon_prefill.py \
    tests/test_learned_indexer.py tests/test_indexer_triton.py tests/test_kernels_gpu.py} 2>&1 | tee "$OUT/pytest.txt" \
    | tail -8
fi
timeout -k 10 560 python3 bench/bench_m3.py --out "$WORK" "$@" 2>&1 | tee -a "$OUT/log.txt"
rc=$?
kill_leftovers "$WORK"
[ -f "$WORK/m3.json" ] && cp "$WORK/m3.json" "$OUT/"
(cd "$WORK" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.jsonl' -o -name '*.json' \) -print0 \
  | tar czf "$OUT/logs.tgz" --null -T -)
echo "[$(ts)] bench_m3.py exit $rc; in \$OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/log.txt"
exit $rc
