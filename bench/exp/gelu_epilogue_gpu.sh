#!/usr/bin/env bash
# Issue 15, branch gelu-epilogue: what the device calls had to check before the
# branch was merged (it was, on 2026-12-05, after `quick`: bench/RESULTS.md,
# session 20), in two calls of under 10 minutes each (the second on
# the still-warm machine, whose build the first left):
#   call 1: build with the tests (setup.sh, ~160 s); the CUDA tests of the
#           code that has not yet run on a GPU (the tanh GELU's backward
#           kernel, the vectorised LayerNorm, the fused MLP) and the GPT/LM
#           tests; (e) with the tanh GELU on both sides (PyTorch eager and
#           torch.compile's default and reduce-overhead modes: its best);
#   call 2: (e) with the exact GELU, the same way; the one-pass cross-entropy
#           against two passes (--ce-kernel); kernel profiles of torch.compile's
#           step and ddptrain's, tanh GELU, to compare class by class.
#   bash bench/exp/gelu_epilogue_gpu.sh 1; then ... 2   (logs under $OUT/ge)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}/ge; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }

CALL=${1:?"gelu_epilogue_gpu.sh: which call, 1 or 2?"}
e_rows() {  # the (e) rows for one GELU, both sides
  OUT="$OUT/e_$1" PHASES=gpt GPT_GELU=$1 GPT_COMPILE_MODES="default reduce-overhead" GPT_STEPS=30 GPT_NATIVE=0 \
    timeout 300 bash bench/run.sh > "$OUT/e_$1.log" 2>&1
  cat "$OUT/e_$1/table.md" 2>/dev/null || tail -20 "$OUT/e_$1.log"
}

if [[ $CALL == quick ]]; then  # one call when the device budget allows no more: the decisive rows first
  log build
  JOBS=$(nproc) ./setup.sh --tests > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  log "CUDA tests of the branch's kernels"
  timeout 110 ctest --test-dir build -j 4 --timeout 100 --output-on-failure \
    -R 'GemmGelu|FusedLinear|FusedLayerNorm|CrossEntropy.*_CUDA' > "$OUT/tests.log" 2>&1
  grep -E 'tests passed|FAILED|Failed|\*\*\*' "$OUT/tests.log" | head -30
  gpt=(bench --task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --bench-steps 30 --gelu tanh --cuda-graph)
  for ce in auto two-pass; do
    log "(e) ddptrain --cuda-graph --gelu tanh --ce-kernel $ce"
    timeout 60 ./build/ddptrain "${gpt[@]}" --ce-kernel "$ce" 2>>"$OUT/e_ddp.err" | grep '^{' | tee -a "$OUT/e_quick.jsonl"
  done
  for mode in default reduce-overhead; do
    (( SECONDS < 420 )) || break
    log "(e) torch.compile $mode, tanh GELU"
    timeout 170 torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model gpt2 --batch 16 --steps 30 \
      --amp bf16 --gelu tanh --compile "$mode" 2>>"$OUT/e_torch.err" | grep '^{' | tee -a "$OUT/e_quick.jsonl"
  done
  log done
  exit 0
fi

if [[ $CALL == 1 ]]; then
  log build
  JOBS=$(nproc) ./setup.sh --tests > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }

  log "CUDA tests of the branch's kernels, GPT and LM tests"
  timeout 170 ctest --test-dir build -j 4 --timeout 150 --output-on-failure \
    -R 'GemmGelu|FusedLinear|FusedLayerNorm|LayerNorm.*_CUDA|CrossEntropy.*_CUDA|Gpt\.|LmTask\.' > "$OUT/tests.log" 2>&1
  grep -E 'tests passed|FAILED|Failed|\*\*\*' "$OUT/tests.log" | head -30

  log "(e), tanh GELU"
  e_rows tanh
  if (( SECONDS < 500 )); then  # the device budget may allow no second call: the cross-entropy A/B, once each
    log "A/B: --ce-kernel auto against two-pass, graphed, tanh GELU"
    for ce in auto two-pass; do
      timeout 45 ./build/ddptrain bench --task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 \
        --weight-decay 0.1 --bench-steps 30 --gelu tanh --cuda-graph --ce-kernel "$ce" 2>>"$OUT/ce_ab.err" | grep '^{'
    done | tee "$OUT/ce_ab1.jsonl"
  fi
  log done
  exit 0
fi

if [[ ! -x build/ddptrain ]]; then  # a fresh machine: call 1's build is gone
  log "build (ddptrain only)"
  JOBS=$(nproc) ./setup.sh > "$OUT/build2.log" 2>&1 || { tail -40 "$OUT/build2.log"; exit 1; }
fi

log "(e), exact GELU"
e_rows exact

log "profile: torch.compile, tanh GELU"
torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model gpt2 --batch 16 --steps 10 --amp bf16 --gelu tanh --compile \
  --profile-trace "$OUT/torch_e.json" > "$OUT/torch_prof.log" 2>&1 && \
python3 bench/kernel_breakdown.py "$OUT/torch_e.json" --steps 10 --label "torch.compile tanh" --gpt --top 25 --by-op 20 \
  | tee "$OUT/torch_breakdown.txt"

log "A/B: the one-pass cross-entropy (auto) against two passes, graphed, tanh GELU; twice each, alternating"
for i in 1 2; do
  for ce in auto two-pass; do
    timeout 120 ./build/ddptrain bench --task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 \
      --weight-decay 0.1 --bench-steps 30 --gelu tanh --cuda-graph --ce-kernel "$ce" 2>>"$OUT/ce_ab.err" | grep '^{'
  done
done | tee "$OUT/ce_ab.jsonl"

log "profile: ddptrain eager, tanh GELU"
OUT="$OUT/prof" bash bench/profile_ddptrain.sh e --gelu tanh --cuda-graph=false 2>&1 | tee "$OUT/ddptrain_breakdown.txt"
log done
