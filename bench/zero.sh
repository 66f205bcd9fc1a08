#!/usr/bin/env bash
# Sharded optimizer state on several GPUs (issue 46, item 4): peak memory
# and tokens/s of `ddptrain bench --task lm` unsharded, with
# --shard-optimizer (ZeRO-1) and with --shard-gradients (ZeRO-2), on 2, 4 and 8 ranks of one machine, bf16,
# AdamW, context 1024. Not run yet: it needs a machine with several GPUs.
#
#   bench/zero.sh OUT.jsonl [MODEL [BATCH [RANKS...]]]
#   bench/zero.sh zero.jsonl gpt2-xl 8 2 4 8
#
# One JSON line per run goes to OUT.jsonl (the bench's own, plus "ranks"
# and "sharded": no, zero1 or zero2), and a table to stdout: the peak per GPU
# should fall by about 8 bytes x parameters x (N-1)/N with ZeRO-1 (12 GB x
# 7/8 for gpt2-xl on 8), and by 4 bytes x parameters x (N-1)/N more with ZeRO-2.
set -euo pipefail

OUT=${1:?usage: bench/zero.sh OUT.jsonl [MODEL [BATCH [RANKS...]]]}
MODEL=${2:-gpt2-xl}
BATCH=${3:-8}
shift $(($# < 3 ? $# : 3))
RANKS=("$@")
[ ${#RANKS[@]} -gt 0 ] || RANKS=(2 4 8)
DDPTRAIN=${DDPTRAIN:-build/ddptrain}
: >"$OUT"
for n in "${RANKS[@]}"; do
  for sharded in no zero1 zero2; do
    flags=()
    [ "$sharded" = zero1 ] && flags+=(--shard-optimizer)
    [ "$sharded" = zero2 ] && flags+=(--shard-gradients)
    line=$("$DDPTRAIN" bench --task lm --model "$MODEL" --batch "$BATCH" --amp bf16 --optimizer adamw --lr 6e-4 \
      --weight-decay 0.1 --bench-steps 20 --size "$n" "${flags[@]}" | grep '^{' | tail -1)
    echo "$line" | python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); j["sharded"]=sys.argv[1]; print(json.dumps(j))' "$sharded" >>"$OUT"
  done
done
python3 - "$OUT" <<'EOF'
import json, sys
print(f"{'model':10} {'ranks':>5} {'sharded':>8} {'peak MiB/GPU':>13} {'tokens/s':>10}")
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"{r['model']:10} {r['ranks']:>5} {str(r['sharded']):>8} {r['peak_mem_mib']:>13.0f} {r['tokens_per_s']:>10.0f}")
EOF
