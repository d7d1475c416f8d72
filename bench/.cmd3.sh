source bench/gpu_setup.sh >/dev/null 2>&1
timeout 260 python3 bench/bench_m3.py --out /tmp/w1 --steps server --backends triton --budget-s 240 2>&1 | grep -v "^\[.*short\|Capturing" | tail -8
cp /tmp/w1/m3.json $OUT/m3_server_triton.json
for g in graph eager; do
  extra=""; [ $g = eager ] && extra="--sglang-args=--disable-cuda-graph"
  timeout 150 python3 bench/bench_m3.py --out /tmp/w_$g --steps one_batch --backends nvfp4_sparse triton --input-lens 8192 --batch-sizes 1 --output-len 64 --budget-s 140 $extra 2>&1 | grep "1x8192\|capacity" | tail -4
  cp /tmp/w_$g/m3.json $OUT/m3_decode_$g.json
done
