#!/usr/bin/env bash
# Config (h): the user's path. bench/user_models/train.cpp is a program
# built as template/ is, against the installed package: a ResNet-50 (224 px,
# batch 256, bf16, channels-last, Adam) and a GPT-2 124M (context 1024,
# batch 16, bf16, AdamW, exact GELU), each written with torch::nn layers and
# with ddp::nn layers; the torch::nn ones with --convert-layers on (ddptrain's
# automatic conversion) and off. Beside them in the same run: torch.compile
# of the same architectures (bench/torch_ddp.py, bench/gpt_torch.py) and
# ddptrain's built-in models (configs (c) and (e)).
#   bash bench/user_models.sh          # OUT=dir for the logs (default /tmp/bench_h)
#   PHASES="build resnet" bash bench/user_models.sh
# Writes $OUT/results.jsonl, one JSON line per measurement.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/bench_h}; mkdir -p "$OUT"
PHASES=${PHASES:-"build resnet gpt"}
STEPS=${STEPS:-30}
COMPILE_MODES=${COMPILE_MODES:-default}
PREFIX=${PREFIX:-$OUT/prefix}
R="$OUT/results.jsonl"
has() { [[ " $PHASES " == *" $1 "* ]]; }
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
tag() { grep '^{' | sed "s/^{/{\"config\": \"$1\", /" | tee -a "$R"; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/machine.txt"
python3 -c 'import torch;print("torch",torch.__version__,"cuda",torch.version.cuda)' | tee -a "$OUT/machine.txt"

U=$OUT/um/user_models
if has build; then
  log build
  JOBS=$(nproc) ./setup.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --install build --prefix "$PREFIX" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  torch_dir=$(grep '^Torch_DIR' build/CMakeCache.txt | cut -d= -f2)
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S bench/user_models -B "$OUT/um" "${gen[@]}" -Dddptrain_DIR="$PREFIX/lib/cmake/ddptrain" -DTorch_DIR="$torch_dir" \
    > "$OUT/um.log" 2>&1 && cmake --build "$OUT/um" -j "$(nproc)" >> "$OUT/um.log" 2>&1 || { tail -30 "$OUT/um.log"; exit 1; }
fi

if has resnet; then
  common=(--batch 256 --amp bf16 --optimizer adam --lr 1e-4 --bench-steps "$STEPS" --cuda-graph)
  for v in "ddp on" "torch on" "torch off"; do
    set -- $v
    log "config h, resnet50: --layers $1 --convert-layers $2"
    "$U" bench --arch resnet50 --layers "$1" --convert-layers "$2" "${common[@]}" 2>"$OUT/h.resnet50.$1.$2.err" | tag h-resnet50
  done
  log "config h, resnet50: ddptrain's own (config c)"
  ./build/ddptrain bench --model resnet50 --image-size 224 "${common[@]}" 2>"$OUT/h.resnet50.own.err" | tag h-resnet50
  for mode in $COMPILE_MODES; do
    log "config h, resnet50: torch.compile $mode"
    timeout ${COMPILE_TIMEOUT:-240} torchrun --standalone --nproc-per-node 1 bench/torch_ddp.py step --model resnet50 \
      --image-size 224 --batch 256 --optimizer adam --lr 1e-4 --amp bf16 --steps "$STEPS" --channels-last --compile "$mode" \
      2>"$OUT/h.resnet50.py.$mode.err" | tag h-resnet50
  done
fi

if has gpt; then
  common=(--batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --bench-steps "$STEPS" --cuda-graph)
  for v in "ddp on" "torch on" "torch off"; do
    set -- $v
    log "config h, gpt2: --layers $1 --convert-layers $2"
    "$U" bench --arch gpt2 --layers "$1" --convert-layers "$2" "${common[@]}" 2>"$OUT/h.gpt2.$1.$2.err" | tag h-gpt2
  done
  log "config h, gpt2: ddptrain's own (config e, exact GELU)"
  ./build/ddptrain bench --task lm --model gpt2 --gelu exact "${common[@]}" 2>"$OUT/h.gpt2.own.err" | tag h-gpt2
  for mode in $COMPILE_MODES; do
    log "config h, gpt2: torch.compile $mode"
    timeout ${COMPILE_TIMEOUT:-240} torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model gpt2 --batch 16 \
      --steps "$STEPS" --amp bf16 --gelu exact --compile "$mode" 2>"$OUT/h.gpt2.py.$mode.err" | tag h-gpt2
  done
fi
