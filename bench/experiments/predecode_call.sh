#!/usr/bin/env bash
# Predecoding (attention tiles + the proxy's fp8 key tiles), one call: GPU tests, the prefill variants (fused
# 8-warp producer vs predecoded, one round), then end to end one_batch
# 1 x 32768 with FlashInfer and ours (predecode auto) in one run, then ours with NVFP4_SPARSE_PREDECODE=off if time.
# Run in main's checkout after `git apply bench/experiments/predecode.patch`, as a device call with carry [".gpu"]:
#   bash bench/experiments/predecode_call.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${CALL_LIMIT:-585}
env | grep NVFP4_SPARSE_ && echo "NVFP4_SPARSE_ set: not the defaults"
source bench/gpu_setup.sh || exit 1
log() { echo "[$(ts) ${SECONDS}s] $*" | tee -a "$OUT/log.txt"; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
timeout -s KILL 180 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_prefill.py tests/test_proxy_indexer.py \
  -k "predecod or full_and_empty or key_tiles or compiled_proxy" > "$OUT/pytest_pd.txt" 2>&1
log "GPU tests rc $?: $(tail -1 "$OUT/pytest_pd.txt")"
timeout -s KILL 100 python3 bench/bench_prefill_variants.py --out "$OUT/variants_r1.json" --variants 1:8 predecoded \
  > "$OUT/variants_r1.txt" 2>&1
log "variants rc $?: $(grep -h ' ms ' "$OUT/variants_r1.txt" | tr -s ' ' | tr '\n' '|')"
common="--steps one_batch --input-lens 32768 --batch-sizes 1 --run-timeout 150"
E2E_TAG=a OUT=$OUT bash bench/gpu_e2e.sh --budget-s $((LIMIT - 15 - SECONDS)) $common \
  --backends flashinfer nvfp4_sparse --startup-timeout 330 > "$OUT/a.txt" 2>&1
log "e2e a (flashinfer, ours) rc $?: $(grep -hiE 'tok/s' "$OUT/a.txt" | tail -6 | tr '\n' '|')"
if [ $SECONDS -lt $((LIMIT - 140)) ]; then
  NVFP4_SPARSE_PREDECODE=off E2E_TAG=o OUT=$OUT bash bench/gpu_e2e.sh --budget-s $((LIMIT - 10 - SECONDS)) $common \
    --backends nvfp4_sparse --startup-timeout 120 > "$OUT/o.txt" 2>&1
  log "e2e o (ours, PREDECODE=off) rc $?: $(grep -hiE 'tok/s' "$OUT/o.txt" | tail -4 | tr '\n' '|')"
fi
(cd "$OUT" && tar czf all.tgz pytest_* variants_* a a.txt o o.txt 2>/dev/null && rm -rf a a.txt o o.txt variants_r1.txt)
log "done"
