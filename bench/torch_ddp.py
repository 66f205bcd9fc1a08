"""Contender (ii): idiomatic PyTorch (Python) DistributedDataParallel.

Run under torchrun (or plainly, as one rank). Two modes:

  step   times the training step on one random on-device batch, like
         `ddptrain bench`: torchvision ResNet, DDP, fused Adam/AdamW,
         autocast bf16 and channels-last when asked, cuDNN autotuning;
         --compile default|reduce-overhead wraps the DDP model in
         torch.compile (Inductor; reduce-overhead adds CUDA graphs) and
         reports the warm-up (compile) time apart from the timed steps.
  fmnist trains ResNet-18 (small stem) on Fashion-MNIST with the recipe of
         `ddptrain --model resnet18` (AdamW, one-cycle, crop+flip) until the
         test accuracy reaches --target; prints the time from process start.

Prints one JSON line per result on rank 0.
"""
import time

T_START = time.time()  # as close to process start as Python allows

import argparse
import gzip
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP


def setup():
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return local


def make_optimizer(name, params, lr, wd):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=wd, fused=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=wd, fused=True)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd, fused=True)


def step_mode(args, local):
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = getattr(torchvision.models, args.model)(num_classes=1000).cuda()
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    model = DDP(model, device_ids=[local])
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr, 0.0)
    compiled = args.compile != "none"
    if compiled:
        model = torch.compile(model, mode=args.compile)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device="cuda").to(memory_format=fmt)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    amp = args.amp == "bf16"

    def step():
        if args.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration for CUDA-graph trees
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_warm = time.perf_counter()
    for _ in range(10):  # cuDNN autotuning; with --compile also the compilation
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    if dist.get_rank() == 0:
        name = "pytorch ddp" + ({"none": "", "default": " + compile",
                                  "reduce-overhead": " + compile (reduce-overhead)"}[args.compile])
        print(json.dumps({"contender": name, "model": args.model, "warmup_s": warmup_s, "image_size": args.image_size,
                          "batch": args.batch, "ranks": dist.get_world_size(), "amp": args.amp,
                          "channels_last": args.channels_last, "ms_per_step": ms,
                          "images_per_s": args.batch * dist.get_world_size() * 1000 / ms,
                          "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
                          "final_loss": loss.item()}), flush=True)


def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(root, prefix):
    def find(name):
        for cand in (name + ".gz", name):
            if os.path.exists(os.path.join(root, cand)):
                return os.path.join(root, cand)
        raise FileNotFoundError(os.path.join(root, name))
    x = torch.from_numpy(read_idx(find(prefix + "-images-idx3-ubyte")).copy())
    y = torch.from_numpy(read_idx(find(prefix + "-labels-idx1-ubyte")).astype(np.int64))
    return x, y


class Images(torch.utils.data.Dataset):
    def __init__(self, x, y, mean, std, train):
        self.x, self.y, self.mean, self.std, self.train = x, y, mean, std, train
        self.aug = torchvision.transforms.Compose([
            torchvision.transforms.RandomCrop(28, padding=2),
            torchvision.transforms.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = (self.x[i].float().div(255).unsqueeze(0) - self.mean) / self.std
        if self.train:
            img = self.aug(img)
        return img, self.y[i]


def small_resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def fmnist_mode(args, local):
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    xtr, ytr = load_split(args.data_root, "train")
    xte, yte = load_split(args.data_root, "t10k")
    mean = xtr.float().div(255).mean().item()
    std = xtr.float().div(255).std().item()
    train = Images(xtr, ytr, mean, std, True)
    test = Images(xte, yte, mean, std, False)
    world, rank = dist.get_world_size(), dist.get_rank()
    sampler = torch.utils.data.distributed.DistributedSampler(train, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                                         pin_memory=True, persistent_workers=True, drop_last=False)
    test_idx = list(range(rank, len(test), world))
    test_loader = torch.utils.data.DataLoader(torch.utils.data.Subset(test, test_idx), batch_size=512,
                                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    model = small_resnet18().cuda().to(memory_format=torch.channels_last)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if world > 1 else model
    model = DDP(model, device_ids=[local])
    opt = make_optimizer("adamw", model.parameters(), args.lr, 0.05)
    steps_per_epoch = len(loader)
    total, warm = steps_per_epoch * args.epochs, round(0.3 * steps_per_epoch)

    def lr_at(step):  # the one-cycle schedule of ddptrain's LrSchedule
        if step < warm:
            start = args.lr / 25
            return start + (args.lr - start) * (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return 0.5 * args.lr * (1 + math.cos(math.pi * min(t, 1.0)))

    amp = args.amp == "bf16"
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x = x.cuda(non_blocking=True).to(memory_format=torch.channels_last)
            y = y.cuda(non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
        model.eval()
        correct = torch.zeros(2, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            for x, y in test_loader:
                x, y = x.cuda(non_blocking=True).to(memory_format=torch.channels_last), y.cuda(non_blocking=True)
                correct[0] += (model(x).argmax(1) == y).sum()
                correct[1] += len(y)
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        if rank == 0:
            print(json.dumps({"contender": "pytorch ddp", "epoch": epoch + 1, "test_acc": acc,
                              "wall_s": time.time() - T_START}), flush=True)
        if acc >= args.target:
            break
    if rank == 0:
        print(json.dumps({"contender": "pytorch ddp", "mode": "fmnist", "reached": acc >= args.target,
                          "epochs": epoch + 1, "test_acc": acc, "wall_s": time.time() - T_START,
                          "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["step", "fmnist"])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--amp", default="off", choices=["off", "bf16"])
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", default="none", choices=["none", "default", "reduce-overhead"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--data-root", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--target", type=float, default=0.93)
    p.add_argument("--workers", type=int, default=6)
    args = p.parse_args()
    local = setup()
    (step_mode if args.mode == "step" else fmnist_mode)(args, local)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
