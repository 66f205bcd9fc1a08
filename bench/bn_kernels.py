"""Batch norm is the largest share of config (c)'s step (bench/profile_step.py).
This times one ResNet-50 (224 px, batch 256) worth of batch-norm layers,
forward and backward, on channels-last input with fp32 affine parameters, in
each way LibTorch can run them:
  native   - F.batch_norm, as autocast leaves it (ATen's own kernels for bf16)
  cudnn    - torch.cudnn_batch_norm called directly (cuDNN's NHWC kernels)
  ddptrain - src/cuda/batch_norm_nhwc.cu (bf16 only), built here as a Python
             extension
for bf16 and fp16 input, and prints one JSON line per variant with the
kernel names that ran. ddptrain's kernels are first checked against a
float64 reference on every ResNet-50 shape and a few odd ones.
Run on the GPU machine: python3 bench/bn_kernels.py"""
import json
import os
from collections import Counter

import torch
import torch.nn.functional as F
import torchvision
from torch.profiler import ProfilerActivity, profile
from torch.utils.cpp_extension import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

torch.backends.cudnn.benchmark = True
dev = "cuda"

# The input shape of every BatchNorm2d in ResNet-50 at batch 256, 224 px.
shapes = []
model = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
hooks = [m.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
         for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    model(torch.randn(256, 3, 224, 224, device=dev).to(memory_format=torch.channels_last))
for h in hooks:
    h.remove()
del model
counts = Counter(shapes)


def make(dtype, fmt=torch.channels_last):
    cases = []
    for shape, n in counts.items():
        c = shape[1]
        x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt).requires_grad_()
        w = torch.ones(c, device=dev, requires_grad=True)
        b = torch.zeros(c, device=dev, requires_grad=True)
        rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
        dy = torch.randn_like(x)
        cases.append((n, x, w, b, rm, rv, dy))
    return cases


def native(x, w, b, rm, rv):
    return F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)


def cudnn(x, w, b, rm, rv):
    return torch.cudnn_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[0]


def cudnn_lowp_params(x, w, b, rm, rv):
    t = x.dtype
    return torch.cudnn_batch_norm(x, w.to(t), b.to(t), rm.to(t), rv.to(t), True, 0.1, 1e-5)[0]


ext = load(name="ddp_bn_nhwc", sources=[f"{ROOT}/src/cuda/batch_norm_nhwc.cu", f"{ROOT}/bench/bn_nhwc_bind.cpp"],
           extra_include_paths=[f"{ROOT}/include"], extra_cuda_cflags=["-O3"], verbose=False)


class NhwcBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, rm, rv):
        y, mean, invstd, _ = ext.forward(x, w, b, rm, rv, 0.1, 1e-5)
        ctx.save_for_backward(x, w, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, invstd = ctx.saved_tensors
        dx, dw, db, _ = ext.backward(dy, x, w, mean, invstd)
        return dx, dw, db, None, None


def ddptrain(x, w, b, rm, rv):
    return NhwcBatchNorm.apply(x, w, b, rm, rv)


def check(shape, dtype):
    """Max error of ddptrain's kernels against float64 batch norm on the same
    (low-precision) input, in units of the output's own rounding."""
    c = shape[1]
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(shape, device=dev, generator=g) * 3 + 2).to(dtype).to(memory_format=torch.channels_last)
    w = torch.rand(c, device=dev, generator=g) + 0.5
    b = torch.randn(c, device=dev, generator=g)
    dy = torch.randn(shape, device=dev, generator=g).to(dtype).to(memory_format=torch.channels_last)
    rm, rv = torch.randn(c, device=dev, generator=g), torch.rand(c, device=dev, generator=g) + 0.5
    rm64, rv64 = rm.double(), rv.double()
    x64 = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    y64 = F.batch_norm(x64, rm64, rv64, w64, b64, True, 0.1, 1e-5)
    y64.backward(dy.double())
    xs, ws, bs = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    y = ddptrain(xs, ws, bs, rm, rv)
    y.backward(dy)
    eps = torch.finfo(dtype).eps

    def err(got, ref):  # relative to the reference's scale
        return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()

    return {"shape": list(shape), "y": err(y, y64) / eps, "dx": err(xs.grad, x64.grad) / eps,
            "dw": err(ws.grad, w64.grad) / eps, "db": err(bs.grad, b64.grad) / eps,
            "running_mean": err(rm, rm64) / eps, "running_var": err(rv, rv64) / eps}


worst = {}
for dtype in (torch.bfloat16,):
    for shape in sorted(counts) + [(3, 8, 5, 7), (2, 24, 1, 1), (5, 96, 9, 3), (1, 2048, 7, 7)]:
        r = check(shape, dtype)
        for k in ("y", "dx", "dw", "db", "running_mean", "running_var"):
            worst[(str(dtype), k)] = max(worst.get((str(dtype), k), 0), r[k])
print(json.dumps({"check": "ddptrain bn_nhwc vs float64, max error in units of the dtype's eps",
                  "worst": {f"{d}/{k}": round(v, 3) for (d, k), v in worst.items()}}), flush=True)


def one_model(fn, cases):
    for n, x, w, b, rm, rv, dy in cases:
        for _ in range(n):
            y = fn(x, w, b, rm, rv)
            torch.autograd.backward(y, dy)


runs = [(torch.bfloat16, torch.channels_last, "native", native),
        (torch.bfloat16, torch.channels_last, "cudnn", cudnn),
        (torch.bfloat16, torch.channels_last, "cudnn_bf16_params", cudnn_lowp_params),
        (torch.bfloat16, torch.contiguous_format, "native_nchw", native),
        (torch.float16, torch.channels_last, "native", native),
        (torch.float16, torch.channels_last, "cudnn", cudnn),
        (torch.bfloat16, torch.channels_last, "ddptrain", ddptrain)]
for dtype, fmt, name, fn in runs:
    cases = make(dtype, fmt)
    row = {"dtype": str(dtype).replace("torch.", ""), "variant": name, "layers": len(shapes)}
    try:
        one_model(fn, cases)
        torch.cuda.synchronize()
        # check the output against the native kernel on the largest case
        n, x, w, b, rm, rv, dy = max(cases, key=lambda c: c[1].numel())
        ref = native(x, w, b, rm.clone(), rv.clone()).float()
        got = fn(x, w, b, rm.clone(), rv.clone()).float()
        row["max_abs_diff_vs_native"] = (ref - got).abs().max().item()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            one_model(fn, cases)
        end.record()
        torch.cuda.synchronize()
        row["ms_fwd_bwd_per_model"] = round(start.elapsed_time(end) / 5, 3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x, w, b, rm, rv).backward(dy)
            torch.cuda.synchronize()
        row["kernels"] = sorted({e.key[:70] for e in prof.key_averages()
                                 if (getattr(e, "device_time_total", 0) or 0) > 0})
    except Exception as e:  # noqa: BLE001 - report and go on
        row["error"] = str(e).splitlines()[0][:200]
    print(json.dumps(row), flush=True)
