"""PyTorch <-> ddptrain weight interop, both directions (run on the GPU machine).

  python3 tools/interop_check.py BUILD_DIR OUT_DIR [CHECKPOINT]

1. PyTorch -> C++: torchvision's resnet18 (seeded, BatchNorm statistics
   populated by a few training-mode passes) is saved with
   torch.save(model.state_dict()); ddp_interop loads it through ddptrain's
   --pretrain loader (strict) and runs the forward pass in C++.
2. C++ -> PyTorch: ddp_interop initialises ddptrain's resnet18 and exports it
   (the same writer as `ddptrain export`); torch.load + load_state_dict
   (strict) into torchvision's resnet18, forward in Python.
Both compare fp32 logits on the same input, TF32 off on both sides: the
max abs difference must be <= 1e-4.
3. If CHECKPOINT (a ddptrain resnet18 small-stem Fashion-MNIST checkpoint) is
   given: `ddptrain export` it and load it strictly into torchvision's resnet18
   with the small stem (3x3 conv1 on 1 channel, no max-pool, 10 classes).
Prints one JSON line per check; exits 1 if any fails.
"""
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torchvision

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False


def run(*cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({r.returncode}): {r.stderr}")
    return r.stderr.strip()


def main():
    build, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    tool = os.path.join(build, "ddp_interop")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ok = True
    torch.manual_seed(0)
    x = torch.randn(4, 3, 224, 224)
    torch.save({"x": x}, f"{out}/x.pt")

    # 1. PyTorch -> C++
    tv = torchvision.models.resnet18().to(dev)
    with torch.no_grad():
        tv.train()
        for _ in range(3):
            tv(torch.randn(8, 3, 224, 224, device=dev))
    tv.eval()
    with torch.no_grad():
        ref = tv(x.to(dev)).cpu()
    # As users write it: tensors on the GPU they trained on, and on the CPU.
    for where, sd in (("cuda", tv.state_dict()), ("cpu", {k: v.cpu() for k, v in tv.state_dict().items()})):
        path = f"{out}/torchvision_resnet18_{where}.pt"
        torch.save(sd, path)
        r = subprocess.run([tool, "forward", "resnet18", path, f"{out}/x.pt", f"{out}/cpp_logits.pt"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            ok = False
            print(json.dumps({"check": f"pytorch->c++ resnet18 logits (saved from {where})", "ok": False,
                              "error": r.stderr.strip()}))
            continue
        got = torch.load(f"{out}/cpp_logits.pt")["logits"]
        d1 = (got - ref).abs().max().item()
        ok &= d1 <= 1e-4
        print(json.dumps({"check": f"pytorch->c++ resnet18 logits (saved from {where})", "max_abs_diff": d1,
                          "ok": d1 <= 1e-4, "loader_report": r.stderr.strip(),
                          "logit_scale": ref.abs().max().item()}))

    # 2. C++ -> PyTorch
    run(tool, "init", "resnet18", "7", f"{out}/ddptrain_resnet18.pt")
    sd = torch.load(f"{out}/ddptrain_resnet18.pt")
    tv2 = torchvision.models.resnet18()
    result = tv2.load_state_dict(sd, strict=True)
    tv2 = tv2.to(dev).eval()
    with torch.no_grad():
        ref2 = tv2(x.to(dev)).cpu()
    run(tool, "forward", "resnet18", f"{out}/ddptrain_resnet18.pt", f"{out}/x.pt", f"{out}/cpp_logits2.pt")
    got2 = torch.load(f"{out}/cpp_logits2.pt")["logits"]
    d2 = (got2 - ref2).abs().max().item()
    ok &= d2 <= 1e-4
    print(json.dumps({"check": "c++->pytorch resnet18 logits", "keys": len(sd), "load_state_dict": str(result),
                      "max_abs_diff": d2, "ok": d2 <= 1e-4}))

    # 3. a trained checkpoint, exported
    if len(sys.argv) > 3:
        run(os.path.join(build, "ddptrain"), "export", sys.argv[3], f"{out}/exported.pt")
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
        m.maxpool = nn.Identity()
        res = m.load_state_dict(torch.load(f"{out}/exported.pt"), strict=True)
        print(json.dumps({"check": "ddptrain export -> torchvision (small stem)", "load_state_dict": str(res),
                          "ok": True}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
