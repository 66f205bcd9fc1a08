#!/usr/bin/env bash
# The side-by-side benchmark, in one run on one GPU (issue "GPU speed"):
#   (i)   the seed's Python script, betas fixed      bench/seed_ddp.py
#   (ii)  idiomatic PyTorch DDP (fused Adam, torchrun) bench/torch_ddp.py, eager
#         and torch.compile (default, reduce-overhead): PyTorch's best
#   (iii) ddptrain eager                              ddptrain bench
#   (iv)  ddptrain --cuda-graph                       ddptrain bench --cuda-graph
# on (a) ResNet-18 64 px batch 32 Adam fp32, (b) ResNet-18 64 px batch 256
# bf16, (c) ResNet-50 224 px batch 256 bf16 channels-last, and (d) Fashion-
# MNIST ResNet-18 (small stem) wall time from launch to 93% test accuracy;
# and (e) GPT-2 124M, context 1024, bf16, AdamW on random tokens: the
# nanoGPT-style PyTorch script bench/gpt_torch.py eager and torch.compile,
# ddptrain bench --task lm eager and --cuda-graph (GPT_BATCH, GPT_STEPS; GPT_GELU
# "exact", "tanh" or both; GPT_COMPILE_MODES, torch.compile's modes to run);
# and (f) ResNet-50 trained from a folder of ImageNet-like JPEGs
# (bench/make_jpeg_folder.py, F_FILES of them), from files to weights:
# PyTorch's DataLoader (PIL) and decode_jpeg on the GPU (bench/e2e_torch.py,
# torch.compile reduce-overhead; F_TORCH=0 leaves them out), ddptrain
# --image-decode cpu and gpu, the latter with the CPU decoding a share of each
# batch too (F_DECODES), each beside its own step on a resident batch.
#
#   bash bench/run.sh            # OUT=dir for the logs (default /tmp/bench)
#   PHASES="build step" bash bench/run.sh
#   PHASES="bn" bash bench/run.sh   # batch-norm kernels alone (bench/bn_bandwidth.py, bench/bn_kernels.py)
#
# Writes $OUT/results.jsonl (one JSON line per measurement) and
# $OUT/table.md (bench/table.py), which go into bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/bench}; mkdir -p "$OUT"
PHASES=${PHASES:-"build step fmnist gpt"}
STEPS=${STEPS:-100}
FM=${FM:-$PWD/.data/fashion-mnist}
R="$OUT/results.jsonl"
has() { [[ " $PHASES " == *" $1 "* ]]; }
log() { echo "== $* ($(date -u +%H:%M:%S))"; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch,torchvision;print("torch",torch.__version__,"cuda",torch.version.cuda,"cudnn",torch.backends.cudnn.version(),"torchvision",torchvision.__version__)' | tee -a "$OUT/machine.txt"

if has build; then
  log build
  JOBS=$(nproc) ./setup.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
B=./build/ddptrain

step_config() {  # name, then shared args for ddptrain bench and torch_ddp.py step
  local name=$1; shift
  local model=$1 size=$2 batch=$3 amp=$4 cl=$5
  local common=(--model "$model" --image-size "$size" --batch "$batch" --optimizer adam --lr 1e-4 --amp "$amp" --steps "$STEPS")
  local py_cl=(); [[ $cl == on ]] && py_cl=(--channels-last)
  for mode in ${COMPILE_MODES:-none default reduce-overhead}; do  # PyTorch's best is a contender too
    log "config $name: python ddp, torch.compile $mode"
    timeout ${COMPILE_TIMEOUT:-420} torchrun --standalone --nproc-per-node 1 bench/torch_ddp.py step "${common[@]}" \
      "${py_cl[@]}" --compile "$mode" 2>"$OUT/$name.py.$mode.err" | grep '^{' | sed "s/^{/{\"config\": \"$name\", /" | tee -a "$R"
  done
  for graph in false true; do
    log "config $name: ddptrain cuda-graph=$graph"
    $B bench --model "$model" --image-size "$size" --batch "$batch" --optimizer adam --lr 1e-4 --amp "$amp" \
      --bench-steps "$STEPS" --channels-last "$cl" --cuda-graph="$graph" 2>"$OUT/$name.$graph.err" \
      | grep '^{' | sed "s/^{/{\"config\": \"$name\", /" | tee -a "$R"
  done
  if [[ $amp != off && $cl == on ]]; then  # what ddptrain's batch-norm kernels, and their fusion, add
    for bn in unfused native; do
      log "config $name: ddptrain cuda-graph, --bn-kernel $bn"
      $B bench --model "$model" --image-size "$size" --batch "$batch" --optimizer adam --lr 1e-4 --amp "$amp" \
        --bench-steps "$STEPS" --channels-last "$cl" --cuda-graph --bn-kernel $bn 2>"$OUT/$name.$bn.bn.err" \
        | grep '^{' | sed "s/^{/{\"config\": \"$name\", /" | tee -a "$R"
    done
  fi
}

if has step && [[ " ${CONFIGS:-a} " == *" a "* && ${SEED:-1} == 1 ]]; then  # SEED=0: skip (i)
  log "config a: seed script (betas fixed), 3 epochs of its 1000 random images"
  (cd "$OUT" && timeout 300 python3 "$OLDPWD/bench/seed_ddp.py" --size 1 --visible 0 --epochs 3 --batch 32 \
     --save_path "$OUT/seed_ck" 2>"$OUT/seed.err") | grep '^{' | tail -1 | sed 's/^{/{"config": "a", /' | tee -a "$R"
fi
if has step; then  # CONFIGS="c" bash bench/run.sh: only some configs
  for cfg in ${CONFIGS:-a b c}; do
    case $cfg in
      a) step_config a resnet18 64 32 off off ;;
      b) step_config b resnet18 64 256 bf16 on ;;
      c) step_config c resnet50 224 256 bf16 on ;;
    esac
  done
