#!/usr/bin/env bash
# One device call on the H200 host (run from the repository root, with `carry: [".gpu"]`):
#   bash bench/gpu_session.sh [STAGE...]     STAGE: tests | bench[=ARGS] | proxy | selection[=ARGS] | ncu |
#                                            topk-build | topk   (default: tests bench ncu)
# Logs, the benchmark JSON/PNG and the ncu report land in $OUT (one folder per benchmark: the device tool returns
# a limited number of files). Issue 19's 32K dashboard in one call (about 8 minutes; its targets are an H200's, so
# NVFP4_REQUIRE_GPU=H200 makes the call stop at once on any other GPU, see bench/gpu_setup.sh):
#   NVFP4_REQUIRE_GPU=H200 bash bench/gpu_session.sh tests proxy "bench=--skip write splits prefetch flashinfer
#     --prefill-t 32768 --topk 16 --no-sweep --heads 64/4 16/1 --decode-topk 16 --decode-ctx 32768 --decode-batch
#     1 32 256" selection
# Its end-to-end target needs a call of its own (about 7 minutes on a fresh machine, where FlashInfer's first
# prefill CUDA-graph capture JIT-builds its kernels for about 205 s; 240 s of start-up was too short on an H100):
#   OUT=$OUT/e bash bench/gpu_e2e.sh --budget-s 540 --steps one_batch --input-lens 32768 --batch-sizes 1
#     --backends flashinfer nvfp4_sparse torch_native --startup-timeout 330 --run-timeout 150
# topk-build starts the JIT build of FlashInfer's top-k module in the background, in a session of its own, so
# that it goes on after the call while the machine stays warm (log: $FLASHINFER_WORKSPACE_BASE/topk_build.log);
# topk runs bench/bench_topk.py, which uses that module only once it is built.
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-out}
source bench/gpu_setup.sh || exit 1
[ $# -eq 0 ] && set -- tests bench ncu
for stage in "$@"; do
  case "$stage" in
    tests)
      timeout -s KILL ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rs --timeout 240 \
        tests/test_gluon_prefill.py tests/test_gluon_decode.py tests/test_kernels_gpu.py tests/test_dispatch_cpu.py \
        tests/test_gluon_proxy.py tests/test_proxy_indexer.py -k "not interpreter" 2>&1 \
        | tee "$OUT/pytest.txt" | tail -25 ;;
    bench*)
      args=${stage#bench}; args=${args#=}
      timeout -s KILL ${BENCH_TIMEOUT:-1800} python3 bench/bench_kernels.py --out "$OUT" $args 2>&1 | tee -a "$OUT/log.txt" ;;
    proxy)  # the default selection's fp8 scores: Triton against the Gluon launches, bit for bit
      timeout 300 python3 bench/bench_proxy_scores.py --out "$OUT/proxy" --blocks 2>&1 | tee -a "$OUT/log.txt" ;;
    selection*)  # the default selection (top-16 proxy over every head, fp8) and the attention it feeds
      args=${stage#selection}; args=${args#=}
      [ -n "$args" ] || args="--prefill-t 32768 --decode-batch 32 256 --settings proxy/16/fp8:16 --proxy-groups-sweep"
      timeout 600 python3 bench/bench_selection.py --out "$OUT/selection" $args 2>&1 | tee -a "$OUT/log.txt" ;;
    topk-build)
      setsid nohup python3 -c "import time; t = time.time(); from flashinfer.jit.topk import gen_topk_module; \
gen_topk_module().build_and_load(); print('flashinfer top-k module built in %.0f s' % (time.time() - t))" \
        > "$FLASHINFER_WORKSPACE_BASE/topk_build.log" 2>&1 < /dev/null &
      echo "[$(ts)] FlashInfer top-k build started in the background" | tee -a "$OUT/log.txt" ;;
    topk)
      cat "$FLASHINFER_WORKSPACE_BASE/topk_build.log" 2>/dev/null | tail -3 | tee -a "$OUT/log.txt"
      python3 bench/bench_topk.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt" ;;
    ncu)
      timeout 150 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section ComputeWorkloadAnalysis --section WarpStateStats \
        -k 'regex:_sparse_(prefill|decode)_kernel|_ws_prefill_kernel' --launch-skip 2 --launch-count 2 \
        python3 bench/bench_kernels.py --profile > "$OUT/ncu.txt" 2>&1
      tail -60 "$OUT/ncu.txt" ;;
  esac
done
