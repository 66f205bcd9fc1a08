#!/usr/bin/env bash
# ddptrain's side of the config (c) kernel profile: `ddptrain bench` under
# Nsight Systems, kernel time grouped by the classes of bench/profile_step.py.
#   bash bench/profile_ddptrain.sh [extra ddptrain bench flags]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [[ -z "$NSYS" ]]; then echo '{"config": "c", "profile": "ddptrain", "error": "nsys not found on this machine"}'; exit 0; fi
OUT=${OUT:-/tmp/prof}; mkdir -p "$OUT"
"$NSYS" profile -t cuda -o "$OUT/ddptrain_c" -f true ./build/ddptrain bench --model resnet50 --image-size 224 --batch 256 \
  --optimizer adam --lr 1e-4 --amp bf16 --channels-last on --bench-steps 20 "$@" > "$OUT/nsys.log" 2>&1
"$NSYS" stats -r cuda_gpu_kern_sum -f csv -o "$OUT/kern" "$OUT/ddptrain_c.nsys-rep" >> "$OUT/nsys.log" 2>&1
python3 - "$OUT" <<'PY'
import csv, glob, json, sys, os
sys.path.insert(0, "bench")
from profile_step import kind_of
files = glob.glob(os.path.join(sys.argv[1], "kern*.csv"))
if not files:
    print(json.dumps({"config": "c", "profile": "ddptrain", "error": "no kernel summary; see nsys.log"})); sys.exit()
groups, total_ns = {}, 0
for row in csv.DictReader(open(files[0])):
    ns = float(row.get("Total Time (ns)", 0))
    k = kind_of(row.get("Name", ""))
    groups[k] = groups.get(k, 0) + ns
    total_ns += ns
print(json.dumps({"config": "c", "profile": "ddptrain (all timed + warm-up steps)", "kernel_ms_total": round(total_ns / 1e6, 1),
                  "share": {k: round(v / total_ns, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}))
PY
