#!/usr/bin/env python3
"""Config (f), PyTorch's side: ResNet-50 trained from a JPEG folder, timed
from files to weights (one rank of DDP, bf16 autocast, channels-last, Adam
lr 1e-4, batch 256, 224-px random-resized crops and flips, ImageNet
normalisation), each data path after the same compiled model:

  resident   one batch already on the GPU: the step's own rate
  dataloader torchvision ImageFolder (PIL decode, RandomResizedCrop, flip,
             ToTensor, Normalize) in a DataLoader, --workers processes,
             pinned memory, persistent workers
  nvjpeg     DataLoader workers read the files' bytes; the main process
             decodes the batch with torchvision.io.decode_jpeg on the GPU
             (nvJPEG) and crops, resizes and flips each image there
             (torchvision.transforms.v2.functional)

One JSON line per path: img/s, ms per step, the share of the time spent
waiting for data (host time blocked on the loader), peak memory.

  torchrun --standalone --nproc-per-node 1 bench/e2e_torch.py DIR --compile reduce-overhead --steps 60
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import transforms
from torchvision.transforms.v2 import functional as TF

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class FileBytes(torchvision.datasets.ImageFolder):
    """ImageFolder whose samples are the files' bytes (decoded later on the GPU).
    NumPy arrays travel from the workers pickled by value; 256 tensors a
    batch would each pass a file descriptor, and run out of them."""

    def __getitem__(self, i):
        path, label = self.samples[i]
        return np.fromfile(path, dtype=np.uint8), label


def keep_lists(batch):
    return [torch.from_numpy(b) for b, _ in batch], torch.tensor([l for _, l in batch])


def crop_params(h, w, rng):
    """torchvision's RandomResizedCrop.get_params (scale 0.08-1, ratio 3/4-4/3)."""
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < 3 / 4:
        cw, ch = w, int(round(w / (3 / 4)))
    elif in_ratio > 4 / 3:
        ch, cw = h, int(round(h * (4 / 3)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--compile", default="reduce-overhead", choices=["none", "default", "reduce-overhead"])
    p.add_argument("--paths", default="resident,dataloader,nvjpeg")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=8)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                            device_id=torch.device("cuda", local))
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    if a.compile != "none":
        model = torch.compile(model, mode=a.compile)

    def step(x, y):
        if a.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255
    rng = random.Random(0)

    def gpu_batch(files):
        images = torchvision.io.decode_jpeg(files, mode=torchvision.io.ImageReadMode.RGB, device="cuda")
        out = []
        for img in images:
            top, left, h, w = crop_params(img.shape[1], img.shape[2], rng)
            img = TF.resized_crop(img, top, left, h, w, [224, 224], antialias=True)
            out.append(TF.horizontal_flip(img) if rng.random() < 0.5 else img)
        x = (torch.stack(out).float() - mean) / std
        return x.contiguous(memory_format=torch.channels_last)

    def timed(name, batches):
        it = iter(batches)
        t_warm = time.perf_counter()
        for _ in range(a.warmup):
            step(*next(it))
        torch.cuda.synchronize()
        warm = time.perf_counter() - t_warm
        torch.cuda.reset_peak_memory_stats()
        wait = 0.0
        t0 = time.perf_counter()
        for _ in range(a.steps):
            tw = time.perf_counter()
            x, y = next(it)
            wait += time.perf_counter() - tw
            step(x, y)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        print(json.dumps({"config": "f", "contender": f"pytorch {name}, compile {a.compile}", "batch": a.batch,
                          "steps": a.steps, "images_per_s": a.batch * a.steps / s, "ms_per_step": 1000 * s / a.steps,
                          "data_wait": wait / s, "warmup_s": warm, "workers": a.workers,
                          "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20}), flush=True)

    total = a.warmup + a.steps
    for path in a.paths.split(","):
        if path == "resident":
            x = torch.randn(a.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (a.batch,), device="cuda")
            timed("resident batch", ((x, y) for _ in range(total)))
        elif path == "dataloader":
            tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                     transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
            ds = torchvision.datasets.ImageFolder(a.root, tf)
            dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                             pin_memory=True, drop_last=True, persistent_workers=True,
                                             prefetch_factor=4)

            def cpu_batches():
                while True:
                    for x, y in dl:
                        yield (x.cuda(non_blocking=True).contiguous(memory_format=torch.channels_last),
                               y.cuda(non_blocking=True))
            timed(f"DataLoader (PIL, {a.workers} workers)", cpu_batches())
        elif path == "nvjpeg":
            ds = FileBytes(a.root)
            dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                             collate_fn=keep_lists, drop_last=True, persistent_workers=True,
                                             prefetch_factor=4)

            def gpu_batches():
                while True:
                    for files, y in dl:
                        yield gpu_batch(files), y.cuda(non_blocking=True)
            timed("decode_jpeg on the GPU (nvJPEG)", gpu_batches())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
