"""Where a ResNet-50 (224 px, batch 256, bf16, channels-last) training step
spends its GPU time, for config (c): kernel time grouped by kind, from
torch.profiler (CUPTI), plus the idle time between kernels (wall time per
step minus kernel time). --compile default|reduce-overhead profiles PyTorch's
torch.compile step (Inductor's fused Triton kernels are classed by what
they fuse). ddptrain's side of the comparison: `ddptrain bench --profile`.

    python3 bench/profile_step.py [--compile default]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.profiler import ProfilerActivity, profile


def kind_of(name):
    n = name.lower()
    if n.startswith("triton"):
        if "batch_norm" in n or "native_batch" in n:
            return "batch norm (Inductor, fused with elementwise)"
        if "convolution" in n:
            return "convolution (cuDNN)"
        return "elementwise (Inductor, fused)"
    if any(k in n for k in ("conv", "cudnn", "sm90_xmma", "wgrad", "dgrad", "implicit", "cutlass")):
        return "convolution (cuDNN)"
    if "norm" in n or "bn_" in n:
        return "batch norm"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "gemm" in n or "cublas" in n:
        return "gemm"
    if "copy" in n or "memcpy" in n or "memset" in n:
        return "copies"
    if "elementwise" in n or "vectorized" in n or "relu" in n or "reduce" in n:
        return "elementwise (relu, add, cast)"
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compile", default="none", choices=["none", "default", "reduce-overhead"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    if args.compile != "none":
        model = torch.compile(model, mode=args.compile)
    x = torch.randn(256, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (256,), device="cuda")

    def step():
        if args.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(15):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    groups = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            k = kind_of(e.key)
            groups[k] = groups.get(k, 0) + t / args.steps / 1000
    kernel_ms = sum(groups.values())
    groups["idle between kernels (host gaps)"] = max(0.0, wall_ms - kernel_ms)
    print(json.dumps({"config": "c", "profile": "pytorch ddp" + ("" if args.compile == "none" else " + compile " + args.compile),
                      "ms_per_step_wall": round(wall_ms, 2), "ms_per_step_kernels": round(kernel_ms, 2),
                      "ms": {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}))


if __name__ == "__main__":
    main()