fi

if has fmnist; then
  FB=${FMNIST_BATCH:-256}; FLR=${FMNIST_LR:-4e-3}; FE=${FMNIST_EPOCHS:-12}
  log "config d: python ddp, Fashion-MNIST to 93%"
  t0=$(date +%s.%N)
  torchrun --standalone --nproc-per-node 1 bench/torch_ddp.py fmnist --data-root "$FM" --batch "$FB" --lr "$FLR" \
    --epochs "$FE" --amp bf16 --workers 6 2>"$OUT/d.py.err" > "$OUT/d.py.log"
  t1=$(date +%s.%N); tail -1 "$OUT/d.py.log"
  python3 -c "import json,sys; d=json.loads(open('$OUT/d.py.log').read().strip().splitlines()[-1]); d.update(config='d', wall_s=$t1-$t0); print(json.dumps(d))" | tee -a "$R"
  for graph in false true; do
    log "config d: ddptrain cuda-graph=$graph"
    t0=$(date +%s.%N)
    $B --model resnet18 --stem small --data_root "$FM" --batch "$FB" --lr "$FLR" --epochs "$FE" --amp bf16 \
      --cuda-graph="$graph" --workers 6 --stop-at-acc 0.93 --progress plain --log-every 100000 \
      --save_path "$OUT/ck_$graph" > "$OUT/d.$graph.log" 2>&1
    rc=$?; t1=$(date +%s.%N)
    grep -E "^epoch|reached|error" "$OUT/d.$graph.log"
    python3 - "$OUT/d.$graph.log" "$graph" "$t0" "$t1" "$rc" <<'PY' | tee -a "$R"
import json, re, sys
log, graph, t0, t1, rc = sys.argv[1], sys.argv[2] == "true", float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
epochs = re.findall(r"^epoch (\d+)/\d+ .* test_acc ([\d.]+)%", open(log).read(), re.M)
acc = float(epochs[-1][1]) / 100 if epochs else 0.0
peak = re.findall(r"peak GPU memory (\d+) MiB", open(log).read())
print(json.dumps({"config": "d", "contender": "ddptrain cuda-graph" if graph else "ddptrain eager", "rc": rc,
                  "reached": acc >= 0.93, "epochs": len(epochs), "test_acc": acc, "wall_s": t1 - t0,
                  "peak_mem_mib": float(peak[-1]) if peak else 0.0}))
PY
  done
fi
if has gpt; then
  # GPT_GELU: the MLP's GELU, or a list ("exact tanh"), each measured on both sides.
  GB=${GPT_BATCH:-16}; GS=${GPT_STEPS:-50}
  for GG in ${GPT_GELU:-exact}; do
    for mode in eager ${GPT_COMPILE_MODES:-default}; do  # e.g. GPT_COMPILE_MODES="default reduce-overhead"
      log "config e: pytorch $mode, $GG GELU"
      compile=(); [[ $mode != eager ]] && compile=(--compile "$mode")
      torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --model gpt2 --batch "$GB" --steps "$GS" \
        --amp bf16 --gelu "$GG" "${compile[@]}" 2>"$OUT/e.py.$mode.$GG.err" | grep '^{' | sed 's/^{/{"config": "e", /' | tee -a "$R"
    done
    for graph in false true; do
      log "config e: ddptrain cuda-graph=$graph, $GG GELU"
      $B bench --task lm --model gpt2 --batch "$GB" --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --bench-steps "$GS" \
        --gelu "$GG" --cuda-graph="$graph" 2>"$OUT/e.$graph.$GG.err" | grep '^{' | sed 's/^{/{"config": "e", /' | tee -a "$R"
    done
  done
  [[ ${GPT_NATIVE:-1} == 1 ]] && log "config e: ddptrain cuda-graph with LibTorch's LayerNorm and linear backward (--ln-kernel native --linear-kernel native)" \
  && $B bench --task lm --model gpt2 --batch "$GB" --amp bf16 --optimizer adamw --lr 6e-4 --weight-decay 0.1 --bench-steps "$GS" \
    --cuda-graph --ln-kernel native --linear-kernel native 2>"$OUT/e.native.err" | grep '^{' | sed 's/^{/{"config": "e", /' | tee -a "$R"
