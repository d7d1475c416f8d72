#!/usr/bin/env bash
# One device call on an H200 host (repository root, `carry: [".gpu", ".baseline"]`): is this tree as fast
# and as exact as a base tree, and does it serve?
#   bash bench/gpu_regression.sh BASE_TREE [bench_e2e.py args...]
# GPU 0: the GPU-marked kernel tests, then bench/bench_regression.py (BASE_TREE vs this tree, alternating
# rounds). With a second GPU, bench/gpu_e2e.sh runs on GPU 1 meanwhile with the given bench_e2e.py args
# (none: no e2e run). In $OUT: log.txt, pytest.txt, regression.json, and the e2e files under $OUT/e2e.
set -o pipefail
base=${1:?usage: bash bench/gpu_regression.sh BASE_TREE [bench_e2e.py args...]}
shift
[ -d "$base/sglang_nvfp4" ] || { echo "no sglang_nvfp4/ in $base"; exit 2; }
OUT=${OUT:-/tmp/nvfp4-regression-out}
source bench/gpu_setup.sh || exit 1
e2e_pid=
if [ $# -gt 0 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  (CUDA_VISIBLE_DEVICES=1 E2E_TAG=e2e bash bench/gpu_e2e.sh "$@" > /tmp/nvfp4-e2e.console 2>&1) &
  e2e_pid=$!
  echo "[$(ts)] e2e on GPU 1: bench_e2e.py $*" | tee -a "$OUT/log.txt"
elif [ $# -gt 0 ]; then
  echo "[$(ts)] one GPU: the e2e run is skipped" | tee -a "$OUT/log.txt"
fi
export CUDA_VISIBLE_DEVICES=0
echo "[$(ts)] GPU tests" | tee -a "$OUT/log.txt"
python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_kernels_gpu.py tests/test_indexer_triton.py 2>&1 \
  | tee "$OUT/pytest.txt" | tail -15
echo "[$(ts)] regression: $base vs ." | tee -a "$OUT/log.txt"
timeout -k 10 420 python3 bench/bench_regression.py --trees "$base" . --out /tmp/nvfp4-regression 2>&1 \
  | tee -a "$OUT/log.txt"
cp /tmp/nvfp4-regression/regression.json "$OUT/" 2>/dev/null
if [ -n "$e2e_pid" ]; then
  wait "$e2e_pid"
  echo "[$(ts)] e2e exit $?" | tee -a "$OUT/log.txt"
  tail -30 /tmp/nvfp4-e2e.console
fi
echo "[$(ts)] done; in \$OUT: $(find "$OUT" -type f | tr '\n' ' ')" | tee -a "$OUT/log.txt"
