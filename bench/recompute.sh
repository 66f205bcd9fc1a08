#!/usr/bin/env bash
# Activation recomputation on one GPU (issue 46, item 3): for GPT-2 124M,
# 350M, 774M and 1.5B at context 1024, bf16, AdamW, the largest batch that
# fits and its tokens/s,
#   ddptrain   `ddptrain bench --task lm --recompute none|blocks` (eager)
#   resnet     `ddptrain bench --model resnet50 --image-size 224 --amp bf16
#              --recompute none|stages` (contenders resnet, resnet-rc; the
#              model name resnet50 selects them: bench/recompute.sh OUT resnet50)
#   PyTorch    bench/gpt_torch.py step --compile [--checkpoint]
#              (nanoGPT's model under torch.compile; --checkpoint puts each
#              block under torch.utils.checkpoint, non-reentrant)
# then both at the largest batch PyTorch fits, for tokens/s at equal batch.
#
# The largest batch: each contender's own search in one process
# (`ddptrain bench --largest-batch`, `gpt_torch.py step --largest-batch`):
# from START, doubling until a step runs out of memory, then bisecting, the
# model built once (a 1.5B model takes a minute to build). The runs at equal
# batch are fresh processes. A failure that is not out of memory stops the
# script (it is a bug, not a limit).
#
#   bench/recompute.sh OUT.jsonl [MODEL ...]     (default: all four sizes)
#   STEPS=5 START=1 CONTENDERS="ddptrain ddptrain-rc torch torch-rc" bench/recompute.sh ...
# DDP_FLAGS: more ddptrain flags for both ddptrain contenders (e.g. --cuda-graph).
# START: the first batch tried (doubling from there, bisecting below it if it
# does not fit), to spend fewer tries where the range is known.
#
# One JSON line per timed run goes to OUT.jsonl (the bench's own line plus
# "fits"), and a table to stdout at the end. Run from the repository root
# after ./setup.sh on the GPU machine (build/ddptrain), with a PyTorch 2.x
# that has torch.compile on PATH as python3.
set -euo pipefail

OUT=${1:?usage: bench/recompute.sh OUT.jsonl [MODEL ...]}
shift
MODELS=("$@")
[ ${#MODELS[@]} -gt 0 ] || MODELS=(gpt2 gpt2-medium gpt2-large gpt2-xl resnet50)
STEPS=${STEPS:-5}
START=${START:-1}
CONTENDERS=${CONTENDERS:-"ddptrain ddptrain-rc torch torch-rc"}
DDPTRAIN=${DDPTRAIN:-build/ddptrain}
LOG=$(mktemp -d)
: >"$OUT"

# CONTENDER's command for MODEL at BATCH, in the array cmd.
command_of() {
  local who=$1 model=$2 batch=$3
  case $who in
    ddptrain | ddptrain-rc)
      cmd=("$DDPTRAIN" bench --task lm --model "$model" --batch "$batch" --amp bf16 --optimizer adamw --lr 6e-4
           --weight-decay 0.1 --clip-grad-norm 1 --bench-steps "$STEPS" --size 1)
      [ "$who" = ddptrain-rc ] && cmd+=(--recompute blocks)
      cmd+=(${DDP_FLAGS:-}) ;;
    resnet | resnet-rc)
      cmd=("$DDPTRAIN" bench --model "$model" --image-size 224 --batch "$batch" --amp bf16 --optimizer sgd
           --bench-steps "$STEPS" --size 1)
      [ "$who" = resnet-rc ] && cmd+=(--recompute stages) ;;
    torch | torch-rc)
      cmd=(torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model "$model" --batch "$batch"
           --steps "$STEPS" --warmup 3 --compile)
      [ "$who" = torch-rc ] && cmd+=(--checkpoint) ;;
    *) echo "recompute.sh: unknown contender $who" >&2; exit 2 ;;
  esac
}

