"""Writes tests/testdata/tiny_state_dict.pt: a state_dict saved by PyTorch
(Python) with torch.save, with DDP's "module." prefix, plus the model's
output on a fixed input (tiny_state_dict_expected.json). The C++ test loads
the file into the same architecture built with ddptrain and compares.
    python3 tools/gen_pytorch_weights.py tests/testdata
"""
import json
import sys

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(64, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.nn.functional.avg_pool2d(x, 2).flatten(1))


torch.manual_seed(0)
m = Tiny()
with torch.no_grad():  # non-trivial running statistics
    m.bn.running_mean.uniform_(-1, 1)
    m.bn.running_var.uniform_(0.5, 2)
    m.bn.num_batches_tracked.fill_(7)
m.eval()
x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) / 100.0
y = m(x)
out = sys.argv[1]
torch.save({"module." + k: v for k, v in m.state_dict().items()}, f"{out}/tiny_state_dict.pt")
json.dump({"torch": torch.__version__, "output": y.flatten().tolist()}, open(f"{out}/tiny_state_dict_expected.json", "w"))
