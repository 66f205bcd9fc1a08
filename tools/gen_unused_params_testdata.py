#!/usr/bin/env python3
"""Writes tests/testdata/unused_params.json: what PyTorch does to parameters
that get no gradient in some steps, for tests/train/unused_params_test.cpp.

    /usr/bin/python3 tools/gen_unused_params_testdata.py

The model is a trunk (fc0), a head, a branch used only on some steps, and a
late layer first used at step 3. Training runs for 8 steps with
zero_grad(set_to_none=True) (PyTorch 2.x's default), so a parameter that got
no gradient has .grad None and torch.optim skips it: no weight decay, no
momentum or moment update, and for Adam its own step count (bias
correction) does not advance.

Two worlds:
  world 1  one process, rank 0's batches and branch usage
  world 2  real DistributedDataParallel(find_unused_parameters=True) over
           Gloo, two processes; each rank uses the branch on its own steps,
           so on some steps it is used on one rank only (its averaged
           gradient is half that rank's, and it is stepped) and on step 2 on
           neither (it is skipped).
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

STEPS = 8
# Per rank: the steps on which the branch and the late layer are used.
BRANCH = {0: [0, 1, 3, 4, 6], 1: [1, 5, 6]}
LATE = {0: [3, 4, 7], 1: [5]}
OPTIMIZERS = {
    "sgd": dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": dict(lr=0.05, weight_decay=1e-2),
    "adamw": dict(lr=0.05, weight_decay=0.1),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.branch = nn.Linear(4, 2)
        self.late = nn.Linear(4, 2)

    def forward(self, x, use_branch, use_late):
        h = torch.tanh(self.fc0(x))
        y = self.head(h)
        if use_branch:
            y = y + self.branch(h)
        if use_late:
            y = y + self.late(h)
        return y


def initial():
    torch.manual_seed(11)
    return Net().state_dict()


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(STEPS)]


def make_optimizer(name, params):
    kw = OPTIMIZERS[name]
    if name == "sgd":
        return torch.optim.SGD(params, **kw)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, **kw)


def train(name, rank, model, forward):
    opt = make_optimizer(name, model.parameters())
    for s, (x, t) in enumerate(batches(rank)):
        opt.zero_grad(set_to_none=True)
        y = forward(x, s in BRANCH[rank], s in LATE[rank])
        nn.functional.mse_loss(y, t).backward()
        opt.step()
    return {k: v.detach().flatten().tolist() for k, v in model.state_dict().items()}


def ddp_worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    results = {}
    for name in OPTIMIZERS:
        net = Net()
        net.load_state_dict(initial())
        model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
        results[name] = train(name, rank, net, lambda x, b, l: model(x, b, l))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "testdata", "unused_params.json")
    data = {
        "torch": torch.__version__,
        "steps": STEPS,
        "branch_steps": [BRANCH[0], BRANCH[1]],
        "late_steps": [LATE[0], LATE[1]],
        "optimizers": OPTIMIZERS,
        "initial": {k: v.flatten().tolist() for k, v in initial().items()},
        "batches": [[[x.flatten().tolist(), t.flatten().tolist()] for x, t in batches(r)] for r in range(2)],
        "world1": {},
    }
    for name in OPTIMIZERS:
        net = Net()
        net.load_state_dict(initial())
        data["world1"][name] = train(name, 0, net, net)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "world2.json")
        mp.spawn(ddp_worker, args=(os.path.join(d, "init"), out), nprocs=2)
        with open(out) as f:
            data["world2"] = json.load(f)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
