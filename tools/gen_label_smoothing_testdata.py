#!/usr/bin/env python3
"""Writes tests/testdata/label_smoothing.pt: F.cross_entropy with
label_smoothing on random logits, its loss and its gradient over the logits,
for Loss.LabelSmoothingIsPyTorchsToTheBit (tests/train/loss_test.cpp).

    /usr/bin/python3 tools/gen_label_smoothing_testdata.py

Batch sizes that are not powers of two (an epoch's last batch) are where a
smoothing term summed in another order rounds otherwise, so they are here
beside 1 and 64.

The file is a torch.save'd dict (read by ddptrain's own reader), per case i:
  logits.<i>, target.<i>   the inputs (fp32 [B, K], int64 [B])
  eps.<i>                  the smoothing (a 0-d double)
  loss.<i>, grad.<i>       F.cross_entropy(logits, target, label_smoothing=eps)
                           and its gradient over the logits
"""
import os
import sys

import torch
import torch.nn.functional as F


def main():
    torch.manual_seed(5)
    out = {}
    i = 0
    for batch in (1, 7, 48, 64, 100):
        for classes in (3, 10):
            for eps in (0.05, 0.1, 0.2):
                logits = (torch.randn(batch, classes) * 3).requires_grad_()
                target = torch.randint(0, classes, (batch,))
                loss = F.cross_entropy(logits, target, label_smoothing=eps)
                loss.backward()
                out[f"logits.{i}"] = logits.detach().clone()
                out[f"target.{i}"] = target
                out[f"eps.{i}"] = torch.tensor(eps, dtype=torch.float64)
                out[f"loss.{i}"] = loss.detach().clone()
                out[f"grad.{i}"] = logits.grad.clone()
                i += 1
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "testdata", "label_smoothing.pt")
    if len(sys.argv) > 1:
        path = sys.argv[1]
    torch.save(out, path, _use_new_zipfile_serialization=True)
    print(f"wrote {i} cases to {path} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
