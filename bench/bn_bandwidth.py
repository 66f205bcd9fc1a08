"""Where the batch-norm time of config (c) goes, kernel by kernel, against
the memory bandwidth each kernel could have.

For every batch-norm layer of ResNet-50 (224 px, batch 256, channels-last
bf16), in the variant the model uses it in (relu(bn(x)): bn1, bn2 and the
stem; relu(bn(x) + shortcut): bn3; plain bn: the downsample), this calls
ddptrain's kernels (src/cuda/batch_norm_nhwc.cu, built here as a Python
extension) forward and backward, times each kernel with the profiler, and
divides the bytes it must move by its time. The roof is what a plain copy
of the same tensor reaches (`y.copy_(x)`, read + write). Prints one JSON
line per (shape, variant, kernel), then totals per kernel over the whole
model: time, GB/s, and the time it would take at the copy's bandwidth.

Run on the GPU machine: python3 bench/bn_bandwidth.py [--define NAME=VALUE ...]
(--define passes macros to the kernels' compile, to time variants of them).
"""
import argparse
import json
import os
from collections import Counter, defaultdict

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile
from torch.utils.cpp_extension import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, a macro for the kernels' compile")
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--per-layer", action="store_true", help="print a line per (shape, variant, kernel)")
ap.add_argument("--source", default=f"{ROOT}/src/cuda/batch_norm_nhwc.cu", help="the kernels' .cu file")
ap.add_argument("--tag", default=None, help="the variant's name (default: from --define)")
ap.add_argument("--build-only", action="store_true", help="compile the extension and stop (to build variants at once)")
args = ap.parse_args()
dev = "cuda"

tag = args.tag or "_".join(d.replace("=", "") for d in args.define) or "base"
ext = load(name=f"ddp_bn_bw_{tag}", sources=[args.source, f"{ROOT}/bench/bn_nhwc_bind.cpp"],
           extra_include_paths=[f"{ROOT}/include", f"{ROOT}/src/cuda"],
           extra_cuda_cflags=["-O3"] + [f"-D{d}" for d in args.define], verbose=False)
if args.build_only:
    raise SystemExit(0)

# Every BatchNorm2d of ResNet-50 with its input shape and the variant ddptrain runs it as.
model = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
layers = []


def hook(name):
    kind = "add_relu" if name.endswith("bn3") else "plain" if name.endswith("downsample.1") else "relu"
    return lambda m, i, o: layers.append((tuple(i[0].shape), kind))


hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    model(torch.randn(256, 3, 224, 224, device=dev).to(memory_format=torch.channels_last))
for h in hooks:
    h.remove()
del model
counts = Counter(layers)



def kernel_class(name):
    for k in ("stats_partial", "stats_finalize", "normalize", "grad_partial", "grad_finalize", "grad_input"):
        if k in name:
            return k
    return "other: " + name[:60]


def bytes_moved(k, kind, elems):
    per = {"stats_partial": 1, "normalize": 3 if kind == "add_relu" else 2,
           "grad_partial": 4 if kind == "add_relu" else 2, "grad_input": 3}.get(k, 0)
    return per * elems * 2  # bf16


def run_layer(shape, kind, x, r, dy, w, b, rm, rv):
    if kind == "add_relu":
        y, mean, invstd, _ = ext.forward(x, w, b, rm, rv, 0.1, 1e-5, r, True)
        ext.backward(dy, x, w, mean, invstd, y, True)
    elif kind == "relu":
        y, mean, invstd, ss = ext.forward(x, w, b, rm, rv, 0.1, 1e-5, relu=True)
        ext.relu_backward(dy, x, w, mean, invstd, ss)
    else:
        y, mean, invstd, _ = ext.forward(x, w, b, rm, rv, 0.1, 1e-5)
        ext.backward(dy, x, w, mean, invstd)


def copy_gbps(x):
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(args.reps):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * x.element_size() * args.reps / (s.elapsed_time(e) * 1e-3) / 1e9


totals = defaultdict(lambda: [0.0, 0.0, 0.0])  # class -> [us per model, bytes per model, us at copy speed]
for (shape, kind), n in sorted(counts.items()):
    c = shape[1]
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda: torch.randn(shape, device=dev, generator=g).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    x, r, dy = mk(), mk(), mk()
    w, b = torch.rand(c, device=dev) + 0.5, torch.randn(c, device=dev)
    rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
    for _ in range(3):
        run_layer(shape, kind, x, r, dy, w, b, rm, rv)
    torch.cuda.synchronize()
    roof = copy_gbps(x)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            run_layer(shape, kind, x, r, dy, w, b, rm, rv)
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():  # the GPU's own events: kernels, copies, memsets
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[kernel_class(e.name)] += e.time_range.elapsed_us() / args.reps
    for k, us in sorted(per.items()):
        if us <= 0:
            continue
        by = bytes_moved(k, kind, x.numel())
        gbps = by / (us * 1e-6) / 1e9 if by else None
        totals[k][0] += us * n
        totals[k][1] += by * n
        totals[k][2] += (by / (roof * 1e9) * 1e6 if by else us) * n
        if args.per_layer:
            print(json.dumps({"shape": list(shape), "variant": kind, "layers": n, "kernel": k, "us": round(us, 1),
                              "GBps": round(gbps) if gbps else None, "copy_GBps": round(roof)}), flush=True)

all_us = sum(v[0] for v in totals.values())
all_roof = sum(v[2] for v in totals.values())
for k, (us, by, at_roof) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
    print(json.dumps({"variant": tag, "kernel": k, "ms_per_model": round(us / 1e3, 3),
                      "GBps": round(by / (us * 1e-6) / 1e9) if by else None,
                      "ms_at_copy_speed": round(at_roof / 1e3, 3)}), flush=True)
print(json.dumps({"variant": tag, "total_ms_per_model": round(all_us / 1e3, 3),
                  "at_copy_speed_ms": round(all_roof / 1e3, 3)}), flush=True)
