#!/usr/bin/env bash
# Compile ddptrain's CUDA sources (src/cuda/*.cu, or the files given) on a
# machine without a GPU, to catch compile errors before a device call. It
# uses the local nvcc and Debian's LibTorch 1.13 headers (the CPU package
# ships ATen's CUDA headers but not the one CMake generates, which an empty
# stand-in replaces). Nothing is linked or run.
#   bash scripts/cuda_compile_check.sh [file.cu ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
[[ -x $NVCC ]] || { echo "error: no nvcc at $NVCC; set NVCC=/path/to/nvcc" >&2; exit 2; }
stub=$(mktemp -d); trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/c10/cuda/impl" && echo '#pragma once' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
files=("$@"); [[ ${#files[@]} -gt 0 ]] || files=(src/cuda/*.cu)
for f in "${files[@]}"; do
  echo "nvcc -c $f"
  if ! "$NVCC" -std=c++17 -arch=sm_90 -c "$f" -o "$stub/out.o" -I "$stub" -I include -I src \
      -I /usr/include/torch/csrc/api/include -DDDP_WITH_CUDA=1 -DDDP_WITH_CUDA_KERNELS=1 \
      -D_GLIBCXX_USE_CXX11_ABI=1 > "$stub/log" 2>&1; then
    cat "$stub/log"; echo "error: $f does not compile" >&2; exit 1
  fi
  grep -E "warning" "$stub/log" | grep -v -E "/usr/include/(torch|ATen|c10)/" || true
done
