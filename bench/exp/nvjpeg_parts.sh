#!/usr/bin/env bash
# EXPERIMENT for issue 17 (not yet run: written when session 10's device
# time ran out). nvJPEG's hardware path waits on the host once per image
# (cudaEventSynchronize, 235 a step in session 10's trace), so in training
# each image's conversion kernel waits behind the step's kernels and the
# decoder runs at a quarter of its rate alone. nvjpeg_parts.patch decodes a
# batch in DDP_NVJPEG_PARTS parts from as many threads at once (one nvJPEG
# state each), and DDP_NVJPEG_NO_PIPELINE creates the hardware handle with
# NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE. The environment variables are for the
# experiment only; the winner becomes the stage's default.
#
#   git apply bench/exp/nvjpeg_parts.patch && OUT=/tmp/exp bash bench/exp/nvjpeg_parts.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/exp}; mkdir -p "$OUT"
date -u
t0=$SECONDS; JOBS=$(nproc) ./setup.sh --tests > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }
cmake --build build --target loader_bench -j $(nproc) >> $OUT/build.log 2>&1
echo "build $((SECONDS-t0)) s"
T=$(find build -name ddp_tests -type f | head -1)
DDP_NVJPEG_PARTS=4 $T --gtest_filter='GpuImages.*_CUDA' 2>&1 | grep -E "^\[  |Failure" | tail -12
F_DIR=/tmp/ddp_f_jpegs
[[ -f $F_DIR.done ]] || { python3 bench/make_jpeg_folder.py $F_DIR --files 20000 --classes 100 > /dev/null && touch $F_DIR.done; }
for v in "P=1" "P=2" "P=4" "P=8" "P=1 NP=1" "P=4 NP=1"; do
  P=${v#P=}; P=${P%% *}; NP=""; [[ $v == *NP=1* ]] && NP=1
  alone=$(env DDP_NVJPEG_PARTS=$P ${NP:+DDP_NVJPEG_NO_PIPELINE=1} timeout 60 ./build/loader_bench --gpu-folder $F_DIR \
    --batch 256 --max-workers 16 --jpeg-size 224 2>&1 | grep -iE "img/s|images/s" | tail -2 | tr '\n' ' ')
  env DDP_NVJPEG_PARTS=$P ${NP:+DDP_NVJPEG_NO_PIPELINE=1} timeout 90 ./build/ddptrain --dataset imagefolder \
    --data_root $F_DIR --val-split 0.02 --model resnet50 --image-size 224 --batch 256 --amp bf16 --channels-last on \
    --cuda-graph --optimizer adam --lr 1e-4 --epochs 3 --workers 16 --image-decode gpu --progress none \
    --save_path /tmp/f.exp > $OUT/f_$P$NP.log 2>&1
  echo "[$v] rc=$? $(grep -E '^epoch' $OUT/f_$P$NP.log | tr '\n' ';')  alone: $alone"
done
date -u
