#!/usr/bin/env bash
# One device call: the CUDA build, the tests that apply on one GPU, the
# PyTorch interop check, resume on the GPU, and a ResNet-18 Fashion-MNIST run.
#   PHASES="build ctest interop resume" bash scripts/gpu_check.sh   (logs in $OUT)
# Phases: testdata build ctest tests interop resume bn resnet (default: build ctest interop resume resnet);
# tests runs the gtest binary directly (GTEST_FILTER, default *_CUDA), bn runs bench/bn_kernels.py.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PHASES=${PHASES:-"build ctest interop resume resnet"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
FM=$PWD/.data/fashion-mnist
export DDP_FASHION_MNIST=$FM
log machine; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch,torchvision;print("torch",torch.__version__,"cuda",torch.version.cuda,"torchvision",torchvision.__version__)'
if has testdata; then
  log testdata
  mkdir -p "$OUT/data" && python3 tools/gen_testdata.py "$OUT/data" && cp "$OUT"/data/*.json tests/testdata/
fi
if has build; then
  log build
  JOBS=$(nproc) ./setup.sh --tests > "$OUT/build.log" 2>&1; rc=$?; tail -3 "$OUT/build.log"
  grep -E "warning:" "$OUT/build.log" | grep -v "/torch/\|/c10/\|/ATen/" | head -20
  [[ $rc -ne 0 ]] && { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
fi
if has ctest; then
  log ctest
  (cd build && ctest --output-on-failure -j 8 -E "${CTEST_EXCLUDE:-NONE}" -R "${CTEST_REGEX:-.}" > "$OUT/ctest.log" 2>&1)
  grep -E "tests passed|Failed|\*\*\*|Not Run" "$OUT/ctest.log" | head -30
  grep -E "_CUDA.*(Passed|Failed)" "$OUT/ctest.log" | head -40
fi
if has interop; then
  log interop
  python3 tools/interop_check.py build "$OUT/interop" 2>&1 | tee "$OUT/interop.log"
fi
if has resume; then
  # Straight 4 epochs twice (run-to-run noise), and 4 epochs with a failure
  # injected in epoch 3 that --max-restarts resumes from epoch 2's checkpoint.
  log resume
  common=(--model resnet18 --stem small --data_root "$FM" --epochs 4 --train-samples 30000 --batch 256 --lr 4e-3 --amp bf16 --cuda-graph
          --workers 4 --save_epoch 1 --progress plain --log-every 100000)
  for run in straight1 straight2; do
    ./build/ddptrain "${common[@]}" --save_path "$OUT/resume_$run" > "$OUT/resume_$run.log" 2>&1
    echo "$run: $(grep -E '^epoch 4/4' "$OUT/resume_$run.log")"
  done
  ./build/ddptrain "${common[@]}" --visible 0 --max-restarts 1 --inject-fault 0:300 \
    --save_path "$OUT/resume_restarted" > "$OUT/resume_restarted.log" 2>&1
  echo "restarted (rc $?): $(grep -E '^epoch 4/4' "$OUT/resume_restarted.log")"
  grep -E "restart|resume:|injected" "$OUT/resume_restarted.log" | head -5
  for f in "$OUT"/resume_*/train_*/metrics.jsonl; do echo "$f"; cat "$f"; done
fi
if has tests; then
  log tests
  ./build/tests/ddp_tests --gtest_filter="${GTEST_FILTER:-*_CUDA}" > "$OUT/gtest.log" 2>&1
  grep -E "graph=|^\[  (FAILED|  OK|PASSED)|Failure|Expected|actual|vs" "$OUT/gtest.log" | head -80
fi
if has bn; then
  log bn
  timeout 200 python3 bench/bn_kernels.py 2>&1 | tee "$OUT/bn_kernels.log"
fi
if has resnet; then
  log resnet18
  /usr/bin/time -f "wall %e s" ./build/ddptrain --model resnet18 --epochs 10 --data_root "$FM" --save_path /tmp/ck --progress plain --log-every 400 ${RESNET_FLAGS:-} > "$OUT/resnet18.log" 2>&1
  grep -E "epoch [0-9]+/10  |wall|error|rank 0 of|peak" "$OUT/resnet18.log"
  cp /tmp/ck/*/metrics.jsonl "$OUT/resnet18_metrics.jsonl" 2>/dev/null
fi
