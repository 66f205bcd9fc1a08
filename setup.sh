#!/usr/bin/env bash
# ddptrain setup: installs what the build needs and builds a Release binary.
#
#   ./setup.sh            install missing Debian packages (if any), build ./build/ddptrain
#   ./setup.sh --tests    the same, plus the test suite (then: ctest --test-dir build)
#
# It prints one line per stage with its time; the full apt and CMake/Ninja
# output goes to $BUILD_DIR/setup.log, whose tail is printed on a failure.
# Idempotent: installed packages are skipped (so it works offline once they
# are there) and the build is incremental. A CUDA LibTorch is preferred when
# one is found: $Torch_DIR, $LIBTORCH, or the torch package importable by
# python3 when it was built with CUDA. Otherwise Debian's libtorch-dev (CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
BUILD_DIR=${BUILD_DIR:-build}
TARGETS=(ddptrain)
case "${1:-}" in
  "") ;;
  --tests) TARGETS=(ddptrain ddp_tests ddp_testworker) ;;
  *) echo "setup: unknown option '$1'. Hint: ./setup.sh builds ddptrain; ./setup.sh --tests adds the test suite." >&2; exit 2 ;;
esac

mkdir -p "$BUILD_DIR"
LOG="$BUILD_DIR/setup.log"
: > "$LOG"
T_START=$SECONDS
say() { printf 'setup: %s\n' "$*"; }
# stage "what" command...: runs the command with its output in the log,
# then prints what it did and how long it took; on failure, the log's tail.
stage() {
  local what=$1 t0=$SECONDS; shift
  printf 'setup: %-58s' "$what ..."
  echo "=== $what: $*" >> "$LOG"
  if "$@" >> "$LOG" 2>&1; then
    printf ' %4d s\n' $((SECONDS - t0))
  else
    local rc=$?
    printf ' FAILED after %d s\n' $((SECONDS - t0))
    echo "setup: the last lines of $LOG:" >&2
    tail -n 25 "$LOG" | sed 's/^/  | /' >&2
    say "error: '$what' failed (exit $rc). Full output: $LOG" >&2
    exit 1
  fi
}

# --- 0. Disk. The build and the tests need it: precompiled headers alone are 1.2 GB
# with the tests, and the tests write up to ~1 GB under /tmp. A disk that
# fills mid-build or mid-test fails with errors that hide the cause.
# A build already there counts: a rebuild reuses its space.
need_mb=1200; [[ ${#TARGETS[@]} -gt 1 ]] && need_mb=3000
free_mb=$(df -Pm "$BUILD_DIR" | awk 'NR==2 {print $4}')
have_mb=$(du -sm "$BUILD_DIR" 2>/dev/null | cut -f1)
more_mb=$((need_mb - ${have_mb:-0}))
if [[ -n "$free_mb" && "$free_mb" -lt "$more_mb" ]]; then
  say "error: $free_mb MB free on the disk of $BUILD_DIR; building ${TARGETS[*]} needs about $more_mb MB more. Hint: free some space, or BUILD_DIR=<a folder on a larger disk> ./setup.sh ${1:-}" >&2
  exit 1
fi

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
else
  say "LibTorch: Debian's libtorch-dev (CPU, Gloo)"
fi

# --- 2. Debian packages -----------------------------------------------------
# iproute2: the multi-node test gives each "node" its own network namespace
# with `ip netns` (it falls back to loopback without it).
PKGS=(build-essential cmake ninja-build ccache libcli11-dev nlohmann-json3-dev libgtest-dev
      zlib1g-dev libpng-dev libjpeg-dev libarchive-dev iproute2)
# OpenBLAS: Debian's libtorch calls the system BLAS, and the reference one is ~10x slower.
# fortunes: 2.6 MB of English text, the default corpus of --task lm (read as bytes).
[[ -z "$TORCH_PREFIX" ]] && PKGS+=(libtorch-dev libgloo-dev dataset-fashion-mnist fortunes libopenblas0-pthread)
# The tests' real PyTorch (the same 1.13.1): torchrun launching ddptrain, and
# torch.load reading ddptrain's checkpoints; Open MPI's mpirun launching it.
[[ -z "$TORCH_PREFIX" && ${#TARGETS[@]} -gt 1 ]] && PKGS+=(python3-torch openmpi-bin)
missing=()
have_headers() { for h in CLI/CLI.hpp nlohmann/json.hpp gtest/gtest.h zlib.h jpeglib.h png.h; do [[ -f /usr/include/$h ]] || return 1; done; }
if [[ -n "$TORCH_PREFIX" ]] && have_headers; then
  say "packages: none needed (CUDA LibTorch and the header-only libraries are present)"
elif command -v dpkg-query >/dev/null; then
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
fi
if ((${#missing[@]})); then
  say "installing ${#missing[@]} package(s) and their dependencies: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  install_packages() {
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" &&
      $SUDO apt-get clean   # the downloaded .deb files (1.5 GB with LibTorch): the build needs the disk
  }
  if [[ -n "$TORCH_PREFIX" ]]; then
    # The headers already here may do: go on without them.
    printf 'setup: %-58s' "apt-get install ..."
    t0=$SECONDS
    if install_packages >> "$LOG" 2>&1; then printf ' %4d s\n' $((SECONDS - t0))
    else printf ' failed; continuing with the headers on this machine (see %s)\n' "$LOG"; fi
  else
    stage "apt-get install (Hint on failure: network access, or install by hand)" install_packages
  fi
elif [[ ${#PKGS[@]} -gt 0 && -z "$TORCH_PREFIX" ]]; then
  say "packages: all ${#PKGS[@]} already installed"
fi

# --- 3. Build ---------------------------------------------------------------
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
[[ -f "$BUILD_DIR/CMakeCache.txt" ]] && GEN=()   # keep the generator of an existing build
ARGS=(-DCMAKE_BUILD_TYPE=Release)
[[ -n "$TORCH_PREFIX" ]] && ARGS+=("-DCMAKE_PREFIX_PATH=$TORCH_PREFIX")
# Extra CMake options, e.g. DDP_CMAKE_ARGS="-DDDP_CUDA_KERNELS=OFF".
read -r -a EXTRA <<< "${DDP_CMAKE_ARGS:-}"
ARGS+=("${EXTRA[@]}")
JOBS=${JOBS:-$(nproc)}
stage "configure (cmake, $BUILD_DIR)" cmake -S . -B "$BUILD_DIR" "${GEN[@]}" "${ARGS[@]}"
stage "build ${TARGETS[*]} (-j $JOBS)" cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"
say "done in $((SECONDS - T_START)) s: $BUILD_DIR/ddptrain is ready; full log in $LOG"
