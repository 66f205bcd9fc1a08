#!/usr/bin/env python3
"""Writes tests/testdata/clip_grad_norm.pt: what torch.nn.utils.clip_grad_norm_
does to a small CNN's gradients, for the clipping tests in
tests/train/flat_optimizer_test.cpp.

    /usr/bin/python3 tools/gen_clip_grad_norm_testdata.py

The CNN (a bias-free convolution, batch norm, two Linear layers: 33,570
parameters in tensors from 8 to 32,768 elements) trains for STEPS steps of
plain SGD (lr 0.05, no momentum) on fixed random batches, with
clip_grad_norm_(model.parameters(), MAX_NORM) before each step. Its
gradients span a few orders of magnitude, which is what makes the order of
summation of the norm show: clip_grad_norm_ takes each tensor's norm, then
the norm of those, and PyTorch 1.13's CPU norm of one long tensor rounds
differently from that.

The file is a torch.save'd dict (read by ddptrain's own reader):
  initial.<name>        the parameters before the first step
  x.<s>, y.<s>          step s's batch
  grad.<s>.<name>       step s's gradients, before clipping
  total_norm, coef      per step: clip_grad_norm_'s total norm, and its
                        coefficient min(1, max_norm / (total_norm + 1e-6))
                        computed as clip_grad_norm_ computes it
  loss                  per step
  final.<name>          the parameters after the last step
  max_norm              MAX_NORM
"""
import collections
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS, BATCH, SIDE, WIDTH = 4, 16, 16, 64
MAX_NORM, LR = 0.5, 0.05


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * (SIDE // 2) ** 2, WIDTH)
        self.fc2 = nn.Linear(WIDTH, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "testdata", "clip_grad_norm.pt")
    torch.set_num_threads(1)
    torch.manual_seed(5)
    net = Net()
    out = collections.OrderedDict()
    for name, p in net.named_parameters():
        out["initial." + name] = p.detach().clone()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0)
    g = torch.Generator().manual_seed(11)
    norms, coefs, losses = [], [], []
    for s in range(STEPS):
        x = torch.randn(BATCH, 1, SIDE, SIDE, generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        out["x.%d" % s], out["y.%d" % s] = x, y
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        for name, p in net.named_parameters():
            out["grad.%d.%s" % (s, name)] = p.grad.detach().clone()
        total = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        # clip_grad_norm_'s own coefficient, spelled as it spells it (the
        # reflected division is reciprocal() * max_norm in PyTorch 1.13).
        coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
        norms.append(total.reshape(1))
        coefs.append(coef.reshape(1))
        losses.append(loss.detach().reshape(1))
        opt.step()
    out["total_norm"] = torch.cat(norms)
    out["coef"] = torch.cat(coefs)
    out["loss"] = torch.cat(losses)
    for name, p in net.named_parameters():
        out["final." + name] = p.detach().clone()
    out["max_norm"] = torch.tensor(MAX_NORM)
    torch.save(out, out_path)
    print("torch", torch.__version__, "total norms", out["total_norm"].tolist())


if __name__ == "__main__":
    main()
