#!/usr/bin/env bash
# ddptrain setup: installs what the build needs and builds a Release binary.
#
#   ./setup.sh            install missing Debian packages (if any), build ./build
#
# Idempotent: installed packages are skipped (so it works offline once they
# are there) and the build is incremental. A CUDA LibTorch is preferred when
# one is found: $Torch_DIR, $LIBTORCH, or the torch package importable by
# python3 when it was built with CUDA. Otherwise Debian's libtorch-dev (CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
BUILD_DIR=${BUILD_DIR:-build}

say() { printf 'setup: %s\n' "$*"; }

# --- 1. Which LibTorch ----------------------------------------------------
TORCH_PREFIX=""
if [[ -n "${Torch_DIR:-}" ]]; then
  TORCH_PREFIX="$Torch_DIR"; say "LibTorch from Torch_DIR=$Torch_DIR"
elif [[ -n "${LIBTORCH:-}" ]]; then
  TORCH_PREFIX="$LIBTORCH"; say "LibTorch from LIBTORCH=$LIBTORCH"
elif command -v python3 >/dev/null && python3 - <<'PY' 2>/dev/null
import torch, sys
sys.exit(0 if torch.version.cuda else 1)
PY
then
  TORCH_PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  say "CUDA LibTorch from the python3 torch package: $TORCH_PREFIX"
fi

# --- 2. Debian packages -----------------------------------------------------
# iproute2: the multi-node test gives each "node" its own network namespace
# with `ip netns` (it falls back to loopback without it).
PKGS=(build-essential cmake ninja-build ccache libcli11-dev nlohmann-json3-dev libgtest-dev
      zlib1g-dev libpng-dev libjpeg-dev iproute2)
# OpenBLAS: Debian's libtorch calls the system BLAS, and the reference one is ~10x slower.
[[ -z "$TORCH_PREFIX" ]] && PKGS+=(libtorch-dev libgloo-dev dataset-fashion-mnist libopenblas0-pthread)
missing=()
have_headers() { for h in CLI/CLI.hpp nlohmann/json.hpp gtest/gtest.h zlib.h jpeglib.h png.h; do [[ -f /usr/include/$h ]] || return 1; done; }
if [[ -n "$TORCH_PREFIX" ]] && have_headers; then
  say "CUDA LibTorch and the header-only libraries are present; no packages needed"
elif command -v dpkg-query >/dev/null; then
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
fi
if ((${#missing[@]})); then
  say "installing: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"; }; then
    if [[ -n "$TORCH_PREFIX" ]]; then
      say "apt-get failed; continuing with the headers already on this machine"
    else
      say "error: could not install ${missing[*]}. Hint: run 'apt-get update' with network access, or install them by hand."
      exit 1
    fi
  fi
else
  say "Debian packages already installed"
fi

# --- 3. Build ---------------------------------------------------------------
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
[[ -f "$BUILD_DIR/CMakeCache.txt" ]] && GEN=()   # keep the generator of an existing build
ARGS=(-DCMAKE_BUILD_TYPE=Release)
[[ -n "$TORCH_PREFIX" ]] && ARGS+=("-DCMAKE_PREFIX_PATH=$TORCH_PREFIX")
# Extra CMake options, e.g. DDP_CMAKE_ARGS="-DDDP_CUDA_KERNELS=OFF".
read -r -a EXTRA <<< "${DDP_CMAKE_ARGS:-}"
ARGS+=("${EXTRA[@]}")
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" "${ARGS[@]}" >/dev/null
JOBS=${JOBS:-$(nproc)}
cmake --build "$BUILD_DIR" -j "$JOBS"
say "built $BUILD_DIR/ddptrain"
