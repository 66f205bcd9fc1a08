"""Writes the reference data that ddptrain's C++ tests compare against.

Run on a machine with PyTorch (and torchvision) installed:
    python3 tools/gen_testdata.py tests/testdata
It produces:
  sampler_vectors.json   indices of torch.utils.data.DistributedSampler
  resnet_keys.json       torchvision ResNet state_dict names and shapes
"""
import json
import sys

import torch
from torch.utils.data.distributed import DistributedSampler


class _Len:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def sampler_vectors():
    cases = []
    for n in (1, 7, 10, 17, 100, 1001):
        for replicas in (1, 2, 3, 4):
            for drop_last in (False, True):
                for shuffle in (True, False):
                    for seed, epoch in ((0, 0), (0, 1), (42, 3)):
                        if not shuffle and (seed, epoch) != (0, 0):
                            continue
                        if drop_last and n < replicas:
                            continue
                        for rank in range(replicas):
                            s = DistributedSampler(_Len(n), num_replicas=replicas, rank=rank,
                                                   shuffle=shuffle, seed=seed, drop_last=drop_last)
                            s.set_epoch(epoch)
                            cases.append(dict(n=n, replicas=replicas, rank=rank, seed=seed, epoch=epoch,
                                              shuffle=shuffle, drop_last=drop_last, indices=list(s)))
    # Fashion-MNIST size: store the full index list for one rank only.
    for rank in range(2):
        s = DistributedSampler(_Len(60000), num_replicas=2, rank=rank, shuffle=True, seed=0)
        s.set_epoch(5)
        cases.append(dict(n=60000, replicas=2, rank=rank, seed=0, epoch=5, shuffle=True,
                          drop_last=False, indices=list(s)))
    return cases


def resnet_keys():
    import torchvision
    out = {}
    for name in ("resnet18", "resnet34", "resnet50"):
        m = getattr(torchvision.models, name)(num_classes=10)
        out[name] = [[k, list(v.shape)] for k, v in m.state_dict().items()]
    return out


if __name__ == "__main__":
    d = sys.argv[1]
    with open(f"{d}/sampler_vectors.json", "w") as f:
        json.dump(dict(torch=torch.__version__, cases=sampler_vectors()), f, separators=(",", ":"))
    with open(f"{d}/resnet_keys.json", "w") as f:
        json.dump(dict(torch=torch.__version__, models=resnet_keys()), f, indent=0)
