#!/usr/bin/env python3
"""Reads a ddptrain run's TensorBoard event files with TensorBoard itself.

Usage: tools/check_tensorboard.py RUN_DIR

Loads RUN_DIR with tensorboard's EventAccumulator (the reader behind
`tensorboard --logdir`), prints every scalar tag with its count and last
value, and checks them against the run's metrics.csv: the step tags have one
value per "step" row, the epoch tags one per "epoch" row, at the same steps
and (to float32 precision) the same values. Exits 1 on any mismatch, 2 when
tensorboard is not installed (pip install tensorboard).
"""
import csv
import math
import os
import sys

STEP_TAGS = {"train/loss": "train_loss", "train/lr": "lr", "train/samples_per_second": "samples_per_second"}
EPOCH_TAGS = {"train/epoch_loss": "train_loss", "test/loss": "test_loss", "test/accuracy": "test_acc"}


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print(f"usage: {argv[0]} RUN_DIR  (a ddptrain run directory)", file=sys.stderr)
        return 2
    run = argv[1]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        print("check_tensorboard: the tensorboard package is missing. Hint: pip install tensorboard", file=sys.stderr)
        return 2

    acc = EventAccumulator(run, size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    rows = list(csv.DictReader(open(os.path.join(run, "metrics.csv"))))
    expected = {"step": [r for r in rows if r["kind"] == "step"], "epoch": [r for r in rows if r["kind"] == "epoch"]}

    failures = []
    print(f"{'tag':28} {'count':>6} {'last step':>10} {'last value':>12}")
    for kind, tag_columns in (("step", STEP_TAGS), ("epoch", EPOCH_TAGS)):
        want = expected[kind]
        for tag, column in tag_columns.items():
            if tag not in tags:
                failures.append(f"tag {tag} missing (have {tags})")
                continue
            events = acc.Scalars(tag)
            last_step, last_value = (str(events[-1].step), f"{events[-1].value:.6g}") if events else ("-", "-")
            print(f"{tag:28} {len(events):6d} {last_step:>10} {last_value:>12}")
            if len(events) != len(want):
                failures.append(f"{tag}: {len(events)} values, metrics.csv has {len(want)} {kind} rows")
                continue
            for e, r in zip(events, want):
                value = float(r[column])
                if e.step != int(r["step"]) or not math.isclose(e.value, value, rel_tol=1e-6, abs_tol=1e-12):
                    failures.append(f"{tag} at step {e.step}: {e.value}, metrics.csv says step {r['step']}, {value}")
                    break
    extra = set(tags) - set(STEP_TAGS) - set(EPOCH_TAGS)
    if extra:
        failures.append(f"unexpected tags {sorted(extra)}")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else f"FAIL ({len(failures)} problem(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
