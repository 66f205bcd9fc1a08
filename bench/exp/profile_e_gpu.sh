#!/usr/bin/env bash
# Issue 15, session 21: where the graphed (e) step's time goes. One device call:
# build ddptrain (no tests), (e) graphed as a baseline, the graphed step's
# profile with idle gaps and per-stream busy time, and the eager step's profile
# by ATen op (a graph's kernels have no launching op), 40 rows each.
#   bash bench/exp/profile_e_gpu.sh   (logs under $OUT/pe)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}/pe; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
if [[ ! -x build/ddptrain ]]; then
  log build
  JOBS=$(nproc) ./setup.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
gpt=(--task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --gelu tanh)
log "(e) graphed baseline"
for i in 1 2; do timeout 60 ./build/ddptrain bench "${gpt[@]}" --bench-steps 30 --cuda-graph 2>>"$OUT/e.err" | grep '^{'; done | tee "$OUT/e.jsonl"
for g in true false; do
  log "profile --cuda-graph=$g"
  LINE=$(timeout 120 ./build/ddptrain bench "${gpt[@]}" --bench-steps 10 --cuda-graph=$g --profile-trace "$OUT/trace_$g.json" 2>>"$OUT/e.err" | grep '^{' | tail -1)
  echo "$LINE"
  WALL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$LINE")
  extra=(--gaps 15 --by-stream); [[ $g == false ]] && extra=(--by-op 40 --shapes)
  python3 bench/kernel_breakdown.py "$OUT/trace_$g.json" --steps 10 --wall-ms "$WALL" --gpt --top 45 "${extra[@]}" | tee "$OUT/breakdown_$g.txt"
  gzip -f "$OUT/trace_$g.json"
done
log done
