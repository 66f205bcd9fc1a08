#!/usr/bin/env bash
# The GPT quality check of config (e): ddptrain and the nanoGPT-style PyTorch
# script train GPT-2 124M on the same windows of the same token files for the
# same number of tokens, then report the loss on the same validation windows.
#   bash bench/gpt_quality.sh        # OUT=dir for the logs (default /tmp/gpt_quality)
# Token files: Debian's fortunes as bytes (train: the first 90% of each file,
# val: the rest), written to $DATA (default .data/fortunes_bin) if missing;
# on a machine without the package, copy that folder there first.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/gpt_quality}; mkdir -p "$OUT"
DATA=${DATA:-.data/fortunes_bin}
STEPS=${STEPS:-300}; BATCH=${BATCH:-16}
if [[ ! -f $DATA/train.bin ]]; then
  mkdir -p "$DATA"
  python3 - "$DATA" <<'PY'
import array, os, sys
root = "/usr/share/games/fortunes"
train, val = array.array("H"), array.array("H")
for f in sorted(os.listdir(root)):
    p = os.path.join(root, f)
    if os.path.isfile(p) and not f.endswith((".dat", ".u8")):
        b = open(p, "rb").read()
        cut = int(len(b) * 0.9)
        train.extend(b[:cut]); val.extend(b[cut:])
open(os.path.join(sys.argv[1], "train.bin"), "wb").write(train.tobytes())
open(os.path.join(sys.argv[1], "val.bin"), "wb").write(val.tobytes())
print(f"{len(train)} training and {len(val)} validation tokens in {sys.argv[1]}")
PY
fi
SAMPLES=$((STEPS * BATCH))
./build/ddptrain --task lm --model gpt2 --data_root "$DATA" --size 1 --batch "$BATCH" --epochs 1 --train-samples "$SAMPLES" \
  --test-samples 200 --lr 6e-4 --weight-decay 0.1 --amp bf16 --schedule cosine --warmup-epochs 0 --seed 0 \
  --save_path "$OUT/ddptrain" --progress none > "$OUT/ddptrain.log" 2>&1
echo "ddptrain (rc $?): $(grep -E '^epoch 1/1' "$OUT/ddptrain.log")"
torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py train --model gpt2 --data-root "$DATA" --batch "$BATCH" \
  --steps "$STEPS" --train-samples "$SAMPLES" --eval-windows 200 --seed 0 2>"$OUT/torch.err" | tail -1
