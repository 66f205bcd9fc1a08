#!/usr/bin/env bash
# Build and run the cuDNN conv+genstats probe (bench/exp/cudnn_conv_genstats.cpp)
# on the GPU machine: cuDNN's backend graph API, conv fprop with BN statistics
# fused in its epilogue, against the plain conv plus a separate stats pass.
#
#   bash bench/exp/cudnn_conv_genstats.sh                 # bf16 then fp16, all shapes
#   DTYPES=bf16 ARGS="--only l3. --iters 20" bash bench/exp/cudnn_conv_genstats.sh
#   ARGS="--check-only" bash bench/exp/cudnn_conv_genstats.sh   # small shapes, host reference
#   CUDNN_LOGLEVEL_DBG=3 ...                              # cuDNN's own log, more detail
#
# Needs nvcc (CUDA=/usr/local/cuda) and cuDNN 9: headers and libcudnn.so.9 from
# the system (/usr/include/x86_64-linux-gnu, /usr/lib/x86_64-linux-gnu) or the
# PyTorch wheel (CUDNN_WHEEL=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn).
# Writes $OUT (default /tmp/cudnn_genstats): build.log, results.jsonl (one
# JSON line per shape and dtype, then a count-weighted summary per dtype),
# stderr-<dtype>.log (one-line errors naming the cuDNN status), cudnn.log
# (cuDNN's error log).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/cudnn_genstats}
mkdir -p "$OUT"
CUDA=${CUDA:-/usr/local/cuda}
NVCC=$CUDA/bin/nvcc
WHEEL=${CUDNN_WHEEL:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn}
DTYPES=${DTYPES:-"bf16 fp16"}
ARGS=${ARGS:-}

# Headers: the system's first, then the CUDA toolkit's, then the wheel's.
# Libraries: the ones beside the chosen headers first, then any other
# directory holding a libcudnn.so.9.
INC=""
for d in ${CUDNN_INCLUDE:-} /usr/include/x86_64-linux-gnu /usr/include "$CUDA/include" "$WHEEL/include"; do
  if [[ -f $d/cudnn_graph.h ]]; then INC=$d; break; fi
done
if [[ -z $INC ]]; then echo "no cudnn_graph.h found (set CUDNN_INCLUDE)" >&2; exit 1; fi
case $INC in
  "$WHEEL/include") CANDS=("$WHEEL/lib" /usr/lib/x86_64-linux-gnu "$CUDA/lib64") ;;
  "$CUDA/include") CANDS=("$CUDA/lib64" /usr/lib/x86_64-linux-gnu "$WHEEL/lib") ;;
  *) CANDS=(/usr/lib/x86_64-linux-gnu "$CUDA/lib64" "$WHEEL/lib") ;;
esac
LIBDIRS=()
for d in ${CUDNN_LIB:-} "${CANDS[@]}"; do
  if [[ -e $d/libcudnn.so.9 && " ${LIBDIRS[*]-} " != *" $d "* ]]; then LIBDIRS+=("$d"); fi
done
if [[ ${#LIBDIRS[@]} -eq 0 ]]; then echo "no libcudnn.so.9 found (set CUDNN_LIB)" >&2; exit 1; fi
LFLAGS=()
for d in "${LIBDIRS[@]}"; do LFLAGS+=("-L$d" "-Wl,-rpath,$d"); done
HDRVER=$(awk '/#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) /{printf "%s.", $3}' "$INC/cudnn_version.h" | sed 's/\.$//')

SM=${SM:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')}
SM=${SM:-90}
BIN=$OUT/cudnn_conv_genstats
(
  echo "headers: $INC (cuDNN $HDRVER); libraries: ${LIBDIRS[*]}; sm_$SM"
  set -x
  # Compiled as CUDA (it has kernels), linked by the host compiler so that
  # -l:libcudnn.so.9 (the wheel has no unversioned libcudnn.so) comes after
  # the object.
  "$NVCC" -x cu -std=c++17 -O3 -arch="sm_$SM" -I"$INC" -c "$HERE/cudnn_conv_genstats.cpp" -o "$OUT/cudnn_conv_genstats.o" &&
  g++ "$OUT/cudnn_conv_genstats.o" -o "$BIN" \
    -L"$CUDA/lib64" -Wl,-rpath,"$CUDA/lib64" -lcudart "${LFLAGS[@]}" -l:libcudnn.so.9
) >"$OUT/build.log" 2>&1
rc=$?
cat "$OUT/build.log"
if [[ $rc -ne 0 ]]; then echo "build failed (rc $rc), see $OUT/build.log" >&2; exit $rc; fi

# libcudnn.so.9 loads its sub-libraries (libcudnn_graph.so.9, engines, ...)
# at run time: keep the chosen directory first on the search path.
LIBPATH=$(IFS=:; echo "${LIBDIRS[*]}")
export LD_LIBRARY_PATH="$LIBPATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDNN_LOGLEVEL_DBG=${CUDNN_LOGLEVEL_DBG:-1}   # errors only: why a graph is not supported
export CUDNN_LOGDEST_DBG=${CUDNN_LOGDEST_DBG:-$OUT/cudnn.log}
ldd "$BIN" 2>/dev/null | grep -Ei 'cudnn|cudart' | tee -a "$OUT/build.log"
"$BIN" --descriptors-only --only l1.3x3 >/dev/null || echo "WARNING: descriptor check failed" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$OUT/build.log"

: >"$OUT/results.jsonl"
status=0
for dt in $DTYPES; do
  echo "== $dt ($(date -u +%H:%M:%S))"
  # shellcheck disable=SC2086
  "$BIN" --dtype "$dt" $ARGS 2> >(tee "$OUT/stderr-$dt.log" >&2) | tee -a "$OUT/results.jsonl"
  rc=${PIPESTATUS[0]}
  [[ $rc -ne 0 ]] && status=$rc && echo "probe exited $rc for $dt" >&2
done
sleep 1  # let the stderr tee finish

# A short table (python3 is optional).
if command -v python3 >/dev/null; then
  python3 - "$OUT/results.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
f = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
cols = ["conv_ms", "stats_pass_ms", "conv_genstats_ms", "conv_genstats_speedup", "conv_genstats_err_sqsum",
        "sbr_conv_genstats_ms", "sbr_conv_genstats_speedup", "conv_reduce_ms"]
print("dtype name " + " ".join(cols))
for r in rows:
    if r.get("kind") in ("shape", "check"):
        print(r.get("dtype"), r.get("name"), " ".join(f(r.get(c)) for c in cols),
              *(f"{k}={r[k][:90]}" for k in r if k.endswith("error")))
    elif r.get("kind") == "summary":
        print("summary", r.get("dtype"), {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k not in ("kind", "dtype", "note")})
EOF
fi
echo "results: $OUT/results.jsonl"
exit "$status"
