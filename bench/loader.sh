#!/usr/bin/env bash
# Builds and runs the loader benchmark (bench/loader_bench.cpp): images/s out
# of ddp::data::Loader for 0, 1, 2, 4, ... worker threads (up to nproc) on a
# generated Fashion-MNIST PNG folder and a folder of synthetic JPEGs, and on
# 2000 x 1500 JPEGs decoded in full and at reduced scale.
#
#   bench/loader.sh [loader_bench flags, e.g. --jpegs 2000 --max-workers 16]
#   bench/loader.sh --fmnist 0 --jpegs 0 --large-jpegs 200    (only the large JPEGs)
#
# The image folders are generated once under $TMPDIR/ddp_loader_bench (or
# --dir) and reused. Record the table in bench/RESULTS.md with the date and
# the machine (nproc, lscpu's model name).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
  cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build "$BUILD_DIR" --target loader_bench -j "${JOBS:-$(nproc)}"
echo "machine: $(nproc) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(date -u '+%Y-%m-%d %H:%M UTC')"
exec "$BUILD_DIR/loader_bench" "$@"
