#!/usr/bin/env bash
# Everything one GPU session should check and measure, most important first
# (a device session is short): build, the CUDA tests, Fashion-MNIST time to
# 93% side by side with PyTorch, the interop check, the TensorBoard read-back,
# GPU resume, the kernel profile of config (c), the loader benchmark.
#   OUT=/tmp/out bash scripts/gpu_all.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-/tmp/out} NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
CTEST_REGEX=${CTEST_REGEX:-"_CUDA|TorchPickle|PyTorchFile"} PHASES="build ctest" bash scripts/gpu_check.sh 2>&1 | tail -30
[[ -x build/ddptrain ]] || exit 1
PHASES="fmnist" OUT=$OUT/bench timeout 300 bash bench/run.sh 2>&1 | grep -v " step [0-9]*/" | tail -40
run_dir=$(ls -d "$OUT"/bench/ck_true/train_* 2>/dev/null | head -1)
echo "== interop ($(date -u +%H:%M:%S))"
timeout 90 python3 tools/interop_check.py build "$OUT/interop" ${run_dir:+"$run_dir/best.pt"} 2>&1 | tail -8
echo "== tensorboard read-back of $run_dir"
[[ -n "$run_dir" ]] && timeout 60 python3 tools/check_tensorboard.py "$run_dir" 2>&1 | tail -12
PHASES="resume" timeout 150 bash scripts/gpu_check.sh 2>&1 | tail -14
PHASES="profile" OUT=$OUT/bench timeout 90 bash bench/run.sh 2>&1 | grep -A3 "profile" | tail -4
echo "== loader ($(date -u +%H:%M:%S))"
timeout 60 bash bench/loader.sh --jpegs 500 2>&1 | tail -10
