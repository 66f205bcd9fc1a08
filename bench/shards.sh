#!/usr/bin/env bash
# Config (f)'s data two ways in one call: the same JPEGs (bench/make_jpeg_folder.py)
# read as an image folder and as tar shards that `ddptrain shards` wrote from
# it (issue 47), each with --image-decode auto (nvJPEG on a GPU) and cpu,
# all validated on the same small folder. Prints one JSON line per path (the last epoch's
# img/s and data wait, from the epoch line) to $OUT/results.jsonl.
#
#   bash bench/shards.sh                          # GPU: ResNet-50, 224 px, batch 256, bf16, cuda-graph, 3 epochs
#   CPU=1 F_FILES=2000 bash bench/shards.sh       # a CPU machine: --model cnn at 64 px, loader-bound
#
# F_DIR (default /tmp/ddp_f_jpegs, F_FILES files) is made once and reused, as
# bench/run.sh makes it; WORKERS (default nproc - 1) loader threads per rank;
# EPOCHS (default 3 on a GPU, 2 on CPU); SHARD_FLAGS, more flags for the shard
# runs only (e.g. "--shard-streams 4": more sequential readers).
# Record the two lines in bench/RESULTS.md with the date, the machine and
# the command.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/bench_shards}; mkdir -p "$OUT"
B=${B:-./build/ddptrain}
PY=${PY:-python3}
F_DIR=${F_DIR:-/tmp/ddp_f_jpegs}; F_FILES=${F_FILES:-20000}
WORKERS=${WORKERS:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}
R="$OUT/results.jsonl"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }

[[ -f $F_DIR.done ]] || { log "making $F_FILES JPEGs in $F_DIR"; rm -rf "$F_DIR"
  $PY bench/make_jpeg_folder.py "$F_DIR" --files "$F_FILES" --classes 100 && touch "$F_DIR.done"; }
VAL=$F_DIR.val
[[ -f $VAL.done ]] || { rm -rf "$VAL"; $PY bench/make_jpeg_folder.py "$VAL" --files 200 --classes 100 --seed 1 && touch "$VAL.done"; }
SH=$OUT/shards; rm -rf "$SH"; mkdir -p "$SH"
log "writing shards"
t0=$(date +%s.%N)
$B shards "$F_DIR" "$SH/train" | tee "$OUT/shards.txt"
$B shards "$VAL" "$SH/val" >/dev/null
t1=$(date +%s.%N)
PATTERN=$(sed -n 's/^wrote [0-9]* shard(s): \(.*\) (classes.*/\1/p' "$OUT/shards.txt")
echo "{\"step\": \"ddptrain shards\", \"files\": $F_FILES, \"seconds\": $($PY -c "print(round($t1 - $t0, 1))"), \"bytes\": $(du -sb "$SH" | cut -f1)}" | tee -a "$R"

if [[ ${CPU:-0} == 1 ]]; then
  MODEL=(--model cnn --image-size 64 --batch 64 --epochs ${EPOCHS:-2} --backend gloo --size 1)
else
  MODEL=(--model resnet50 --image-size 224 --batch 256 --amp bf16 --channels-last on --cuda-graph --epochs ${EPOCHS:-3})
fi
run() {  # NAME, then the data flags
  local name=$1; shift
  log "$name"
  local t0 t1; t0=$(date +%s.%N)
  $B "$@" "${MODEL[@]}" --optimizer adam --lr 1e-4 --workers "$WORKERS" --progress none \
    --save_path "$OUT/$name" > "$OUT/$name.log" 2>&1
  local rc=$?; t1=$(date +%s.%N)
  $PY - "$OUT/$name.log" "$name" "$rc" "$t0" "$t1" "$WORKERS" <<'PY' | tee -a "$R"
import json, re, sys
log, name, rc, t0, t1, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
ep = re.findall(r"^epoch (\d+)/\d+ .*?([\d.]+) s\s+(\d+) samples/s\s+data wait (\d+)%", open(log).read(), re.M)
last = ep[-1] if ep else ("0", "0", "0", "0")
print(json.dumps({"config": "f", "data": name, "rc": rc, "workers": workers, "epochs": len(ep),
                  "images_per_s": float(last[2]), "data_wait": float(last[3]) / 100,
                  "per_epoch_images_per_s": [float(e[2]) for e in ep], "wall_s": t1 - t0}))
PY
  rm -f "$OUT/$name"/*/*.pt
}
# DECODES: --image-decode values to run both paths with (a CPU machine: cpu only).
for dec in ${DECODES:-$([[ ${CPU:-0} == 1 ]] && echo cpu || echo "auto cpu")}; do
  run "imagefolder.$dec" --dataset imagefolder --data_root "$F_DIR" --val-root "$VAL" --image-decode "$dec"
  run "shards.$dec" --dataset shards --data_root "$PATTERN" --val-root "$SH/val-000000.tar" --image-decode "$dec" ${SHARD_FLAGS:-}
done
