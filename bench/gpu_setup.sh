# Sourced by the bench/gpu_*.sh device scripts (repository root, device call with `carry: [".gpu"]`):
# unpacks the offline bundle (SGLang 0.5.23 + FlashInfer 0.7.2, built by scripts/build_gpu_bundle.sh into
# .gpu/site.tar.xz) to /tmp/site (once per machine), registers the plugin's entry point, exports the
# environment, and writes the GPU / torch / FlashInfer versions to $OUT/log.txt.
#   OUT=... ; source bench/gpu_setup.sh
# With NVFP4_REQUIRE_GPU set (e.g. H200), a GPU whose name lacks it stops the call here, before the bundle is
# unpacked: a call that asks for one kind may get another, and figures for a target GPU must come from that GPU.
: "${OUT:?set OUT before sourcing bench/gpu_setup.sh}"
mkdir -p "$OUT" /tmp/site
ts() { date +%H:%M:%S; }
if [ -n "${NVFP4_REQUIRE_GPU:-}" ]; then
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$gpu_name" in
    *"$NVFP4_REQUIRE_GPU"*) ;;
    *) echo "[$(ts)] NVFP4_REQUIRE_GPU=$NVFP4_REQUIRE_GPU but this GPU is '${gpu_name:-none found}': nothing run" \
         | tee -a "$OUT/log.txt"
       return 1 ;;
  esac
fi
# A warm machine keeps /tmp: unpack again only when the bundle differs from the one unpacked.
stamp=$(stat -c %s-%Y .gpu/site.tar.xz) || return 1
if [ "$(cat /tmp/site/.bundle_stamp 2>/dev/null)" != "$stamp" ]; then
  echo "[$(ts)] unpacking .gpu/site.tar.xz to /tmp/site" | tee -a "$OUT/log.txt"
  tar xJf .gpu/site.tar.xz -C /tmp/site || return 1
  echo "$stamp" > /tmp/site/.bundle_stamp
fi
# The host has no network: register the plugin's entry point with a minimal dist-info instead of pip.
info=/tmp/site/sglang_nvfp4-0.1.0.dist-info
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: sglang-nvfp4\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[sglang.srt.plugins]\nnvfp4_sparse = sglang_nvfp4.sglang.plugin:register\n' > "$info/entry_points.txt"
export PYTHONPATH="$PWD:/tmp/site:$PYTHONPATH" PYTHONUNBUFFERED=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# FlashInfer compiles its kernels with nvcc and ninja on first use: the bundled ninja, and a JIT cache that a
# warm machine keeps between calls (outside the repository copy, which each call replaces).
ninja_bin=$(ls -d /tmp/site/ninja-*.data/scripts 2>/dev/null | head -1)
[ -n "$ninja_bin" ] && chmod +x "$ninja_bin/ninja" && export PATH="$PATH:$ninja_bin"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
# Multi-GPU hosts of this workplace: NVLink multicast stays off (KINDS.md), in every child process too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$OUT/log.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" \
  | tee -a "$OUT/log.txt"
python3 -c "import time; t = time.time(); import flashinfer; print('flashinfer', flashinfer.__version__, 'import %.1f s' % (time.time() - t))" \
  2>&1 | tail -1 | tee -a "$OUT/log.txt"
echo "ninja: $(command -v ninja || echo missing), nvcc: $(command -v nvcc || echo missing)" | tee -a "$OUT/log.txt"
# kill_leftovers DIR: the bench scripts start servers and benchmarks in their own process groups and
# list them in DIR/child_pgids.txt; end any of those groups still alive (after a hard kill of the script).
kill_leftovers() {
  [ -f "$1/child_pgids.txt" ] || return 0
  while read -r pgid; do
    kill -KILL -- "-$pgid" 2>/dev/null && echo "[$(ts)] killed leftover process group $pgid" | tee -a "$OUT/log.txt"
  done < "$1/child_pgids.txt"
  return 0
}
