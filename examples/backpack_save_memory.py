"""BackPACK's "Saving memory in convolutions" example, with memconv's strategies.

BackPACK's example compares its two weight-VJP algorithms for ``BatchGrad`` on a CNN
(peak memory with ``memory_profiler``, run time, and a check that both give the same
individual gradients). Here the same CNN and the same measurements run for
BackPACK's two rows and for ``with memconv.save_memory(STRATEGY), backpack(BatchGrad())``
with every memconv strategy, each row in a fresh subprocess (memconv's benchmark
runner), on 64 real handwritten digits (scikit-learn's, resized to 28×28: MNIST would
need a download); every row's individual gradients are compared with torch.func's.

Usage::

    python examples/backpack_save_memory.py [--batch-size 64] [--side 28]
"""

from __future__ import annotations

import argparse
import sys

import memconv
from memconv.bench.runner import measure_engines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    labels = {
        "backpack": "BackPACK save_memory=False",
        "backpack-save-memory": "BackPACK save_memory=True",
    }
    labels.update(
        {f"memconv-backpack:{s}": f"memconv.save_memory({s!r})" for s in memconv.strategies()}
    )
    # torch.func is the independent reference every row is compared with
    engines = ["torch.func", *labels]
    base = {"model": "seed", "batch": args.batch_size, "side": args.side, "repeats": args.repeats}
    print(f"Device: cpu, batch {args.batch_size} × 1×{args.side}×{args.side}, BatchGrad\n")
    print(f"{'configuration':34s} {'peak memory (MiB)':>18s} {'run time (s)':>13s}")

    def show(row):
        if row["engine"] not in labels:
            return
        label = labels[row["engine"]]
        if "error" in row or "skipped" in row:
            print(f"{label:34s} failed: {row.get('error') or row.get('skipped')}", flush=True)
        else:
            print(f"{label:34s} {row['peak_rss_mib']:18,.1f} {row['time_s']:13.3f}", flush=True)

    rows = measure_engines(base, engines, task="grads", on_row=show)
    print("\nSame individual gradients as torch.func in every configuration?")
    ok = True
    for row in rows:
        if row["engine"] in labels:
            same = row.get("deviation", 1.0) < 1e-5
            ok &= same
            print(f"{labels[row['engine']]:34s} {same} (largest relative deviation "
                  f"{row.get('deviation', float('nan')):.1e})")  # fmt: skip
    if not ok:
        sys.exit("individual gradients differ")


if __name__ == "__main__":
    main()
