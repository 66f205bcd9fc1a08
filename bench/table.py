"""Markdown table of bench/run.sh results: ms/step, images/s, peak memory and
the ratio to the fastest PyTorch contender of the same config (eager DDP or
DDP under torch.compile, whichever is fastest in that run); compile warm-up
is listed apart."""
import json
import sys

CONFIGS = {
    "a": "(a) ResNet-18, 64 px, batch 32, Adam, fp32",
    "b": "(b) ResNet-18, 64 px, batch 256, bf16",
    "c": "(c) ResNet-50, 224 px, batch 256, bf16, channels-last",
    "d": "(d) Fashion-MNIST, ResNet-18 small stem, launch to 93%",
}
PYTORCH = ["pytorch ddp", "pytorch ddp + compile", "pytorch ddp + compile (reduce-overhead)"]
ORDER = ["seed (betas fixed)"] + PYTORCH + ["ddptrain eager", "ddptrain cuda-graph"]


def ordered(group, first):
    """The contenders of `group`: those named in `first`, in that order, then
    every other one in the order it was measured (a variant such as
    "ddptrain cuda-graph, LibTorch BN and max pool" is listed, never dropped)."""
    return [n for n in first if n in group] + [n for n in group if n not in first]


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip().startswith("{")]
    print("| config | contender | ms/step | images/s | peak GPU MiB | warm-up s | vs PyTorch's best |")
    print("|---|---|---|---|---|---|---|")
    for key, title in CONFIGS.items():
        group = {r["contender"]: r for r in rows if r.get("config") == key}
        torch_rows = [group[n] for n in PYTORCH if n in group]
        if key == "d":
            ref = group.get("pytorch ddp")
        else:
            ref = max(torch_rows, key=lambda r: r["images_per_s"]) if torch_rows else None
        for name in ordered(group, ORDER):
            r = group[name]
            if key == "d":
                wall = r["wall_s"]
                ratio = f"{wall / ref['wall_s']:.2f}x wall" if ref else ""
                note = f"{wall:.1f} s wall, {r.get('epochs', '?')} epochs, {100 * r.get('test_acc', 0):.2f}%"
                if not r.get("reached", False):
                    note += " (did not reach 93%)"
                print(f"| {title} | {name} | {note} | | {r.get('peak_mem_mib', 0):.0f} | | {ratio} |")
                continue
            ratio = f"{r['images_per_s'] / ref['images_per_s']:.2f}x" if ref else ""
            if r is ref:
                ratio += " (the best)"
            warm = f"{r['warmup_s']:.1f}" if "warmup_s" in r else ""
            print(f"| {title} | {name} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
                  f"{r.get('peak_mem_mib', 0):.0f} | {warm} | {ratio} |")
    gpt_table(rows)


GPT_ORDER = ["pytorch eager", "pytorch compile", "ddptrain eager", "ddptrain cuda-graph"]


def gpt_table(rows):
    """Config (e), GPT-2 124M: tokens/s and MFU, and the ratio to PyTorch's
    fastest contender (eager or any compile mode) with the same GELU (rows
    without a "gelu" field are the exact one's)."""
    group = {r["contender"]: r for r in rows if r.get("config") == "e"}
    if not group:
        return
    refs = {}
    for r in group.values():
        gelu = r.get("gelu", "exact")
        if r["contender"].startswith("pytorch") and r["tokens_per_s"] > refs.get(gelu, {}).get("tokens_per_s", 0):
            refs[gelu] = r
    print()
    print("| (e) GPT-2 124M, context 1024, bf16, AdamW | ms/step | tokens/s | MFU (989 TFLOP/s) | peak GPU MiB "
          "| vs PyTorch's best, same GELU |")
    print("|---|---|---|---|---|---|")
    for name in ordered(group, GPT_ORDER):
        r = group[name]
        ref = refs.get(r.get("gelu", "exact"))
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else ""
        print(f"| {name} (batch {r['batch']}) | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{100 * r['mfu']:.1f}% | {r.get('peak_mem_mib', 0):.0f} | {ratio} |")


if __name__ == "__main__":
    main()
