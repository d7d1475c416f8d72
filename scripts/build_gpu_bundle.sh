#!/usr/bin/env bash
# Build the offline site-packages bundle for the CUDA benchmark host: SGLang 0.5.23, FlashInfer 0.7.2 (the
# version SGLang 0.5.23 pins) and what both import at start-up, for a host whose Python 3.12 already has
# torch 2.11.0+cu130, triton 3.6, transformers, numpy and nvcc, but no network.
#
#   bash scripts/build_gpu_bundle.sh [OUT]      # default OUT: .gpu  ->  OUT/site.tar.xz
#
# The bundle travels with every device call next to the repository, 64 MiB in all, so it is trimmed:
# - sglang-kernel 0.4.5 (built against torch 2.11; 0.4.10 needs torch 2.14): its sm90 ops and Python files
#   only, without FA3's 1.1 GB flash_ops library, FlashMLA, InfLLM and sm100 code.
# - FlashInfer: the CUDA sources (data/csrc) of ops this project never runs (FlashInfer's `cake_*` ops,
#   KDA/GDN linear attention, fused MoE, Blackwell-only kernels, experimental ops); the attention, paging,
#   norm, sampling and top-k sources stay, so their JIT builds work on the host.
#   CUTLASS and CCCL keep their headers; their examples, tests and Python packages go.
# - SGLang's multimodal generation package (diffusion serving) and the Rust benchmark client and gRPC
#   extensions (loaded only with `--grpc-port`/`--grpc-mode` or the Rust benchmark client).
# At run time (bench/gpu_setup.sh does this): SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 (0.4.5 < the 0.4.9
# SGLang asks for), SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python (the Rust radix core is built against
# torch 2.14), the bundled ninja on PATH, FLASHINFER_WORKSPACE_BASE for FlashInfer's JIT cache.
# Models whose MLP uses SGLang's CuTe-DSL dual GEMM (Llama, Qwen2/3 dense) need nvidia-cutlass-dsl, which is
# not bundled: use Granite/Olmo2-style or MoE configs with --load-format dummy on that host.
set -euo pipefail
OUT=$(realpath -m "${1:-.gpu}")
# 64 MiB travel per device call: the bundle gets what the repository's tracked files leave, less 1 MiB of room. (On
# 2026-12-07 a call with the 53 MiB bundle and a 10.5 MiB repository was refused; the repository is now 9 MiB.)
REPO_BYTES=$(cd "$(dirname "$0")/.." && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
LIMIT_MIB=${BUNDLE_LIMIT_MIB:-$(( (64 * 1048576 - ${REPO_BYTES:-0}) / 1048576 - 1 ))}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$WORK/whl" "$WORK/site"

PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLAT="$PLAT --platform $p"
done
SGLANG_PKGS="sglang==0.5.23 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 fastapi starlette uvicorn gguf
jsonschema jsonschema-specifications referencing rpds-py msgspec openai==2.8.0 jiter distro sniffio
orjson partial_json_parser pybase64 pyzmq setproctitle soundfile==0.13.1 xgrammar==0.2.7 loguru
annotated-doc pydantic pydantic_core annotated-types typing-inspection python-multipart dill
ipython ipython-pygments-lexers jedi parso traitlets matplotlib-inline stack-data executing
asttokens pure-eval pexpect ptyprocess prompt-toolkit wcwidth cffi pycparser opentelemetry-api
truststore httpcore2 httpx2"
FLASHINFER_PKGS="flashinfer-python==0.7.2 nvidia-ml-py ninja einops click tabulate requests urllib3 idna
charset-normalizer certifi tqdm"
for p in $SGLANG_PKGS $FLASHINFER_PKGS; do pip download -q --no-deps $PLAT -d "$WORK/whl" "$p"; done
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d "$WORK/whl" sglang-kernel==0.4.5

for w in "$WORK"/whl/*.whl; do
  case "$w" in
    *sglang_kernel*) unzip -q -o "$w" -d "$WORK/site" -x 'sgl_kernel/flash_ops*' 'sgl_kernel/infllm_ops*' \
                       'sgl_kernel/flashmla_ops*' 'sgl_kernel/sm100/*' ;;
    *) unzip -q -o "$w" -d "$WORK/site" ;;
  esac
done

csrc="$WORK/site/flashinfer/data/csrc"
test -d "$csrc" || { echo "flashinfer wheel layout changed: no $csrc" >&2; exit 1; }
( cd "$csrc" && rm -rf cake_* kda gdn fused_moe blackwell_* experimental alphamoe* )
( cd "$WORK/site/flashinfer/data" && rm -rf cutlass/examples cutlass/test cutlass/python cutlass/docs \
    cccl/python cccl/ci cccl/docs cccl/examples )
rm -rf "$WORK/site/sglang/multimodal_gen" "$WORK"/site/sglang/srt/rust_extensions/_{bench,grpc}.*.so
find "$WORK/site" -name __pycache__ -prune -exec rm -rf {} +

tar cf - -C "$WORK/site" . | xz -T0 -6 > "$OUT/site.tar.xz.new"
mv "$OUT/site.tar.xz.new" "$OUT/site.tar.xz"
size=$(stat -c %s "$OUT/site.tar.xz")
echo "$OUT/site.tar.xz: $((size / 1048576)) MiB ($size bytes)"
if [ "$size" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "bundle is over ${LIMIT_MIB} MiB: it would not travel with the repository in one device call" >&2
  exit 1
fi