# Appends LOG's JSON lines to $OUT, each with "who", "run" (fresh: a
# process of its own; search: a try of the search, 2 timed steps) and
# "fits" (true where the line does not say).
keep_lines() {
  grep '^{' "$1" | python3 -c '
import json, sys
for l in sys.stdin:
    j = json.loads(l); j["who"] = sys.argv[1]; j["run"] = sys.argv[2]; j.setdefault("fits", True); print(json.dumps(j))' "$2" "$3" >>"$OUT"
}

# One run of CONTENDER on MODEL at BATCH in a fresh process: 0 and its line
# appended to $OUT when it fits, 1 when it ran out of memory; exits on other
# failures.
try() {
  local who=$1 model=$2 batch=$3 log="$LOG/$1_$2_$3.log"
  command_of "$who" "$model" "$batch"
  if "${cmd[@]}" >"$log" 2>&1; then keep_lines "$log" "$who" fresh; return 0; fi
  if grep -qi "out of memory" "$log"; then return 1; fi
  echo "recompute.sh: $who $model batch $batch failed, not for memory:" >&2
  tail -20 "$log" >&2
  exit 1
}

# The largest batch (0 if even 1 does not fit): the contender's own search
# in one process (--largest-batch: from START, doubling, then bisecting),
# which builds the model once; every try's line goes to $OUT.
largest() {
  local who=$1 model=$2 log="$LOG/$1_$2_search.log"
  command_of "$who" "$model" "$START"
  if ! "${cmd[@]}" --largest-batch >"$log" 2>&1; then
    grep -q "not even a batch of 1 fits\|even a batch of 1 does not fit" "$log" && { echo 0; return; }
    echo "recompute.sh: $who $model: the search failed:" >&2
    tail -20 "$log" >&2
    exit 1
  fi
  keep_lines "$log" "$who" search
  grep '^{' "$log" | python3 -c '
import json, sys
print(max([json.loads(l) for l in sys.stdin if "\"largest\": true" in l] or [{"batch": 0}], key=lambda j: j["batch"])["batch"])'
}

for model in "${MODELS[@]}"; do
  declare -A best=()
  whos=$CONTENDERS
  [ "$model" = resnet50 ] && whos="resnet resnet-rc"
  for who in $whos; do
    best[$who]=$(largest "$who" "$model")
    echo "$model $who: largest batch ${best[$who]}" >&2
  done
  # Equal batch: ddptrain at PyTorch's largest (without and with checkpointing).
  for pair in "ddptrain:torch" "ddptrain-rc:torch-rc"; do
    d=${pair%%:*} t=${pair##*:}
    if [ -n "${best[$t]:-}" ] && [ "${best[$t]}" -gt 0 ] && [ -n "${best[$d]:-}" ] && [ "${best[$d]}" -ge "${best[$t]}" ]; then
      try "$d" "$model" "${best[$t]}" || true
    fi
  done
  unset best
done

python3 - "$OUT" <<'EOF'
import json, sys
rows = [r for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip()) if r["fits"]]
print(f"{'model':12} {'contender':12} {'largest batch':>13} {'tokens/s there':>15} {'peak MiB':>9}   tokens/s at PyTorch's largest batch")
for model in dict.fromkeys(r["model"] for r in rows):
    for who in dict.fromkeys(r["who"] for r in rows if r["model"] == model):
        runs = [r for r in rows if r["model"] == model and r["who"] == who]
        top = max(runs, key=lambda r: (r["batch"], r.get("largest", False)))  # the search's timed line
        torch_who = "torch-rc" if who.endswith("-rc") else "torch"
        tb = max((r["batch"] for r in rows if r["model"] == model and r["who"] == torch_who), default=0)
        eq = [r["tokens_per_s"] for r in runs if r["batch"] == tb and (r["run"] == "fresh" or r.get("largest"))]
        rate = top.get("tokens_per_s", top.get("images_per_s", 0))  # images/s for the ResNet
        print(f"{model:12} {who:12} {top['batch']:>13} {rate:>15.0f} {top['peak_mem_mib']:>9.0f}   "
              + (f"{max(eq):.0f} at batch {tb}" if eq else "-"))
EOF
