"""Config (e) contender: a nanoGPT-style GPT-2 in PyTorch (Python), with DDP.

The model is written the way nanoGPT writes it, so its state_dict names are
GPT-2's as nanoGPT spells them (transformer.wte.weight, ..., lm_head.weight,
the head tied to the token embedding); ddptrain's --model gpt uses the same
names, so weights move both ways (bench/gpt_interop.py checks that).

  step   times the training step on random token ids, like `ddptrain bench
         --task lm`: GPT-2 124M (--model gpt2), context 1024, bf16 autocast,
         AdamW (fused where available), DDP under torchrun, optionally
         torch.compile (--compile, as nanoGPT's compile=True).
         One JSON line: ms/step, tokens/s, peak memory, MFU.
  train  trains for --steps on train.bin/val.bin (--data-root, nanoGPT's
         uint16 files) on exactly the windows, in the order, that ddptrain
         draws for the same --seed and --train-samples, with its cosine
         schedule, and reports the validation loss after those tokens (the
         quality check beside ddptrain; the initial weights differ). E.g.
           bench/gpt_torch.py train --model gpt2 --data-root DIR --batch 16 --steps 2000 --train-samples 32000
         beside
           ddptrain --task lm --model gpt2 --data_root DIR --size 1 --batch 16 --epochs 1 --train-samples 32000
                    --test-samples 200 --lr 6e-4 --weight-decay 0.1 --amp bf16 --schedule cosine

  torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --batch 16 --steps 50
  torchrun --standalone --nproc-per-node 1 bench/gpt_torch.py step --batch 16 --steps 50 --compile

MFU counts FLOPs as nanoGPT's estimate_mfu does: 6N + 12 L H Q T per token
(N the parameters without the position embedding, Q the head width, T the
context), over the H200's dense bf16 peak of 989 TFLOP/s (--peak-tflops).

The module also runs on CPU PyTorch 1.13 (no scaled_dot_product_attention
there: attention is written out), which is how the reference values of
ddptrain's CPU tests are made (tests/testdata/make_gpt_reference.py).
"""
import argparse
import gc
import json
import math
import os
import sys
import time

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F


# ---- the model ------------------------------------------------------------------


class GPTConfig:
    def __init__(self, n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, dropout=0.0, bias=True,
                 gelu="none", checkpoint=False):
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.block_size, self.vocab_size = block_size, vocab_size
        self.dropout, self.bias = dropout, bias
        self.gelu = gelu  # F.gelu's approximate: "none" (nanoGPT's nn.GELU) or "tanh" (GPT-2's own)
        self.checkpoint = checkpoint  # each block under torch.utils.checkpoint


class LayerNorm(nn.Module):
    """LayerNorm whose bias may be absent (nn.LayerNorm has both or neither)."""

    def __init__(self, width, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


def causal_attention(q, k, v, dropout_p):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return weights @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        heads = lambda m: m.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = causal_attention(heads(q), heads(k), heads(v), self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.gelu = cfg.gelu

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.gelu)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(cfg.n_embd, cfg.bias), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = LayerNorm(cfg.n_embd, cfg.bias), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())  # parameters() lists the tied weight once
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.cfg.checkpoint and self.training and torch.is_grad_enabled():
                # torch.utils.checkpoint per block, as ddptrain's --recompute blocks
                # (non-reentrant where this PyTorch has it, as recommended).
                kw = {"use_reentrant": False} if "use_reentrant" in torch.utils.checkpoint.checkpoint.__code__.co_varnames else {}
                x = torch.utils.checkpoint.checkpoint(block, x, **kw)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def flops_per_token(self):
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block_size


PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50304),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
    "gpt-nano": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256),
}


# ---- ddptrain's training windows (src/data/tokens.cpp, data/counter_rng.h) ----------------

_M64 = (1 << 64) - 1


def _mix64(x):
    """splitmix64's finaliser, as ddptrain's mix64()."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def ddptrain_window_start(seed, epoch, index, starts):
    """Where ddptrain's training window `index` of `epoch` (0-based) starts."""
    h = 0x6A09E667F3BCC909
    for w in (seed, epoch, index, 0x6C6D):
        h = _mix64(h ^ _mix64(w & _M64))
    return _mix64(h) % starts


