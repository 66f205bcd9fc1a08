"""GPU kernel time per step by class, from a Chrome trace that
`ddptrain bench --profile-trace FILE` (or torch.profiler's
export_chrome_trace) wrote.

    python3 bench/kernel_breakdown.py TRACE --steps N [--wall-ms MS] [--label L] [--gpt]

Classes are those of bench/profile_step.py (convolution, batch norm,
elementwise, optimizer, copies, ...), plus, with --gpt, the Transformer's:
matmul, attention, layer norm, softmax / cross-entropy. With --wall-ms (the
step's measured wall time), "idle" is wall time minus kernel time: the
host gaps. Prints one JSON line; --top K adds the K costliest kernels, and
--by-op K the K ATen ops whose kernels cost most (eager steps only: a CUDA
graph's replayed kernels have no launching op). --by-stream adds, per CUDA
stream, its kernel time and its busy time (the union of its kernels'
intervals), and the GPU's busy time over all streams: for a training run
(`ddptrain ... --profile-trace`), whether the data stage's kernels on the
feeder's stream slow the step's, or the step waits for them. --gaps K adds
the GPU's idle time (no kernel or copy on any stream) per step, split by
the stream and kernel that end each idle interval, the K largest: what the
GPU was waiting for (work that is not a kernel, such as nvJPEG's hardware
engine, shows as the idle time before the kernel that consumes it)."""
import argparse
import gzip
import json
from collections import defaultdict

from profile_step import kind_of as image_kind


def kind_of(name, gpt):
    n = name.lower()
    if "ddp::cuda" in n:  # a GPT runs ddptrain's layer norm and cross-entropy; a ResNet its batch norm
        return "layer norm, cross-entropy (ddptrain kernels)" if gpt else "batch norm (ddptrain kernels)"
    if not gpt:
        return image_kind(name)
    if "flash" in n or "fmha" in n or "attention" in n or "attn" in n:
        return "attention"
    if "layer_norm" in n or "layernorm" in n:
        return "layer norm"
    if "softmax" in n or "nll_loss" in n or "cross_entropy" in n:
        return "softmax / cross-entropy"
    if any(k in n for k in ("gemm", "cublas", "nvjet", "xmma", "cutlass", "sm90_", "sm100_")):
        return "matmul"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "copy" in n or "memcpy" in n or "memset" in n or "catarray" in n:
        return "copies"
    if "embedding" in n or "index" in n:
        return "embedding"
    if "gelu" in n:
        return "gelu"
    if "elementwise" in n or "vectorized" in n or "reduce" in n:
        return "elementwise (add, cast, dropout, ...)"
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--wall-ms", type=float)
    p.add_argument("--label", default="ddptrain")
    p.add_argument("--gpt", action="store_true")
    p.add_argument("--top", type=int, default=0)
    p.add_argument("--by-op", type=int, default=0)
    p.add_argument("--shapes", action="store_true", help="--by-op: one row per op and input shapes")
    p.add_argument("--by-stream", action="store_true")
    p.add_argument("--gaps", type=int, default=0)
    a = p.parse_args()
    events = json.load(gzip.open(a.trace, "rt") if a.trace.endswith(".gz") else open(a.trace))
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    groups, names, ops = defaultdict(float), defaultdict(float), defaultdict(float)
    intervals = defaultdict(list)  # stream -> [(start, end)] in microseconds
    spans = []  # (start, end, stream, name) of every kernel and copy
    # The op that launched a kernel shares its "External id" (correlation).
    def op_name(e):  # with its input shapes and types, when the trace has them
        args = e.get("args", {})
        if not a.shapes or "Input Dims" not in args:
            return e.get("name", "")
        return f'{e.get("name", "")} {args["Input Dims"]} {args.get("Input type", "")}'
    op_of = {e["args"]["External id"]: op_name(e) for e in events
             if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    for e in events:
        if e.get("ph") == "X" and e.get("cat", "").lower() in ("kernel", "gpu_memcpy", "gpu_memset"):
            ms = e.get("dur", 0) / 1000 / a.steps
            groups[kind_of(e.get("name", ""), a.gpt)] += ms
            names[e.get("name", "")[:120]] += ms
            ops[op_of.get(e.get("args", {}).get("External id"), "(no op: graph replay, or none)")] += ms
            intervals[e.get("args", {}).get("stream", "?")].append((e.get("ts", 0), e.get("ts", 0) + e.get("dur", 0)))
            spans.append((e.get("ts", 0), e.get("ts", 0) + e.get("dur", 0), e.get("args", {}).get("stream", "?"),
                          e.get("name", "")[:80]))
    kernel_ms = sum(groups.values())
    if a.wall_ms:
        groups["idle between kernels (host gaps)"] = max(0.0, a.wall_ms - kernel_ms)
    out = {"profile": a.label, "ms_per_step_kernels": round(kernel_ms, 2),
           "ms": {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}
    if a.wall_ms:
        out["ms_per_step_wall"] = a.wall_ms
    if a.top:
        out["top"] = [[k, round(v, 3)] for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:a.top]]
    if a.by_op:
        out["by_op"] = [[k, round(v, 3)] for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:a.by_op]]
    if a.by_stream:
        def busy(spans):  # the union of the intervals' lengths
            total, end = 0.0, None
            for s, t in sorted(spans):
                if end is None or s > end:
                    total, end = total + (t - s), t
                elif t > end:
                    total, end = total + (t - end), t
            return total
        everything = [iv for spans in intervals.values() for iv in spans]
        first, last = min(s for s, _ in everything), max(t for _, t in everything)
        out["streams"] = {str(k): {"kernel_ms": round(sum(t - s for s, t in v) / 1000 / a.steps, 2),
                                   "busy_ms": round(busy(v) / 1000 / a.steps, 2), "kernels": len(v)}
                          for k, v in sorted(intervals.items(), key=lambda kv: -len(kv[1]))}
        out["gpu_busy_ms"] = round(busy(everything) / 1000 / a.steps, 2)
        out["first_to_last_kernel_ms"] = round((last - first) / 1000 / a.steps, 2)
    if a.gaps and spans:
        spans.sort()
        idle, end = defaultdict(float), spans[0][1]
        for start, stop, stream, name in spans[1:]:
            if start > end:  # the GPU was idle from `end` to `start`
                idle[f"stream {stream}: {name}"] += (start - end) / 1000 / a.steps
            end = max(end, stop)
        out["gpu_idle_ms"] = round(sum(idle.values()), 2)
        out["idle_before"] = [[k, round(v, 3)] for k, v in sorted(idle.items(), key=lambda kv: -kv[1])[:a.gaps]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
