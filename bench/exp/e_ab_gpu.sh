#!/usr/bin/env bash
# Issue 15: a change to the (e) step on the GPU, in one device call, the
# decisive results first (a call cut short still returns them):
#   1. build this tree with the tests, and main (a `git archive` of main,
#      carried as .data/main.tar) beside it, ddptrain only;
#   2. the CUDA tests of the changed code (TESTS1, a ctest regex);
#   3. (e) graphed, main against this tree, then torch.compile (same machine);
#   4. more CUDA tests (TESTS2);
#   5. (e) again; this tree's graphed step profiled (kernel count, idle
#      gaps); the attention backends (bench/exp/attention_backends.py); the
#      eager step by ATen op, while there is time.
#   TESTS1=... TESTS2=... [GELU=tanh|exact] [AB_ENV=VAR=value | AB_ARGS="--flag value"] [REPS=n] [EXTRA_RUNS="VAR=a VAR=b,W=c"] \
#     [PROBE_ENV="VAR=v ..." PROBE_GREP=regex] [PROFILE_ENV="VAR=v ..."] \
#     [TESTS3=regex TESTS3_ENV="VAR=v ..."] [SKIP_PROFILE=1] bash bench/exp/e_ab_gpu.sh
#   (logs under $OUT/ab). EXTRA_RUNS: a comma joins variables of one run.
#   REPS=n: the A/B and each EXTRA_RUNS run n times, interleaved (BESIDE=1:
#   each extra run with a run of the default after it); the end prints
#   medians.
#   PROBE_*: one more (e) run under PROBE_ENV, its stderr lines matching
#   PROBE_GREP shown. TESTS3: CUDA tests under TESTS3_ENV, last.
# Session 21 wrote it as slots_gpu.sh for branch param-slots.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}/ab; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
# Each run's ms/step by label (main, this tree, under each variable), the
# median of the repeated ones and its ratio to torch.compile's median: runs
# of one binary spread by up to 0.6 ms within a call (session 27).
summary() {
  python3 - "$OUT/ab.jsonl" <<'PY' || true
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    i = line.find("{")
    if i < 0: continue
    d = json.loads(line[i:])
    label = line[:i].strip() or d.get("contender", "?")
    runs.setdefault(label, []).append(d["ms_per_step"])
compile_ms = [v for k, v in runs.items() if "compile" in k]
ref = statistics.median(compile_ms[0]) if compile_ms else None
for label, ms in runs.items():
    med = statistics.median(ms)
    ratio = f"  {ref / med:.3f}x of torch.compile" if ref else ""
    print(f"{label:60s} median {med:6.2f} ms of {len(ms)}: {' '.join(f'{m:.2f}' for m in ms)}{ratio}")
PY
}
finish() { summary; (cd "$OUT" && tar czf logs.tgz build*.log ./*.err 2>/dev/null && rm -f build*.log ./*.err); log done; exit 0; }  # fewer files back
SHORT=${SHORT:-0}  # 1: little device time left: no main build, no A/B (compare with RESULTS.md)
# QUICK=1: stop after the first tests and (e).
log build
if [[ $SHORT == 0 ]]; then
  mkdir -p /tmp/main && tar -xf .data/main.tar -C /tmp/main
  (cd /tmp/main && JOBS=6 ./setup.sh > "$OUT/build_main.log" 2>&1; echo "main build rc $?" >> "$OUT/build_main.log") &
fi
JOBS=$((SHORT == 1 ? 16 : 10)) ./setup.sh --tests > "$OUT/build.log" 2>&1 || {
  grep -B2 -A12 -m4 -E 'error|FAILED:' build/setup.log | head -120; exit 1; }
wait; [[ $SHORT == 0 ]] && tail -1 "$OUT/build_main.log"
tests() {  # ctest regex, log name
  timeout 150 ctest --test-dir build -j 4 --timeout 120 --output-on-failure -R "$1" > "$OUT/$2.log" 2>&1
  grep -E 'tests passed|FAILED|Failed|\*\*\*' "$OUT/$2.log" | grep -v Skipped | head -20
}
GELU=${GELU:-tanh}  # the MLP's GELU on both sides: tanh (GPT-2's, llm.c's) or exact (nanoGPT's nn.GELU, bench/run.sh's default)
base=(--task lm --model gpt2 --batch 16 --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --gelu "$GELU")
gpt=("${base[@]}" --bench-steps 30 --cuda-graph)
ab() {  # AB_ENV=VAR=value / AB_ARGS="--flag value": this tree is also run with it, between main and the default; REPS rounds, interleaved
  local runs=(/tmp/main .); [[ $SHORT == 1 ]] && runs=(.)
  [[ -n ${AB_ENV:-} ]] && runs=("${runs[@]:0:${#runs[@]}-1}" "$AB_ENV ." .)
  [[ -n ${AB_ARGS:-} ]] && runs=("${runs[@]:0:${#runs[@]}-1}" "+$AB_ARGS" .)
  for ((rep = 0; rep < ${REPS:-1}; rep++)); do for run in "${runs[@]}"; do
    local tree=${run##* } vars=() args=()
    if [[ $run == +* ]]; then tree=.; read -ra args <<< "${run#+}"
    elif [[ $run == *" "* ]]; then vars=("${run% *}"); fi
    echo -n "$run "; env "${vars[@]}" timeout 60 "$tree/build/ddptrain" bench "${gpt[@]}" "${args[@]}" 2>>"$OUT/e.err" | grep '^{'
  done; done | tee -a "$OUT/ab.jsonl"
  grep -iE "error|terminate|what\(\)" "$OUT/e.err" | head -5
}
log "CUDA tests of the changed kernels"; tests "${TESTS1:-ParamSlots|GemmGelu|FusedLinear|FusedLayerNorm}" tests1
log "(e) A/B, graphed, $GELU GELU"; ab
[[ ${QUICK:-0} == 1 ]] && finish  # little device time: the tests and (e) only
log "(e) torch.compile, $GELU GELU (the contender, same machine)"
timeout 150 torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model gpt2 --batch 16 --steps 30 \
  --amp bf16 --gelu "$GELU" --compile 2>"$OUT/e.py.err" | grep '^{' | tee -a "$OUT/ab.jsonl"
log "CUDA tests: GPT, LM, cross-entropy"; tests "${TESTS2:-CrossEntropy.*_CUDA|Gpt\..*_CUDA|LmTask\..*_CUDA}" tests2
[[ ${AB_TWICE:-1} == 1 ]] && { log "(e) A/B again"; ab; }
if [[ -n ${EXTRA_RUNS:-} ]]; then  # "VAR=a VAR=b ...": this tree's (e) under each
  log "(e) under $EXTRA_RUNS"
  for ((rep = 0; rep < ${REPS:-1}; rep++)); do for v in $EXTRA_RUNS; do
    echo -n "$v "; env ${v//,/ } timeout 60 ./build/ddptrain bench "${gpt[@]}" 2>>"$OUT/e.err" | grep '^{'
    if [[ ${BESIDE:-0} == 1 ]]; then echo -n ". "; timeout 60 ./build/ddptrain bench "${gpt[@]}" 2>>"$OUT/e.err" | grep '^{'; fi
  done; done | tee -a "$OUT/ab.jsonl"
fi
if [[ -n ${PROBE_ENV:-} ]]; then
  log "(e) under $PROBE_ENV, stderr matching ${PROBE_GREP:-.}"
  env $PROBE_ENV timeout 90 ./build/ddptrain bench "${gpt[@]}" 2>"$OUT/probe.err" | grep '^{'
  grep -E "${PROBE_GREP:-.}" "$OUT/probe.err" | head -60
fi
[[ ${SKIP_PROFILE:-0} == 1 ]] && finish  # no profile, tests3 or attention (device time)
log "profile, graphed ${PROFILE_ENV:-}"
LINE=$(env ${PROFILE_ENV:-} timeout 120 ./build/ddptrain bench "${base[@]}" --bench-steps 10 --cuda-graph --profile-trace "$OUT/trace.json" 2>>"$OUT/e.err" | grep '^{' | tail -1)
WALL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$LINE")
python3 bench/kernel_breakdown.py "$OUT/trace.json" --steps 10 --wall-ms "$WALL" --gpt --top 40 --gaps 15 --by-stream > "$OUT/breakdown.txt"
head -c 1500 "$OUT/breakdown.txt"; rm -f "$OUT/trace.json"
if [[ -n ${TESTS3:-} ]]; then
  log "CUDA tests under ${TESTS3_ENV:-}"
  (if [[ -n ${TESTS3_ENV:-} ]]; then export ${TESTS3_ENV}; fi; tests "$TESTS3" tests3)
fi
[[ ${SKIP_ATTN:-0} == 1 ]] && finish
log "attention backends"; timeout 90 python3 bench/exp/attention_backends.py 2>"$OUT/attn.err" | tee "$OUT/attn.jsonl"
if (( SECONDS < 420 )); then
  log "profile, eager, by op"
  LINE=$(timeout 90 ./build/ddptrain bench "${base[@]}" --bench-steps 10 --profile-trace "$OUT/trace_eager.json" 2>>"$OUT/e.err" | grep '^{' | tail -1)
  WALL=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$LINE")
  python3 bench/kernel_breakdown.py "$OUT/trace_eager.json" --steps 10 --wall-ms "$WALL" --gpt --by-op 40 > "$OUT/breakdown_eager.txt"
  rm -f "$OUT/trace_eager.json"
fi
finish
