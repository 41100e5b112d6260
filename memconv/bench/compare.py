"""``memconv compare``: every strategy on the seed CNN, validated against each other.

For each strategy (and the plain-autograd floor and torch.func as the independent
reference) the per-sample gradient pass runs in a fresh subprocess; the table
reports the peak memory increase (MiB, ``memory_profiler``; and the allocator-level
figure), the median run time, and the largest relative deviation from the other
rows' results.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

import memconv

from .runner import run_engines

DEFAULT_EXTRA = ("autograd", "torch.func")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``memconv compare``."""
    parser.add_argument("--batch-size", type=int, default=64, help="N (default 64)")
    parser.add_argument("--side", type=int, default=28, help="image side (default 28)")
    parser.add_argument(
        "--data",
        choices=("digits", "photos", "random"),
        default="digits",
        help="real digits (scikit-learn), real photo crops (scikit-image), or noise",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument(
        "--strategies",
        default=",".join(memconv.strategies()),
        help="comma-separated strategy names (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")


def check_arguments(args) -> list[str]:
    """Validate the options; returns the engine names.

    Raises:
        ValueError: on a non-positive size, an unknown strategy or device.
    """
    for name in ("batch_size", "side", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.side < 27:
        raise ValueError("--side must be at least 27 for the seed CNN")
    torch.device(args.device)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in names:
        if s not in memconv.strategies():
            raise ValueError(f"unknown strategy {s!r}; accepted: {', '.join(memconv.strategies())}")
    return list(DEFAULT_EXTRA) + [f"memconv:{s}" for s in names]


def machine() -> dict:
    """CPU model, threads and versions, for the JSON record."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "memconv": memconv.__version__,
        "python": platform.python_version(),
    }


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| engine | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | result (MiB) | max rel. deviation |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | failed: {r['error']} | | | | |")
            continue
        alloc = "-" if r.get("peak_alloc_mib") is None else f"{r['peak_alloc_mib']:,.0f}"
        lines.append(
            f"| {r['engine']} | {r['peak_rss_mib']:,.0f} | {alloc} | {r['time_s']:.3f} | "
            f"{r['result_mib']:,.1f} | {r.get('deviation', float('nan')):.1e} |"
        )
    return "\n".join(lines)


def main(args) -> int:
    """Run the comparison and print the table; returns the exit status."""
    from tqdm import tqdm

    engines = check_arguments(args)
    base = {
        "model": "seed",
        "batch": args.batch_size,
        "side": args.side,
        "data": args.data,
        "device": args.device,
        "repeats": args.repeats,
    }
    rows = run_engines(base, engines, progress=lambda it: tqdm(it, desc="engines", unit="engine"))
    print(
        f"\nseed CNN of BackPACK's save-memory example, batch {args.batch_size} × 1×"
        f"{args.side}×{args.side} ({args.data}), {args.device}, float32\n"
    )
    print(format_table(rows))
    worst = max((r.get("deviation", 0.0) for r in rows if "error" not in r), default=0.0)
    failed = [r["engine"] for r in rows if "error" in r]
    print(f"\nlargest relative deviation between any two rows: {worst:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": base, "machine": machine(), "rows": rows}, f, indent=2)
    return 1 if failed or worst > 1e-4 else 0
