#!/usr/bin/env bash
# Install the FlyDSL compile-check toolchain (idempotent).
#
#   scripts/setup_flydsl.sh [VENV]
#
# * flydsl==0.4.2 into VENV (default: the python on PATH). Its wheel imports torch and numpy
#   without declaring them; both come with the project's requirements.
# * ld.lld >= 19 (Debian lld-19 through apt-get when missing): FlyDSL links the gfx950 code
#   object with $ROCM_PATH/llvm/bin/ld.lld, and lld-14 rejects it ("unknown abi version").
# * .rocm/llvm/bin/ld.lld -> that linker: a project-local ROCM_PATH (git-ignored), so no ROCm
#   install is needed. sglang_nvfp4.kernels.flydsl.compile_check points ROCM_PATH at it.
set -euo pipefail

FLYDSL_VERSION=0.4.2
LLD_MIN=19
root="$(cd "$(dirname "$0")/.." && pwd)"

if [[ $# -ge 1 ]]; then
    py="$1/bin/python"
else
    py="$(command -v python3 || command -v python)"
fi
[[ -x "$py" ]] || { echo "setup_flydsl: no python at $py" >&2; exit 1; }

if [[ "$("$py" -c 'import importlib.metadata as m; print(m.version("flydsl"))' 2>/dev/null)" != "$FLYDSL_VERSION" ]]; then
    "$py" -m pip install -q "flydsl==$FLYDSL_VERSION"
fi
"$py" -c 'import torch, numpy' 2>/dev/null || {
    echo "setup_flydsl: flydsl imports torch and numpy, which $py lacks: install the project requirements first" >&2
    exit 1
}

lld_version() {  # major version of the ld.lld at $1, 0 if none
    "$1" --version 2>/dev/null | sed -n 's/.*LLD \([0-9][0-9]*\)\..*/\1/p' | head -n1 | grep . || echo 0
}

find_lld() {  # newest ld.lld-N (or plain ld.lld) with N >= LLD_MIN
    local cand
    for cand in $(ls /usr/bin/ld.lld-* /usr/lib/llvm-*/bin/ld.lld 2>/dev/null | sort -V -r) "$(command -v ld.lld || true)"; do
        [[ -n "$cand" && -x "$cand" ]] || continue
        if (( $(lld_version "$cand") >= LLD_MIN )); then
            echo "$cand"
            return 0
        fi
    done
    return 1
}

if ! lld="$(find_lld)"; then
    if ! command -v apt-get >/dev/null; then
        echo "setup_flydsl: need ld.lld >= $LLD_MIN and apt-get is not available; install LLD $LLD_MIN+" >&2
        exit 1
    fi
    sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "lld-$LLD_MIN"
    lld="$(find_lld)" || { echo "setup_flydsl: lld-$LLD_MIN installed but no ld.lld >= $LLD_MIN found" >&2; exit 1; }
fi

mkdir -p "$root/.rocm/llvm/bin"
ln -sfn "$lld" "$root/.rocm/llvm/bin/ld.lld"
echo "setup_flydsl: flydsl $FLYDSL_VERSION in $py; ROCM_PATH=$root/.rocm (ld.lld -> $lld, LLD $(lld_version "$lld"))"
