#!/usr/bin/env bash
# One GPU call's worth of checks, as session 34 ran them (bench/RESULTS.md):
# the CUDA build (with Debian's libarchive carried in .data/libarchive where
# the machine has none), the GPU tests, then PHASES in turn:
#   f   config (f) from tar shards against the image folder (bench/shards.sh;
#       SHARD_FLAGS2: a second pair of runs with these shard flags)
#   e   (e) GPT-2 124M, exact GELU: torch.compile (default) and ddptrain
#       --cuda-graph twice, then ddptrain's kernel profile
#   c   (c) ResNet-50: torch.compile (C_MODE, default reduce-overhead) and
#       ddptrain twice, then ddptrain's profile
#   ab  (a) and (b) ResNet-18: torch.compile reduce-overhead and ddptrain twice
#   xl  issue 46's table: the largest batch that fits and its tokens/s
#       (bench/recompute.sh for XL_MODELS, default gpt2-xl, from XL_START,
#       for XL_CONTENDERS)
# Every phase checks the time left (BUDGET seconds from the start) first.
#   OUT=dir FILTER='*_CUDA:-*_MultiCUDA' PHASES="f e c ab" bash bench/lead_gpu.sh
#   SKIP_BUILD=1 PHASES="c" bash bench/lead_gpu.sh     # a warm machine: the build kept
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/lead_gpu}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
T0=$(date +%s); left() { echo $(( ${BUDGET:-575} - ($(date +%s) - T0) )); }
log() { echo "== $* ($(date -u +%H:%M:%S), $(left) s left)"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
LA=$(ls /usr/lib/x86_64-linux-gnu/libarchive.so.13 2>/dev/null || echo $PWD/.data/libarchive/lib/libarchive.so.13)
[[ $LA == $PWD/* ]] && export LD_LIBRARY_PATH=$PWD/.data/libarchive/lib:${LD_LIBRARY_PATH:-}
export DDP_CMAKE_ARGS="-DLibArchive_INCLUDE_DIR=$PWD/.data/libarchive/include -DLibArchive_LIBRARY=$LA"
git log --oneline -1
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  log build
  JOBS=16 ./setup.sh ${BUILD_TESTS:---tests} > $OUT/setup.log 2>&1; rc=$?; tail -2 $OUT/setup.log
  [[ $rc -ne 0 ]] && { grep -E "error" $OUT/setup.log build/setup.log | head -30; exit 1; }
fi
export DDP_FASHION_MNIST=$PWD/.data/fashion-mnist
if [[ -n ${FILTER:-} ]]; then
  log tests
  timeout ${TEST_S:-170} ./build/tests/ddp_tests --gtest_filter="$FILTER" > $OUT/gtest.log 2>&1; echo "gtest rc $?"
  grep -E "^\[  (FAILED|PASSED)|tests ran|Failure|SKIPPED \]" $OUT/gtest.log | head -40
fi
B=./build/ddptrain
for ph in ${PHASES:-f e c}; do
  case $ph in
  f) [[ $(left) -lt 200 ]] && { log "no time for (f)"; continue; }
     log "config f from shards"
     OUT=/tmp/sh1 DECODES=auto EPOCHS=${EPOCHS:-4} timeout $(( $(left) - 20 )) bash bench/shards.sh > $OUT/shards_bench.log 2>&1; echo "shards rc $?"
     if [[ -n ${SHARD_FLAGS2:-} && $(left) -gt 80 ]]; then
       log "shards again with $SHARD_FLAGS2"
       OUT=/tmp/sh2 F_DIR=/tmp/ddp_f_jpegs DECODES=auto EPOCHS=${EPOCHS:-4} SHARD_FLAGS="$SHARD_FLAGS2" timeout $(( $(left) - 10 )) bash bench/shards.sh > $OUT/shards_bench2.log 2>&1; echo "shards2 rc $?"
     fi
     for d in sh1 sh2; do mkdir -p $OUT/$d; cp /tmp/$d/*.log /tmp/$d/*.jsonl $OUT/$d/ 2>/dev/null; cat /tmp/$d/results.jsonl; done ;;
  e) [[ $(left) -lt 150 ]] && { log "no time for (e)"; continue; }
     log "(e) torch.compile default, exact GELU"
     timeout 200 torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model gpt2 --batch 16 --steps 30 --amp bf16 --gelu exact --compile default 2>$OUT/e.py.err | grep '^{' | tee -a $OUT/item5.jsonl
     for r in 1 2; do log "(e) ddptrain cuda-graph run $r"
       $B bench --task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --bench-steps 30 --gelu exact --cuda-graph 2>$OUT/e.dd.err | grep '^{' | tee -a $OUT/item5.jsonl; done
     log "(e) profile"; OUT=$OUT/prof timeout 80 bash bench/profile_ddptrain.sh e --cuda-graph --gelu exact > $OUT/prof_e.txt 2>&1; head -40 $OUT/prof_e.txt ;;
  c) [[ $(left) -lt 150 ]] && { log "no time for (c)"; continue; }
     log "(c) torch.compile ${C_MODE:-reduce-overhead}"
     timeout 200 torchrun --standalone --nproc-per-node 1 bench/torch_ddp.py step --model resnet50 --image-size 224 --batch 256 --optimizer adam --lr 1e-4 --amp bf16 --steps 30 --channels-last --compile ${C_MODE:-reduce-overhead} 2>$OUT/c.py.err | grep '^{' | tee -a $OUT/item5.jsonl
     for r in 1 2; do log "(c) ddptrain cuda-graph run $r"
       $B bench --model resnet50 --image-size 224 --batch 256 --optimizer adam --lr 1e-4 --amp bf16 --bench-steps 30 --channels-last on --cuda-graph 2>$OUT/c.dd.err | grep '^{' | tee -a $OUT/item5.jsonl; done
     [[ $(left) -gt 60 ]] && { log "(c) profile"; OUT=$OUT/prof timeout 60 bash bench/profile_ddptrain.sh c --cuda-graph > $OUT/prof_c.txt 2>&1; head -40 $OUT/prof_c.txt; } ;;
  ab) for cfg in a b; do
       [[ $(left) -lt 100 ]] && { log "no time for ($cfg)"; continue; }
       if [[ $cfg == a ]]; then A=(--model resnet18 --image-size 64 --batch 32 --optimizer adam --lr 1e-4 --amp off); CLP=(); CLD=(--channels-last off)
       else A=(--model resnet18 --image-size 64 --batch 256 --optimizer adam --lr 1e-4 --amp bf16); CLP=(--channels-last); CLD=(--channels-last on); fi
       log "($cfg) torch.compile reduce-overhead"
       timeout 150 torchrun --standalone --nproc-per-node 1 bench/torch_ddp.py step "${A[@]}" --steps 60 "${CLP[@]}" --compile reduce-overhead 2>$OUT/$cfg.py.err | grep '^{' | tee -a $OUT/item5.jsonl
       for r in 1 2; do log "($cfg) ddptrain run $r"; $B bench "${A[@]}" --bench-steps 60 "${CLD[@]}" --cuda-graph 2>$OUT/$cfg.dd.err | grep '^{' | tee -a $OUT/item5.jsonl; done
     done ;;
  xl) [[ $(left) -lt 200 ]] && { log "no time for gpt2-xl"; continue; }
     log "${XL_MODELS:-gpt2-xl}: ${XL_CONTENDERS:-ddptrain ddptrain-rc torch torch-rc} from batch ${XL_START:-16}"
     STEPS=5 START=${XL_START:-16} CONTENDERS="${XL_CONTENDERS:-ddptrain ddptrain-rc torch torch-rc}" timeout $(( $(left) - 10 )) \
       bash bench/recompute.sh $OUT/xl.jsonl ${XL_MODELS:-gpt2-xl} > $OUT/xl.log 2>&1; echo "xl rc $?"
     tail -12 $OUT/xl.log; cut -c1-300 $OUT/xl.jsonl ;;
  esac
done
log done
