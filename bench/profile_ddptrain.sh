#!/usr/bin/env bash
# ddptrain's side of the kernel profiles: `ddptrain bench --profile-trace`
# (LibTorch's Kineto profiler, in process), kernel time per step grouped by
# bench/kernel_breakdown.py into the classes of bench/profile_step.py.
#   bash bench/profile_ddptrain.sh c [extra ddptrain bench flags]   # config (c), ResNet-50
#   bash bench/profile_ddptrain.sh e [extra ddptrain bench flags]   # config (e), GPT-2 124M
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CONFIG=${1:-c}; shift || true
OUT=${OUT:-/tmp/prof}; mkdir -p "$OUT"
STEPS=${STEPS:-10}
case "$CONFIG" in
  c) FLAGS=(--model resnet50 --image-size 224 --batch 256 --optimizer adam --lr 1e-4 --amp bf16 --channels-last on); GPT=() ;;
  e) FLAGS=(--task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1); GPT=(--gpt) ;;
  *) echo "profile_ddptrain.sh: config '$CONFIG' is not c or e" >&2; exit 2 ;;
esac
TRACE="$OUT/ddptrain_${CONFIG}.json"
LINE=$(./build/ddptrain bench "${FLAGS[@]}" --bench-steps "$STEPS" --profile-trace "$TRACE" "$@" | grep '^{' | tail -1)
WALL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$LINE")
LABEL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["contender"])' "$LINE")
python3 bench/kernel_breakdown.py "$TRACE" --steps "$STEPS" --wall-ms "$WALL" --label "$LABEL" "${GPT[@]}" --top 12 --by-op 15
