"""GPT weights move between ddptrain and nanoGPT-style PyTorch, both ways,
with the same logits (fp32, max difference <= 1e-4).

After building (./setup.sh), one command:

  python3 bench/gpt_interop.py                    # --ddptrain ./build/ddptrain --work /tmp/gpt_interop

(a) PyTorch -> ddptrain: a GPT of bench/gpt_torch.py (2 layers, 4 heads,
    width 128, context 64, GPT-2's padded vocabulary) saves its state_dict;
    ddptrain starts from it with --pretrain (an SGD step of lr 1e-30 leaves
    the weights as they are, so the checkpoint holds them) and writes the
    logits of a prompt (`ddptrain generate --logits-out`); they must equal
    PyTorch's.
(b) ddptrain -> PyTorch: ddptrain trains the same architecture for a few
    steps from its own initialisation, `ddptrain export` writes a
    state_dict, PyTorch loads it strictly (every nanoGPT name, the tied
    head included) and its logits must equal ddptrain's.

Both sides compute on the CPU in fp32; ddptrain trains on whatever device
it finds. The data are random GPT-2 token ids in nanoGPT's train.bin and
val.bin layout, written under --work. Prints one JSON line; exit 1 if a
check fails.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_torch import GPT, GPTConfig  # noqa: E402

SIZES = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=50304)
FLAGS = ["--task", "lm", "--model", "gpt", "--layers", "2", "--heads", "4", "--width", "128", "--context", "64",
         "--vocab-size", "50304", "--size", "1", "--progress", "none", "--epochs", "1", "--batch", "4",
         "--test-samples", "8"]


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}")
    return r.stdout


def newest(root, name):
    found = [os.path.join(d, name) for d, _, files in os.walk(root) if name in files]
    return max(found, key=os.path.getmtime)


def ddptrain_logits(exe, checkpoint, prompt, out):
    run([exe, "generate", checkpoint, "--prompt", " ".join(map(str, prompt)), "--tokens", "0", "--logits-out", out])
    return torch.load(out)["logits"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddptrain", default=os.path.join(os.path.dirname(__file__), "..", "build", "ddptrain"))
    ap.add_argument("--work", default="/tmp/gpt_interop")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, 20000).astype(np.uint16).tofile(os.path.join(args.work, "train.bin"))
    rng.integers(0, 50257, 4000).astype(np.uint16).tofile(os.path.join(args.work, "val.bin"))
    prompt = [int(t) for t in rng.integers(0, 50257, 48)]
    idx = torch.tensor([prompt])
    result = {"sizes": SIZES, "prompt_tokens": len(prompt), "tolerance": args.tolerance}

    # (a) PyTorch -> ddptrain
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SIZES)).eval()
    with torch.no_grad():  # not the initialisation: every bias and LayerNorm matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sd = os.path.join(args.work, "pytorch_state_dict.pt")
    torch.save(model.state_dict(), sd)
    save_a = os.path.join(args.work, "run_a")
    run([args.ddptrain, *FLAGS, "--data_root", args.work, "--save_path", save_a, "--pretrain", sd,
         "--train-samples", "1", "--optimizer", "sgd", "--lr", "1e-30", "--momentum", "0", "--weight-decay", "0"])
    with torch.no_grad():
        expected, _ = model(idx)
    got = ddptrain_logits(args.ddptrain, newest(save_a, "best.pt"), prompt, os.path.join(args.work, "logits_a.pt"))
    result["pytorch_to_ddptrain_max_diff"] = (got - expected).abs().max().item()

    # (b) ddptrain -> PyTorch
    save_b = os.path.join(args.work, "run_b")
    run([args.ddptrain, *FLAGS, "--data_root", args.work, "--save_path", save_b, "--train-samples", "40"])
    checkpoint = newest(save_b, "best.pt")
    exported = os.path.join(args.work, "ddptrain_state_dict.pt")
    run([args.ddptrain, "export", checkpoint, exported])
    back = GPT(GPTConfig(**SIZES)).eval()
    missing, unexpected = back.load_state_dict(torch.load(exported), strict=True)
    assert back.lm_head.weight is back.transformer.wte.weight, "loading untied the head"
    with torch.no_grad():
        expected, _ = back(idx)
    got = ddptrain_logits(args.ddptrain, checkpoint, prompt, os.path.join(args.work, "logits_b.pt"))
    result["ddptrain_to_pytorch_max_diff"] = (got - expected).abs().max().item()

    result["ok"] = (result["pytorch_to_ddptrain_max_diff"] <= args.tolerance and
                    result["ddptrain_to_pytorch_max_diff"] <= args.tolerance)
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
