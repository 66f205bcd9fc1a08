#!/usr/bin/env bash
# Issue 15, session 21: the parameters' bf16 copies and gradient slots
# (include/ddp/dist/param_slots.h) on the GPU, in one device call:
#   1. build this tree with the tests, and main (a `git archive` of the
#      commit before, carried as .data/main.tar) beside it, ddptrain only;
#   2. the CUDA tests of the linear and LayerNorm kernels, the GPT and LM;
#   3. (e) graphed, main against this tree, alternating, twice each;
#   4. this tree's graphed step profiled: kernel count, idle gaps; then
#      its eager step by ATen op, while the call has time.
#   bash bench/exp/slots_gpu.sh   (logs under $OUT/slots)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}/slots; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
log build
mkdir -p /tmp/main && tar -xf .data/main.tar -C /tmp/main
(cd /tmp/main && JOBS=6 ./setup.sh > "$OUT/build_main.log" 2>&1; echo "main build rc $?" >> "$OUT/build_main.log") &
JOBS=10 ./setup.sh --tests > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
wait; tail -1 "$OUT/build_main.log"
log "CUDA tests"
timeout 200 ctest --test-dir build -j 4 --timeout 150 --output-on-failure \
  -R 'ParamSlots|GemmGelu|FusedLinear|FusedLayerNorm|CrossEntropy.*_CUDA|Gpt\..*_CUDA|LmTask\..*_CUDA' > "$OUT/tests.log" 2>&1
grep -E 'tests passed|FAILED|Failed|\*\*\*' "$OUT/tests.log" | head -30
base=(--task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --gelu tanh)
gpt=("${base[@]}" --bench-steps 30 --cuda-graph)
log "(e) A/B, graphed, tanh GELU"
for i in 1 2; do
  for tree in /tmp/main .; do
    echo -n "$tree "; timeout 60 "$tree/build/ddptrain" bench "${gpt[@]}" 2>>"$OUT/e.err" | grep '^{'
  done
done | tee "$OUT/ab.jsonl"
grep -iE "error|terminate|what\(\)" "$OUT/e.err" | head -5
log "profile, graphed"
LINE=$(timeout 120 ./build/ddptrain bench "${base[@]}" --bench-steps 10 --cuda-graph --profile-trace "$OUT/trace.json" 2>>"$OUT/e.err" | grep '^{' | tail -1)
WALL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$LINE")
python3 bench/kernel_breakdown.py "$OUT/trace.json" --steps 10 --wall-ms "$WALL" --gpt --top 40 --gaps 15 --by-stream | tee "$OUT/breakdown.txt"
gzip -f "$OUT/trace.json"
if (( SECONDS < 420 )); then
  log "profile, eager, by op"
  LINE=$(timeout 90 ./build/ddptrain bench "${base[@]}" --bench-steps 10 --profile-trace "$OUT/trace_eager.json" 2>>"$OUT/e.err" | grep '^{' | tail -1)
  WALL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$LINE")
  python3 bench/kernel_breakdown.py "$OUT/trace_eager.json" --steps 10 --wall-ms "$WALL" --gpt --by-op 40 | tee "$OUT/breakdown_eager.txt"
  gzip -f "$OUT/trace_eager.json"
fi
log done
