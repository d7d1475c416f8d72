#!/usr/bin/env bash
# One device call on the H200 host (repository root, `carry: [".gpu"]`): SGLang end to end,
# nvfp4_sparse vs triton (bench/bench_e2e.py). Selected results and logs land in $OUT.
#   bash bench/gpu_e2e.sh [bench_e2e.py args...]
set -o pipefail
OUT=${OUT:-/tmp/nvfp4-e2e-out}
WORK=/tmp/nvfp4-e2e
mkdir -p "$OUT" "$WORK" /tmp/site
tar xJf .gpu/site.tar.xz -C /tmp/site
# The host has no network: register the plugin's entry point with a minimal dist-info instead of pip.
info=/tmp/site/sglang_nvfp4-0.1.0.dist-info
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: sglang-nvfp4\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[sglang.srt.plugins]\nnvfp4_sparse = sglang_nvfp4.sglang.plugin:register\n' > "$info/entry_points.txt"
export PYTHONPATH="$PWD:/tmp/site:$PYTHONPATH" PYTHONUNBUFFERED=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/log.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log.txt"
python3 bench/bench_e2e.py --out "$WORK" "$@" 2>&1 | tee -a "$OUT/log.txt"
for f in e2e.json e2e.png server_nvfp4_sparse.log server_triton.log one_batch_nvfp4_sparse.log one_batch_triton.log; do
  [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
