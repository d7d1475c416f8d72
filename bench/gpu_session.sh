#!/usr/bin/env bash
# One device call on the H200 host (run from the repository root, with `carry: [".gpu"]`):
#   bash bench/gpu_session.sh [STAGE...]     STAGE: tests | bench[=ARGS] | ncu   (default: tests bench ncu)
# Logs, the benchmark JSON/PNG and the ncu report land in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-out}
mkdir -p "$OUT" /tmp/site
tar xJf .gpu/site.tar.xz -C /tmp/site
export PYTHONPATH="$PWD:/tmp/site:$PYTHONPATH" PYTHONUNBUFFERED=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$OUT/log.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log.txt"
[ $# -eq 0 ] && set -- tests bench ncu
for stage in "$@"; do
  case "$stage" in
    tests)
      python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels_gpu.py tests/test_dispatch_cpu.py 2>&1 \
        | tee "$OUT/pytest.txt" | tail -25 ;;
    bench*)
      args=${stage#bench}; args=${args#=}
      python3 bench/bench_kernels.py --out "$OUT" $args 2>&1 | tee -a "$OUT/log.txt" ;;
    ncu)
      timeout 150 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section ComputeWorkloadAnalysis \
        -k 'regex:_sparse_(prefill|decode)_kernel' --launch-skip 2 --launch-count 2 \
        python3 bench/bench_kernels.py --profile > "$OUT/ncu.txt" 2>&1
      tail -60 "$OUT/ncu.txt" ;;
  esac
done
