#!/usr/bin/env bash
# Issue 17 on one H200 (repository root, device call with `carry: [".gpu"]`), in stages:
#   bash bench/gpu_selection.sh [train] [tests] [bench] [eval=MODEL_DIR]
# train   trains two retrieval-model variants (sglang_nvfp4.quality.train: both task families, contexts up to
#         32K; TRAIN_VARIANTS="ARGS|ARGS" their arguments) in the background for TRAIN_SECONDS (default 240)
#         -> $OUT/models.tgz, $OUT/train_*.log
# tests   the compiled GPU tests of the indexers and kernels (budgets 32 and 64 included) -> $OUT/pytest.txt,
#         while training runs (correctness only)
# bench   bench/bench_selection.py (after training ends: no shared GPU while timing) -> $OUT/selection_h200.json
# eval=D  sglang_nvfp4.quality.evaluate of model D through real servers, EVAL_ARGS appended, at most
#         EVAL_SECONDS (default 480) -> $OUT/eval/quality.{json,md,png}, server logs
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-selection-out}
WORK=/tmp/nvfp4-selection
mkdir -p "$WORK"
source bench/gpu_setup.sh || exit 1
rc=0
train_pids=()
for stage in "$@"; do
  case "$stage" in
    train)
      # TRAIN_VARIANTS: the two variants' extra arguments, separated by '|' (default: hidden 128 and 256).
      IFS='|' read -r -a variants <<< "${TRAIN_VARIANTS:---hidden-size 128 --intermediate-size 256|--hidden-size 256 --intermediate-size 512}"
      for i in 0 1; do
        echo "[$(ts)] training variant $i: ${variants[$i]}" | tee -a "$OUT/log.txt"
        python3 -m sglang_nvfp4.quality.train --out "$WORK/model_$i" --device cuda --steps 100000 \
          --time-limit "${TRAIN_SECONDS:-240}" --lr 1e-3 ${variants[$i]} > "$OUT/train_$i.log" 2>&1 &
        train_pids+=($!)
      done ;;
    tests)
      python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_kernels_gpu.py tests/test_proxy_indexer.py \
        tests/test_indexer_triton.py tests/test_learned_indexer.py 2>&1 | tee "$OUT/pytest.txt" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    bench)
      if [ ${#train_pids[@]} -gt 0 ]; then
        wait "${train_pids[@]}"
        train_pids=()
        (cd "$WORK" && tar czf "$OUT/models.tgz" model_0 model_1)
        echo "[$(ts)] training done" | tee -a "$OUT/log.txt"
      fi
      timeout -k 10 "${BENCH_SECONDS:-300}" python3 bench/bench_selection.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    eval=*)
      model=${stage#eval=}
      mkdir -p "$OUT/eval"
      timeout -k 10 "${EVAL_SECONDS:-480}" python3 -m sglang_nvfp4.quality.evaluate --model "$model" \
        --out "$WORK/eval" --gpus 0 ${EVAL_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      kill_leftovers "$WORK/eval"
      cp "$WORK"/eval/quality.* "$OUT/eval/" 2>/dev/null
      (cd "$WORK/eval" && tar czf "$OUT/eval/server_logs.tgz" server_*.log 2>/dev/null) ;;
    *)
      echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
if [ ${#train_pids[@]} -gt 0 ]; then
  wait "${train_pids[@]}"
  (cd "$WORK" && tar czf "$OUT/models.tgz" model_0 model_1)
fi
echo "[$(ts)] done (rc $rc); in \$OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/log.txt"
exit $rc
