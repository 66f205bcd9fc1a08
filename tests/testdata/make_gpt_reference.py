"""Reference values for tests/models/gpt_test.cpp, made by PyTorch (Python).

A tiny nanoGPT-style GPT (bench/gpt_torch.py's model: 2 layers, 2 heads,
width 16, context 8, vocabulary 32, biases) with random weights (not the
initialisation, so that every LayerNorm and bias matters) is saved as a
state_dict (both names of the tied weight, as PyTorch writes them), with its
logits for a fixed batch and the gradient of the tied weight (the sum over
the embedding and the head) of the mean next-token loss.

  python3 tests/testdata/make_gpt_reference.py   # PyTorch 1.13 CPU is enough
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from gpt_torch import GPT, GPTConfig  # noqa: E402

torch.manual_seed(1234)
cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, bias=True)
model = GPT(cfg).double()
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
model = model.float()
model.eval()
idx = torch.randint(0, cfg.vocab_size, (2, 8))
targets = torch.randint(0, cfg.vocab_size, (2, 8))
logits, loss = model(idx, targets)
loss.backward()
torch.save(model.state_dict(), os.path.join(HERE, "gpt_tiny_state_dict.pt"))
out = {
    "config": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 32, "bias": True},
    "names": list(model.state_dict().keys()),
    "idx": idx.tolist(),
    "targets": targets.tolist(),
    "logits": logits.detach().reshape(-1).tolist(),
    "loss": loss.item(),
    "wte_grad": model.transformer.wte.weight.grad.reshape(-1).tolist(),
    "torch": torch.__version__,
}
with open(os.path.join(HERE, "gpt_tiny_expected.json"), "w") as f:
    json.dump(out, f)
print("loss", loss.item(), "names", len(out["names"]))
