#!/usr/bin/env python3
"""Writes tests/testdata/ddp_clip_ls/: a short real PyTorch DDP training run
of ddptrain's `--model cnn` on Fashion-MNIST, for
tests/train/pytorch_ddp_test.cpp (issue 44 item 9: clipping and label
smoothing must match torch.nn.utils.clip_grad_norm_ and F.cross_entropy).

    /usr/bin/python3 tools/gen_pytorch_ddp_testdata.py

Needs PyTorch (written with 1.13) and Fashion-MNIST's IDX files in
$DDP_FASHION_MNIST or /usr/share/datasets/fashion-mnist. Runs in about
10 s on 2 CPU cores, and writes the same bytes every time.

The run: DistributedDataParallel over Gloo, 2 CPU processes, on the first
1200 training images (600 a rank: 9 batches of 64 and a partial one of 24,
whose smaller mean changes the gradient's scale), 2 epochs,
DistributedSampler(shuffle=True, seed=0) with set_epoch, SGD lr 0.05 with
no momentum and no weight decay, F.cross_entropy(label_smoothing=0.1),
clip_grad_norm_(0.5) after backward (the gradient's norm is above 0.5 on
every step, so every step is clipped), plain BatchNorm2d (not synchronised;
DDP broadcasts rank 0's buffers), images scaled to 0..1 and normalised with
Fashion-MNIST's mean 0.2860 and std 0.3530, no augmentation. Each rank
runs 1 intra-op thread, as ddptrain's ranks do on a 2-core machine: ATen's
reductions split their work by thread, so other thread counts move the
final weights by about 1e-6 (the test then checks them only to 1e-5).

Files:
  init.pt     torch.save(state_dict) of the initial weights
              (torch.manual_seed(0)), which ddptrain loads with --pretrain
  final.pt    rank 0's state_dict after the 2 epochs, buffers included
  steps.json  the settings, and per optimizer step: the loss averaged over
              the ranks and the gradient's total norm before clipping

ddptrain's equivalent (the test runs this):
  ddptrain --size 2 --backend gloo --pretrain init.pt --dataset fashion-mnist
      --train-samples 1200 --epochs 2 --batch 64 --optimizer sgd --lr 0.05
      --momentum 0 --weight-decay 0 --schedule constant --label-smoothing 0.1
      --clip-grad-norm 0.5 --sync-bn off --channels-last off --augment none
      --workers 0 --sanity-val-steps 0 --seed 0 ...
"""
import gzip
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

WORLD = 2
SAMPLES = 1200
EPOCHS = 2
BATCH = 64
LR = 0.05
CLIP = 0.5
SMOOTHING = 0.1
SEED = 0
MEAN, STD = 0.2860, 0.3530
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "testdata", "ddp_clip_ls")


class Cnn(nn.Module):
    """ddptrain's --model cnn (src/models/cnn.cpp), same names and shapes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def fashion_mnist_root():
    return os.environ.get("DDP_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")


def read_idx(name, offset):
    with gzip.open(os.path.join(fashion_mnist_root(), name)) as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def training_data():
    images = read_idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)[:SAMPLES]
    labels = read_idx("train-labels-idx1-ubyte.gz", 8)[:SAMPLES]
    # As ddptrain's ImageTensorDataset::normalise, op for op: one-channel float tensors, not scalars.
    mean, std = torch.tensor([MEAN]).view(1, 1, 1), torch.tensor([STD]).view(1, 1, 1)
    images = torch.from_numpy(images.copy()).to(torch.float32).div_(255.0).sub_(mean).div_(std)
    return images, torch.from_numpy(labels.astype(np.int64))


def worker(rank, rendezvous, out_dir):
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine, as ddptrain splits them
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    images, labels = training_data()
    net = Cnn()
    net.load_state_dict(torch.load(os.path.join(out_dir, "init.pt")))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0, weight_decay=0)
    sampler = DistributedSampler(range(SAMPLES), num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED)
    steps = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for start in range(0, len(order), BATCH):
            idx = order[start:start + BATCH]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images[idx]), labels[idx], label_smoothing=SMOOTHING)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            mean_loss = loss.detach().to(torch.float64).reshape(1)
            dist.all_reduce(mean_loss)
            steps.append({"epoch": epoch + 1, "batch": len(idx), "loss": mean_loss.item() / WORLD,
                          "grad_norm": norm.item()})
    if rank == 0:
        torch.save(net.state_dict(), os.path.join(out_dir, "final.pt"))
        settings = {"world_size": WORLD, "train_samples": SAMPLES, "epochs": EPOCHS, "batch": BATCH, "lr": LR,
                    "clip_grad_norm": CLIP, "label_smoothing": SMOOTHING, "seed": SEED, "torch": torch.__version__}
        with open(os.path.join(out_dir, "steps.json"), "w") as f:
            lines = ",\n  ".join(json.dumps(s) for s in steps)  # one step a line
            f.write(f'{{"settings": {json.dumps(settings)},\n "steps": [\n  {lines}\n ]}}\n')
    dist.destroy_process_group()


def main():
    if not os.path.exists(os.path.join(fashion_mnist_root(), "train-images-idx3-ubyte.gz")):
        sys.exit(f"no Fashion-MNIST in {fashion_mnist_root()} (set DDP_FASHION_MNIST)")
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(SEED)
    torch.save(Cnn().state_dict(), os.path.join(OUT, "init.pt"))
    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous needs no free port
        mp.spawn(worker, args=("file://" + os.path.join(tmp, "rendezvous"), OUT), nprocs=WORLD)
    for name in sorted(os.listdir(OUT)):
        print(f"{os.path.normpath(os.path.join(OUT, name))}: {os.path.getsize(os.path.join(OUT, name))} bytes")


if __name__ == "__main__":
    main()