fi
if has f; then
  F_DIR=${F_DIR:-/tmp/ddp_f_jpegs}; F_FILES=${F_FILES:-20000}
  [[ -f $F_DIR.done ]] || { log "config f: making $F_FILES JPEGs in $F_DIR"; rm -rf "$F_DIR"
    python3 bench/make_jpeg_folder.py "$F_DIR" --files "$F_FILES" --classes 100 | tee -a "$OUT/f.data.txt" \
      && touch "$F_DIR.done"; }  # the marker: a folder left half-made by an interrupted run is made again
  [[ ${F_TORCH:-1} == 1 ]] && log "config f: pytorch (resident batch, DataLoader, decode_jpeg on the GPU), torch.compile ${F_COMPILE:-reduce-overhead}" \
  && timeout ${COMPILE_TIMEOUT:-420} torchrun --standalone --nproc-per-node 1 bench/e2e_torch.py "$F_DIR" \
    --compile "${F_COMPILE:-reduce-overhead}" --steps "${F_STEPS:-60}" --workers "${F_WORKERS:-$(nproc)}" \
    2>"$OUT/f.py.err" | grep '^{' | tee -a "$R"
  log "config f: ddptrain step on a resident batch"
  $B bench --model resnet50 --image-size 224 --batch 256 --optimizer adam --lr 1e-4 --amp bf16 --bench-steps 40 \
    --channels-last on --cuda-graph 2>"$OUT/f.resident.err" | grep '^{' \
    | sed 's/^{/{"config": "f", "data": "resident batch", /' | tee -a "$R"
  # F_DECODES: the ddptrain contenders, "gpu", "cpu" or "gpu:S" (--image-decode gpu --cpu-decode-share S;
  # "gpu" alone takes the default share, 1)
  for item in ${F_DECODES:-gpu gpu:0.7 gpu:0 cpu}; do
    dec=${item%%:*}; share=""; [[ $item == *:* ]] && share=${item#*:}
    share_flag=(); [[ -n $share ]] && share_flag=(--cpu-decode-share "$share")
    log "config f: ddptrain --image-decode $dec --cpu-decode-share ${share:-(default)}"
    t0=$(date +%s.%N)
    $B --dataset imagefolder --data_root "$F_DIR" --val-split 0.02 --model resnet50 --image-size 224 --batch 256 \
      --amp bf16 --channels-last on --cuda-graph --optimizer adam --lr 1e-4 --epochs 3 --workers "${F_WORKERS:-$(nproc)}" \
      --image-decode $dec "${share_flag[@]}" --progress none --save_path "$OUT/f.$item" > "$OUT/f.$item.log" 2>&1
    rc=$?; t1=$(date +%s.%N)
    python3 - "$OUT/f.$item.log" "$dec" "$rc" "$t0" "$t1" "$share" <<'PY' | tee -a "$R"
import json, re, sys
log, dec, rc, t0, t1, share = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
if share: dec += f" --cpu-decode-share {share}"
ep = re.findall(r"^epoch (\d+)/\d+ .*?([\d.]+) s\s+(\d+) samples/s\s+data wait (\d+)%", open(log).read(), re.M)
last = ep[-1] if ep else ("0", "0", "0", "0")
print(json.dumps({"config": "f", "contender": f"ddptrain --image-decode {dec}, cuda-graph", "rc": rc,
                  "epochs": len(ep), "images_per_s": float(last[2]), "data_wait": float(last[3]) / 100,
                  "per_epoch_images_per_s": [float(e[2]) for e in ep], "wall_s": t1 - t0}))
PY
    rm -f "$OUT/f.$item"/*.pt
  done
fi
if has profile; then
  log "config c: kernel-time profiles of the PyTorch steps (eager, compile) and of ddptrain's"
  for compile in none default; do
    timeout 300 python3 bench/profile_step.py --compile $compile 2>"$OUT/profile.$compile.err" | tee -a "$OUT/profile.jsonl"
  done
  OUT="$OUT" bash bench/profile_ddptrain.sh c --cuda-graph 2>"$OUT/profile.ddptrain.err" | tee -a "$OUT/profile.jsonl"
fi
if has gpt_profile; then
  log "config e: kernel-time profile of ddptrain's GPT step"
  OUT="$OUT" bash bench/profile_ddptrain.sh e --cuda-graph 2>"$OUT/profile.e.err" | tee -a "$OUT/profile.jsonl"
fi
if has bn; then
  log "batch norm: every kernel of one ResNet-50's batch norms against a copy's bandwidth, and the float64 check"
  python3 bench/bn_bandwidth.py 2>"$OUT/bn_bandwidth.err" | tee -a "$OUT/bn.jsonl"
  timeout 300 python3 bench/bn_kernels.py 2>"$OUT/bn_kernels.err" | tee -a "$OUT/bn.jsonl"
fi
python3 bench/table.py "$R" > "$OUT/table.md" && cat "$OUT/table.md"
