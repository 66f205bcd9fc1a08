"""Where a ResNet-50 (224 px, batch 256, bf16, channels-last) training step
spends its GPU time: kernel time grouped by kind, from torch.profiler (CUPTI),
for the PyTorch DDP step of config (c). ddptrain runs the same cuDNN and ATen
kernels, so the split explains why host-side savings (flat buffers, CUDA
graphs) move this config by only a few percent."""
import json
import os

import torch
import torch.nn.functional as F
import torchvision
from torch.profiler import ProfilerActivity, profile

torch.backends.cudnn.benchmark = True
model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
x = torch.randn(256, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
y = torch.randint(0, 1000, (256,), device="cuda")


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(10):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
groups = {}
for e in prof.key_averages():
    t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    n = e.key.lower()
    if t <= 0:
        continue
    kind = ("convolution (cuDNN)" if any(k in n for k in ("conv", "cudnn", "sm90_xmma", "wgrad", "dgrad", "implicit"))
            else "batch norm" if "norm" in n or "bn_" in n
            else "optimizer" if "adam" in n or "multi_tensor" in n
            else "elementwise (relu, add, cast)" if "elementwise" in n or "vectorized" in n or "relu" in n or "copy" in n
            else "gemm" if "gemm" in n or "cublas" in n
            else "other")
    groups[kind] = groups.get(kind, 0) + t
total = sum(groups.values())
print(json.dumps({"config": "c", "profile": "pytorch ddp step kernel time share",
                  "ms_per_step_gpu": total / 10 / 1000,
                  "share": {k: round(v / total, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}))
