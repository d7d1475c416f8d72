#!/usr/bin/env bash
# One device call on an H200 host (repository root, `carry: [".gpu", ".baseline"]`): bench_e2e.py of a base
# checkout against this tree, alternating on the same GPU (base, new, base, new, ...), for an end-to-end
# before/after in one run. BASE_TREE is a whole checkout of the base commit (its own bench/ scripts run it).
#   bash bench/gpu_e2e_ab.sh BASE_TREE ROUNDS [bench_e2e.py args...]
# In $OUT: log.txt and one e2e.json per run (base1.json, new1.json, ...).
set -o pipefail
base=${1:?usage: bash bench/gpu_e2e_ab.sh BASE_TREE ROUNDS [bench_e2e.py args...]}
rounds=${2:?usage: bash bench/gpu_e2e_ab.sh BASE_TREE ROUNDS [bench_e2e.py args...]}
shift 2
[ -f "$base/bench/gpu_e2e.sh" ] || { echo "no bench/gpu_e2e.sh in $base"; exit 2; }
OUT=${OUT:-/tmp/nvfp4-ab-out}
repo=$PWD
source bench/gpu_setup.sh || exit 1
ln -sfn "$repo/.gpu" "$base/.gpu"
for round in $(seq "$rounds"); do
  for side in base new; do
    dir=$repo; [ "$side" = base ] && dir=$base
    echo "[$(ts)] $side round $round: bench_e2e.py $*" | tee -a "$OUT/log.txt"
    (cd "$dir" && OUT=/tmp/nvfp4-ab/$side$round bash bench/gpu_e2e.sh "$@" > /tmp/nvfp4-ab-$side$round.console 2>&1)
    cp "/tmp/nvfp4-ab/$side$round/e2e.json" "$OUT/$side$round.json" 2>/dev/null
    grep -E "tok/s|capacity|exit" "/tmp/nvfp4-ab-$side$round.console" | tee -a "$OUT/log.txt"
  done
done
