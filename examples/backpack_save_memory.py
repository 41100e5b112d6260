"""BackPACK's "Saving memory in convolutions" example, with memconv's strategies.

BackPACK's example compares its two weight-VJP algorithms for ``BatchGrad`` on a CNN
(peak memory with ``memory_profiler``, run time, and a check that both give the same
individual gradients). Here the same CNN and the same measurements run for
BackPACK's two rows and for ``with memconv.save_memory(STRATEGY), backpack(BatchGrad())``
with every memconv strategy, each row in a fresh subprocess, on 64 real handwritten
digits (scikit-learn's, resized to 28×28: MNIST would need a download).

Usage::

    python examples/backpack_save_memory.py [--batch-size 64] [--side 28]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import memconv
from memconv.bench.runner import run_in_subprocess


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = [
        ("BackPACK save_memory=False", "backpack"),
        ("BackPACK save_memory=True", "backpack-save-memory"),
    ]
    rows += [(f"memconv.save_memory({s!r})", f"memconv-backpack:{s}") for s in memconv.strategies()]
    base = {"model": "seed", "batch": args.batch_size, "side": args.side, "repeats": args.repeats}
    print(f"Device: cpu, batch {args.batch_size} × 1×{args.side}×{args.side}, BatchGrad\n")
    print(f"{'configuration':34s} {'peak memory (MiB)':>18s} {'run time (s)':>13s}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, engine in rows:
            path = os.path.join(tmp, f"{engine}.pt")
            r = run_in_subprocess({**base, "engine": engine, "out": path})
            if "error" in r:
                print(f"{label:34s} failed: {r['error']}")
                continue
            print(f"{label:34s} {r['peak_rss_mib']:18,.1f} {r['time_s']:13.3f}", flush=True)
            results[label] = torch.load(path)
    reference = results[rows[0][0]]
    print(f"\n{'Parameter':<10}| Same individual gradients in every configuration?")
    ok = True
    for name, ref in reference.items():
        same = all(torch.allclose(r[name], ref, atol=1e-7) for r in results.values())
        ok &= same
        print(f"{name:<10}| {same}")
    if not ok:
        sys.exit("individual gradients differ")


if __name__ == "__main__":
    main()
