#!/usr/bin/env bash
# One device call of this session: build with the tests, the side-by-side
# benchmark (configs a-d, bench/run.sh), then the GPU tests in what time is
# left. Logs in $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
log build
JOBS=$(nproc) ./setup.sh --tests > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; grep -E "error" "$OUT/build.log" | head; exit 1; }
log bench
OUT=$OUT/bench SEED=0 CONFIGS="${CONFIGS:-a b c}" PHASES="step fmnist" STEPS=${STEPS:-40} timeout ${BENCH_S:-330} bash bench/run.sh > "$OUT/bench.log" 2>&1
grep -vE "^\s*$" "$OUT/bench/table.md" 2>/dev/null | head -30 || tail -20 "$OUT/bench.log"
log ctest
(cd build && timeout ${CTEST_S:-150} ctest --output-on-failure -j 6 -R "${CTEST_REGEX:-_CUDA}" > "$OUT/ctest.log" 2>&1)
grep -E "tests passed|Failed|\*\*\*|Not Run|Passed" "$OUT/ctest.log" | tail -45
log end
