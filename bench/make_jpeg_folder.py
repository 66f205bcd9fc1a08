#!/usr/bin/env python3
"""An ImageNet-like JPEG folder for config (f): N files in C class folders,
500 x 375 (a quarter of them 375 x 500, portrait), quality 90, with
photo-like content (smooth colour fields, edges and fine texture): about
100 KB a file, near ImageNet's ~110 KB average, so JPEG has real work.
Deterministic for a --seed.

  python3 bench/make_jpeg_folder.py OUT --files 20000 --classes 100 [--procs 16]
"""
import argparse
import multiprocessing as mp
import os

import numpy as np
from PIL import Image


def make(args):
    out, i, classes, seed = args
    rng = np.random.default_rng(seed * 1_000_003 + i)
    h, w = (375, 500) if i % 4 else (500, 375)
    # Smooth colour field: low-resolution noise, upsampled bilinearly.
    low = rng.uniform(0, 255, size=(8, 10, 3)).astype(np.float32)
    field = np.asarray(Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BILINEAR), dtype=np.float32)
    # A few hard edges (shapes), and sensor-like texture.
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(4):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(20, 150)
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
        field[mask] = field[mask] * 0.4 + rng.uniform(0, 255, size=3) * 0.6
    field += rng.normal(0, 20, size=field.shape)
    img = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))
    path = os.path.join(out, f"class{i % classes:03d}", f"img{i:06d}.jpg")
    img.save(path, quality=90)
    return os.path.getsize(path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--procs", type=int, default=os.cpu_count())
    a = p.parse_args()
    for c in range(a.classes):
        os.makedirs(os.path.join(a.out, f"class{c:03d}"), exist_ok=True)
    with mp.Pool(a.procs) as pool:
        sizes = pool.map(make, [(a.out, i, a.classes, a.seed) for i in range(a.files)], chunksize=64)
    print(f"{a.files} files in {a.classes} classes under {a.out}: mean {np.mean(sizes) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
