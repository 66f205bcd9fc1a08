#!/usr/bin/env bash
# One device call: test vectors from PyTorch, the CUDA build, the tests that
# apply on one GPU, and the ResNet-18 Fashion-MNIST run. Writes logs to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
log machine; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch,torchvision;print("torch",torch.__version__,"cuda",torch.version.cuda,"torchvision",torchvision.__version__)'
log testdata
mkdir -p "$OUT/data" && python3 tools/gen_testdata.py "$OUT/data" && cp "$OUT"/data/*.json tests/data/
log build
JOBS=16 ./setup.sh > "$OUT/build.log" 2>&1; rc=$?; tail -5 "$OUT/build.log"; grep -E "warning:" "$OUT/build.log" | grep -v "/torch/\|/c10/\|/ATen/" | head -20
[[ $rc -ne 0 ]] && { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
log ctest
export DDP_FASHION_MNIST=$PWD/.data/fashion-mnist
(cd build && ctest --output-on-failure -j 8 -E "${CTEST_EXCLUDE:-NONE}" > "$OUT/ctest.log" 2>&1); tail -25 "$OUT/ctest.log"
[[ -n "${SKIP_RESNET:-}" ]] && exit 0
log resnet18
FM=$PWD/.data/fashion-mnist
/usr/bin/time -f "wall %e s" ./build/ddptrain --model resnet18 --epochs 10 --data_root "$FM" --save_path /tmp/ck --progress plain --log-every 400 ${RESNET_FLAGS:-} > "$OUT/resnet18.log" 2>&1
grep -E "epoch [0-9]+/10  |wall|error|rank 0 of" "$OUT/resnet18.log"
cp /tmp/ck/*/metrics.jsonl "$OUT/resnet18_metrics.jsonl" 2>/dev/null
