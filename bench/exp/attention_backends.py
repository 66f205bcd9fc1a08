"""(e)'s attention, forward and backward, under each SDPA backend.

GPT-2 124M's shapes (batch 16, 12 heads, context 1024, head width 64, bf16,
causal), q, k and v as the views of one [B, T, 3C] projection that the GPT
makes. Prints one JSON line per backend: ms for 12 layers' forward and
backward (what one (e) step spends in attention).
  python3 bench/exp/attention_backends.py
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, T, D, LAYERS = 16, 12, 1024, 64, 12


def run(backend, iters=20):
    C = H * D
    qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def step():
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
        with ctx:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(g)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * LAYERS


for name, backend in [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                      ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
    try:
        print(json.dumps({"backend": name, "ms_per_12_layers_fwd_bwd": round(run(backend), 3),
                          "device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    except Exception as e:  # a backend that does not take these inputs
        print(json.dumps({"backend": name, "error": str(e).splitlines()[0][:200]}), flush=True)
