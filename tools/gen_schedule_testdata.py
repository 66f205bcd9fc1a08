#!/usr/bin/env python3
"""Writes tests/testdata/schedules.json: per-step learning rates from
torch.optim.lr_scheduler for each ddptrain --schedule, with and without
--warmup-epochs, that tests/train/lr_schedule_test.cpp compares against.

    /usr/bin/python3 tools/gen_schedule_testdata.py

What ddptrain's schedules are in PyTorch's terms (S steps, W warm-up steps):
  warm-up (W > 0)  LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1)
  constant         nothing after the warm-up
  step             MultiStepLR(milestones=[ceil((S-W)/2), ceil(3(S-W)/4)], gamma=0.1)
  cosine           CosineAnnealingLR(T_max=S-W)
  onecycle         OneCycleLR(max_lr, total_steps=S, pct_start=W/S if W else 0.3)
                   with its other defaults; it has its own warm-up
The lr of step s is the one in force for the s-th optimizer.step() (0-based).
"""
import json
import math
import os

import torch
from torch.optim import lr_scheduler as sched


def lrs(schedule, peak, total, warmup):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak, momentum=0.9)
    if schedule == "onecycle":
        pct = warmup / total if warmup else 0.3
        s = sched.OneCycleLR(opt, max_lr=peak, total_steps=total, pct_start=pct)
    else:
        rest = total - warmup
        if schedule == "constant":
            after = None
        elif schedule == "step":
            after = sched.MultiStepLR(opt, milestones=[math.ceil(rest / 2), math.ceil(3 * rest / 4)], gamma=0.1)
        elif schedule == "cosine":
            after = sched.CosineAnnealingLR(opt, T_max=rest)
        if warmup:
            warm = sched.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
            s = warm if after is None else sched.SequentialLR(opt, [warm, after], milestones=[warmup])
        else:
            s = after
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if s is not None:
            s.step()
    return out


CASES = [  # schedule, peak lr, total steps, warm-up steps
    ("constant", 0.1, 50, 0),
    ("constant", 0.1, 50, 10),
    ("step", 0.3, 40, 0),
    ("step", 0.3, 43, 7),
    ("cosine", 2e-3, 60, 0),
    ("cosine", 2e-3, 60, 12),
    ("cosine", 1.0, 937, 281),
    ("onecycle", 2e-3, 100, 0),
    ("onecycle", 2e-3, 77, 0),
    ("onecycle", 0.1, 100, 10),
    ("onecycle", 2e-3, 2814, 0),  # the bare run: 3 epochs of 938 steps
]


def main():
    cases = [dict(schedule=k, peak_lr=p, total_steps=s, warmup_steps=w, lrs=lrs(k, p, s, w)) for k, p, s, w in CASES]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "testdata", "schedules.json")
    with open(path, "w") as f:
        json.dump(dict(generator="tools/gen_schedule_testdata.py", torch=torch.__version__, cases=cases), f)
        f.write("\n")
    print(f"wrote {os.path.normpath(path)}: {len(cases)} cases, torch {torch.__version__}")


if __name__ == "__main__":
    main()
