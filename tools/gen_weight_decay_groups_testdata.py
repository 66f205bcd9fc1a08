#!/usr/bin/env python3
"""Writes tests/testdata/weight_decay_groups.json: what torch.optim does with
nanoGPT's two parameter groups, for tests/train/weight_decay_groups_test.cpp.

    /usr/bin/python3 tools/gen_weight_decay_groups_testdata.py

nanoGPT's configure_optimizers (and bench/gpt_torch.py's make_optimizer)
puts the parameters of 2 or more dimensions (matrices, embeddings) in a
group with weight decay and the rest (biases, LayerNorm weights) in a group
with weight decay 0. The model has an embedding, a LayerNorm, two Linear
layers, and a side Linear layer used on some steps only, so that parameters
of both groups also miss steps (zero_grad(set_to_none=True): torch.optim
skips them, and Adam's per-parameter step count does not advance).

For each optimizer it records the parameters after STEPS steps on fixed
batches three times: with the two groups ("two_groups"), with one group that
decays everything ("one_group", torch.optim's default and ddptrain's for
the image tasks), and with the embedding moved to the group without decay
("matrices_only", what ddp::decay_matrices_only sets).
"""
import json
import os
import sys

import torch
import torch.nn as nn

STEPS = 6
VOCAB, WIDTH, HIDDEN, BATCH, CONTEXT = 11, 6, 5, 3, 4
SIDE_STEPS = [0, 2, 3]  # the side layer misses steps 1, 4 and 5
OPTIMIZERS = {
    "sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.1),
    "adam": dict(lr=0.01, weight_decay=0.1),
    "adamw": dict(lr=0.01, betas=[0.9, 0.95], weight_decay=0.1),  # LmTask's betas
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.side = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, use_side):
        h = self.ln(self.emb(idx))
        y = self.head(torch.tanh(self.fc(h)))
        if use_side:
            y = y + self.side(h)
        return y


def initial():
    torch.manual_seed(3)
    net = Net()
    with torch.no_grad():  # LayerNorm starts at 1 and 0: move it off, so decay shows
        net.ln.weight.add_(torch.rand(WIDTH))
        net.ln.bias.add_(torch.rand(WIDTH))
    return net.state_dict()


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g),
             torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)) for _ in range(STEPS)]


def make_optimizer(name, model, groups):
    kw = dict(OPTIMIZERS[name])
    wd = kw.pop("weight_decay")
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    params = list(model.parameters())
    if groups == "two_groups":
        param_groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    elif groups == "matrices_only":  # timm's rule with the embedding exempt too (ddp::decay_matrices_only)
        exempt = {id(model.emb.weight)}
        param_groups = [{"params": [p for p in params if p.dim() >= 2 and id(p) not in exempt], "weight_decay": wd},
                        {"params": [p for p in params if p.dim() < 2 or id(p) in exempt], "weight_decay": 0.0}]
    else:
        param_groups = [{"params": params, "weight_decay": wd}]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return cls(param_groups, **kw)


def train(name, groups):
    net = Net()
    net.load_state_dict(initial())
    opt = make_optimizer(name, net, groups)
    for s, (x, t) in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        y = net(x, s in SIDE_STEPS)
        nn.functional.cross_entropy(y.reshape(-1, VOCAB), t.reshape(-1)).backward()
        opt.step()
    return {k: v.detach().flatten().tolist() for k, v in net.state_dict().items()}


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "testdata", "weight_decay_groups.json")
    data = {
        "torch": torch.__version__,
        "steps": STEPS,
        "sizes": {"vocab": VOCAB, "width": WIDTH, "hidden": HIDDEN, "batch": BATCH, "context": CONTEXT},
        "side_steps": SIDE_STEPS,
        "optimizers": OPTIMIZERS,
        "initial": {k: v.flatten().tolist() for k, v in initial().items()},
        "batches": [[x.flatten().tolist(), t.flatten().tolist()] for x, t in batches()],
    }
    for groups in ("two_groups", "one_group", "matrices_only"):
        data[groups] = {name: train(name, groups) for name in OPTIMIZERS}
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
