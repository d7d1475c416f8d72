#!/usr/bin/env bash
# One device call on an H200 host (repository root, `carry: [".gpu"]`): train the retrieval model
# (sglang_nvfp4.quality.train) and score it through SGLang, dense vs nvfp4_sparse settings
# (sglang_nvfp4.quality.evaluate). Two GPUs: two training variants in parallel, the better one (dense
# accuracy on held-out prompts, PyTorch) is evaluated with the settings spread over both GPUs.
#   bash bench/gpu_quality.sh            (TRAIN_SECONDS, EVAL_ARGS override the defaults)
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-quality-out}
WORK=/tmp/nvfp4-quality
source bench/gpu_setup.sh || exit 1
mkdir -p "$WORK"
TRAIN_SECONDS=${TRAIN_SECONDS:-240}
ngpu=$(nvidia-smi -L | wc -l)
variants=("--hidden-size 128 --intermediate-size 256 --lr 1e-3" "--hidden-size 256 --intermediate-size 512 --lr 1e-3")
for i in 0 1; do
  gpu=$(( i % ngpu ))
  echo "[$(ts)] training variant $i on GPU $gpu: ${variants[$i]}" | tee -a "$OUT/log.txt"
  CUDA_VISIBLE_DEVICES=$gpu python3 -m sglang_nvfp4.quality.train --out "$WORK/model_$i" --device cuda \
    --steps 100000 --time-limit "$TRAIN_SECONDS" ${variants[$i]} > "$OUT/train_$i.log" 2>&1 &
  [ "$ngpu" -lt 2 ] && wait
done
wait
best=$(python3 - "$WORK" <<'PY'
import json, sys, os
scores = {}
for i in (0, 1):
    try:
        acc = json.load(open(os.path.join(sys.argv[1], f"model_{i}", "training.json")))["dense_accuracy_pytorch"]
        scores[i] = sum(acc.values()) / len(acc)
    except OSError:
        pass
# Prefer the smaller model (variant 0, the CI fixture candidate) unless the larger is 2+ points better.
best = 1 if scores.get(1, -1) > scores.get(0, -1) + 0.02 else 0
print(best if scores.get(best, 0) >= 0.2 else "none")
PY
)
# Both trained models come back as one archive (the device tool returns at most 8 files).
(cd "$WORK" && tar czf "$OUT/models.tgz" model_0 model_1)
if [ "$best" = none ]; then echo "[$(ts)] no variant learned the task (dense accuracy < 0.2): no evaluation" | tee -a "$OUT/log.txt"; exit 1; fi
echo "[$(ts)] evaluating model_$best" | tee -a "$OUT/log.txt"
gpus=$(seq -s, 0 $((ngpu - 1)))
timeout "${EVAL_SECONDS:-330}" python3 -m sglang_nvfp4.quality.evaluate --model "$WORK/model_$best" --out "$WORK/eval" \
  --gpus "$gpus" ${EVAL_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
mkdir -p "$OUT/eval"
cp "$WORK"/eval/quality.* "$OUT/eval/" 2>/dev/null
(cd "$WORK/eval" && tar czf "$OUT/eval/server_logs.tgz" server_*.log 2>/dev/null)
echo "[$(ts)] done (model_$best)" | tee -a "$OUT/log.txt"