# ---- the benchmark ---------------------------------------------------------------------


def setup_ddp():
    if "RANK" not in os.environ:
        return 0, 1, 0
    import torch.distributed as dist
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local


def make_optimizer(model, lr, weight_decay):
    # nanoGPT's grouping: weight decay on matrices and embeddings only.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = torch.cuda.is_available() and "fused" in torch.optim.AdamW.__init__.__code__.co_varnames
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **extra), fused


def contender_name(args):
    """"pytorch eager" or "pytorch compile" (the default mode; other modes
    named), plus ", tanh GELU" for GPT-2's GELU."""
    name = "pytorch eager" if not args.compile else "pytorch compile" + (
        "" if args.compile == "default" else " " + args.compile)
    return name + (", tanh GELU" if args.gelu == "tanh" else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["step", "train"])
    ap.add_argument("--model", default="gpt2", choices=sorted(PRESETS))
    ap.add_argument("--context", type=int, default=0, help="0: the preset's")
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--amp", default="bf16", choices=["bf16", "off"])
    ap.add_argument("--compile", nargs="?", const="default", default="",
                    choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"],
                    help="torch.compile the model, as nanoGPT does (--compile alone: the default mode; "
                         "reduce-overhead adds CUDA graphs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--largest-batch", action="store_true",
                    help="step, one GPU: first find the largest --batch that fits (doubling from --batch, then bisecting, in this process; a line per try), then time it")
    ap.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing: each block under torch.utils.checkpoint (ddptrain's --recompute blocks)")
    ap.add_argument("--gelu", default="exact", choices=["exact", "tanh"],
                    help="the MLP's GELU: exact (nanoGPT's nn.GELU) or tanh (GPT-2's; ddptrain's --gelu tanh)")
    ap.add_argument("--profile-trace", default="", help="step: then profile --steps more steps (torch.profiler) into this Chrome trace")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H200: 989)")
    ap.add_argument("--data-root", default="", help="train: directory with train.bin and val.bin (uint16)")
    ap.add_argument("--eval-windows", type=int, default=200, help="train: validation windows (ddptrain's --test-samples)")
    ap.add_argument("--train-samples", type=int, default=0,
                    help="train: windows per epoch, as ddptrain's --train-samples (0: training tokens / context)")
    args = ap.parse_args()

    rank, world, local = setup_ddp()
    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    preset = dict(PRESETS[args.model])
    if args.context:
        preset["block_size"] = args.context
    cfg = GPTConfig(**preset, gelu="tanh" if args.gelu == "tanh" else "none", checkpoint=args.checkpoint)
    model = GPT(cfg).to(dev)
    raw = model
    opt, fused = make_optimizer(model, args.lr, args.weight_decay)
    if args.compile:
        if not hasattr(torch, "compile"):
            sys.exit(f"gpt_torch.py: --compile needs PyTorch 2.x, this is {torch.__version__}. Hint: leave --compile out")
        model = torch.compile(model, mode=args.compile)
    graphs = args.compile in ("reduce-overhead", "max-autotune")  # CUDA-graph trees: mark each new step
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[local])
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    t = cfg.block_size

    def train_on(x, y):  # one training step; the loss
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if args.mode == "step":
        def measure(batch, warmup, steps, profile):
            g = torch.Generator(device=dev).manual_seed(args.seed + rank)
            x = torch.randint(0, cfg.vocab_size, (batch, t), device=dev, generator=g)
            y = torch.randint(0, cfg.vocab_size, (batch, t), device=dev, generator=g)

            def step():
                return train_on(x, y)

            for _ in range(warmup):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
            for _ in range(steps):
                loss = step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ms = 1000 * (time.time() - t0) / steps
            if profile:  # bench/kernel_breakdown.py reads it
                from torch.profiler import ProfilerActivity, profile as kineto
                with kineto(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        step()
                    torch.cuda.synchronize()
                if rank == 0:
                    prof.export_chrome_trace(args.profile_trace)
            tokens_rank_s = batch * t * 1000 / ms
            return {
                "contender": contender_name(args) + (", checkpoint" if args.checkpoint else ""),
                "recompute": "blocks" if args.checkpoint else "none",
                "gelu": args.gelu, "model": args.model, "params": raw.num_params(non_embedding=False), "context": t,
                "batch": batch, "ranks": world, "optimizer": "adamw" + (" fused" if fused else ""),
                "amp": args.amp, "device": str(dev), "torch": torch.__version__,
                "ms_per_step": ms, "tokens_per_s": tokens_rank_s * world,
                "flops_per_token": raw.flops_per_token(), "peak_tflops": args.peak_tflops,
                "mfu": tokens_rank_s * raw.flops_per_token() / (args.peak_tflops * 1e12),
                "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else 0.0,
                "final_loss": loss.item()}

        def emit(line):
            if rank == 0:
                print(json.dumps(line), flush=True)

        if not args.largest_batch:
            emit(measure(args.batch, args.warmup, args.steps, bool(args.profile_trace)))
            return
        # As `ddptrain bench --largest-batch`: from --batch, doubling until a
        # step runs out of memory, then bisecting, in this process; a line
        # per try, then the largest batch timed over --steps. Under
        # torch.compile the second batch size makes the batch dimension
        # dynamic (dynamo's automatic dynamic shapes), so later tries do not
        # compile again.
        if dev.type != "cuda" or world != 1:
            sys.exit("gpt_torch.py: --largest-batch searches one GPU's memory. Hint: run it on a GPU with --nproc-per-node 1")

        def fits(batch):
            torch.cuda.reset_peak_memory_stats()
            oom = None
            try:
                line = dict(measure(batch, 2, 2, False), fits=True)
            except torch.cuda.OutOfMemoryError as e:
                oom = str(e).splitlines()[0]
            except RuntimeError as e:  # cuBLAS failing to allocate its workspace, as ddptrain counts it
                if "CUBLAS_STATUS_ALLOC_FAILED" not in str(e):
                    raise
                oom = str(e).splitlines()[0]
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            if oom is not None:
                line = {"batch": batch, "fits": False, "reason": oom}
            emit(line)
            return line["fits"]

        lo, hi = 0, args.batch
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        if lo == 0:
            sys.exit("gpt_torch.py: not even a batch of 1 fits. Hint: --checkpoint, or a smaller --model")
        torch.cuda.reset_peak_memory_stats()
        emit(dict(measure(lo, args.warmup, args.steps, bool(args.profile_trace)), largest=True))
        return

    # train: ddptrain's windows of train.bin (same seed, same samples, same
    # order), then the loss on the first --eval-windows windows of val.bin
    # tiled without overlap (ddptrain's --test-samples).
    import numpy as np
    train = np.memmap(os.path.join(args.data_root, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(args.data_root, "val.bin"), dtype=np.uint16, mode="r")
    windows = args.train_samples or len(train) // t
    steps_per_epoch = windows // (args.batch * world)
    assert windows % world == 0 and steps_per_epoch > 0, "--train-samples must fill whole steps on every rank"

    def batch_of(data, starts):
        x = torch.from_numpy(np.stack([data[s:s + t].astype(np.int64) for s in starts]))
        y = torch.from_numpy(np.stack([data[s + 1:s + 1 + t].astype(np.int64) for s in starts]))
        return x.to(dev), y.to(dev)

    t0 = time.time()
    for it in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * it / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        epoch, k = divmod(it, steps_per_epoch)
        g = torch.Generator()
        g.manual_seed(args.seed + epoch)  # DistributedSampler's order, as ddptrain's
        mine = torch.randperm(windows, generator=g)[rank::world][k * args.batch:(k + 1) * args.batch]
        x, y = batch_of(train, [ddptrain_window_start(args.seed, epoch, int(i), len(train) - t) for i in mine])
        train_on(x, y)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(rank, args.eval_windows, world):
            x, y = batch_of(val, [i * t])
            with amp:
                _, loss = model(x, y)
            total, count = total + loss.item() * t, count + t
    if world > 1:
        import torch.distributed as dist
        sums = torch.tensor([total, count], dtype=torch.float64, device=dev)
        dist.all_reduce(sums)
        total, count = sums.tolist()
    if rank == 0:
        print(json.dumps({"contender": contender_name(args), "mode": "train",
                          "steps": args.steps, "tokens": args.steps * args.batch * t * world,
                          "val_loss": total / max(count, 1), "seconds": time.time() - t0}), flush=True)


if __name__ == "__main__":
    main()
